"""Spike: run a PyTorch-defined tiny Llama on XLA via torch-xla (PJRT_DEVICE=CPU)."""
import os
import sys
import time
import traceback

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
print("python", sys.version.split()[0], "torch", torch.__version__, flush=True)
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

print("torch_xla", torch_xla.__version__, "transformers", transformers.__version__, flush=True)


def section(name):
  print("\n" + "=" * 10, name, "=" * 10, flush=True)


def compiles():
  d = met.metric_data("CompileTime")
  return 0 if d is None else d[0]


def run(name, fn):
  section(name)
  try:
    fn()
  except Exception:
    print("FAILED:", name)
    traceback.print_exc(file=sys.stdout)


dev = None


def tiny():
  global dev
  try:
    dev = torch_xla.device()
  except Exception as e:
    print("torch_xla.device() failed:", repr(e), "-> xm.xla_device()")
    dev = xm.xla_device()
  print("device:", dev, "| hw:", xm.xla_device_hw(dev) if hasattr(xm, "xla_device_hw") else "?")
  torch.manual_seed(0)
  lin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
  x = torch.randn(3, 16)
  ref = lin(x)
  lx = lin.to(dev)
  out = lx(x.to(dev))
  torch_xla.sync()
  print("tiny MLP max|diff| =", (out.cpu() - ref).abs().max().item(), "compiles:", compiles())


run("1. tiny torch model on xla device", tiny)


def llama():
  import copy
  torch.manual_seed(0)
  cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=128)
  model = LlamaForCausalLM(cfg).eval()
  print("attn impl:", model.config._attn_implementation)
  ids = torch.randint(0, 256, (2, 8))
  ids2 = torch.randint(0, 256, (2, 12))
  with torch.no_grad():
    ref = model(ids, use_cache=False).logits
    ref2 = model(ids2, use_cache=False).logits
  m = copy.deepcopy(model).to(dev)
  xids, xids2 = ids.to(dev), ids2.to(dev)
  torch_xla.sync()
  c0 = compiles()
  times, per_call = [], []
  with torch.no_grad():
    for i in range(3):
      cb = compiles()
      t0 = time.perf_counter()
      out = m(xids, use_cache=False).logits
      o = out.cpu()  # forces execution
      times.append((time.perf_counter() - t0) * 1e3)
      per_call.append(compiles() - cb)
    print("3 same-shape forwards (2,8): ms", [f"{t:.1f}" for t in times], "compiles per call", per_call)
    cb = compiles()
    t0 = time.perf_counter()
    o2 = m(xids2, use_cache=False).logits.cpu()
    print(f"new shape (2,12): {(time.perf_counter()-t0)*1e3:.1f} ms, compiles: {compiles()-cb}")
    cb = compiles()
    o3 = m(xids2, use_cache=False).logits.cpu()
    print("repeat (2,12): compiles:", compiles() - cb)
  print(f"LLAMA max|logits_xla - logits_cpu| (2,8) = {(o - ref).abs().max().item():.3e}, (2,12) = {(o2 - ref2).abs().max().item():.3e}")
  t0 = time.perf_counter()
  with torch.no_grad():
    for _ in range(10):
      m(xids, use_cache=False).logits.cpu()
  print(f"steady-state (2,8) forward incl. trace+transfer: {(time.perf_counter()-t0)/10*1e3:.2f} ms/call")
  print("total CompileTime count:", compiles())
  # greedy generate (DynamicCache: shapes grow every step -> recompiles)
  cb = compiles()
  with torch.no_grad():
    g = m.generate(xids, max_new_tokens=6, do_sample=False)
    gref = model.generate(ids, max_new_tokens=6, do_sample=False)
  print("generate(DynamicCache) tokens equal CPU:", torch.equal(g.cpu(), gref), "compiles during generate:", compiles() - cb)
  print(met.short_metrics_report())


run("2. tiny Llama on XLA vs CPU", llama)


def kv_inplace():
  B, H, T, D = 2, 2, 16, 4
  # (a) index_copy_ with a position *tensor* that changes every step
  cache = torch.zeros(B, H, T, D, device=dev)
  torch_xla.sync()
  cb = compiles()
  per = []
  for p in range(0, 8, 2):
    c0 = compiles()
    cache.index_copy_(2, torch.tensor([p, p + 1]).to(dev), torch.full((B, H, 2, D), p + 1.0).to(dev))
    torch_xla.sync()
    per.append(compiles() - c0)
  print("[index_copy_, varying pos tensor] cache[0,0,:9,0] =", cache.cpu()[0, 0, :9, 0].tolist(), "compiles per step", per)
  # (b) slice assignment with a python-int position (value baked into the graph)
  cache = torch.zeros(B, H, T, D, device=dev)
  torch_xla.sync()
  per = []
  for p in range(0, 8, 2):
    c0 = compiles()
    cache[:, :, p:p + 2] = torch.full((B, H, 2, D), p + 1.0).to(dev)
    torch_xla.sync()
    per.append(compiles() - c0)
  print("[slice assign, python-int pos] cache[0,0,:9,0] =", cache.cpu()[0, 0, :9, 0].tolist(), "compiles per step", per)


run("3. in-place KV-cache update on XLA (lazy tensors)", kv_inplace)


def static_generate():
  torch.manual_seed(0)
  cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=128)
  model = LlamaForCausalLM(cfg).eval()
  ids = torch.randint(0, 256, (2, 8))
  gref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                        cache_implementation="static")
  m = model.to(dev)
  for run_i in range(2):
    cb = compiles()
    t0 = time.perf_counter()
    with torch.no_grad():
      g = m.generate(ids.to(dev), attention_mask=torch.ones_like(ids).to(dev), max_new_tokens=12,
                     do_sample=False, cache_implementation="static")
    g = g.cpu()
    print(f"generate(static cache, 12 new tokens) run {run_i}: {(time.perf_counter()-t0)*1e3:.0f} ms, "
          f"compiles: {compiles()-cb}, tokens equal CPU: {torch.equal(g, gref)}")


run("4. HF generate with StaticCache on XLA (compile count per decode step)", static_generate)


def dynamo_openxla():
  torch.manual_seed(0)
  cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=128)
  model = LlamaForCausalLM(cfg).eval()
  ids = torch.randint(0, 256, (2, 8))
  with torch.no_grad():
    ref = model(ids, use_cache=False).logits
  m = model.to(dev)
  cm = torch.compile(m, backend="openxla", fullgraph=False)
  xids = ids.to(dev)
  times, per = [], []
  with torch.no_grad():
    for i in range(3):
      cb = compiles()
      t0 = time.perf_counter()
      o = cm(xids, use_cache=False).logits.cpu()
      times.append((time.perf_counter() - t0) * 1e3)
      per.append(compiles() - cb)
  print("torch.compile(backend='openxla') ms:", [f"{t:.1f}" for t in times], "XLA compiles per call:", per,
        f"max|diff| = {(o-ref).abs().max().item():.3e}")


run("5. torch.compile(backend='openxla')", dynamo_openxla)
