"""Spike: run a PyTorch-defined tiny Llama on XLA via torchax (PyTorch on JAX), CPU backend."""
import logging
import os
import sys
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import torch
import transformers

# --- compatibility shim (torchax 0.0.13 vs torch 2.13): torch 2.13 removed the named-tensor
# "Dimname" overloads that torchax references at import time. Without this shim `import torchax`
# fails with: AttributeError: The underlying op of 'aten.prod' has no overload name 'dim_Dimname'
if os.environ.get("TORCHAX_DIMNAME_SHIM", "1") == "1":
  import torch._ops as _ops
  _orig_getattr = _ops.OpOverloadPacket.__getattr__

  class _MissingOverload:
    def __init__(self, name):
      self.name = name

    def __repr__(self):
      return f"<missing overload {self.name}>"

  def _patched_getattr(self, key):
    try:
      return _orig_getattr(self, key)
    except AttributeError:
      if "imname" in key or "names" in key:
        print(f"[shim] missing overload aten.{self._qualified_op_name.split('::')[-1]}.{key} -> sentinel")
        return _MissingOverload(key)
      raise

  _ops.OpOverloadPacket.__getattr__ = _patched_getattr
import torchax
import torchax.interop as interop
from transformers import LlamaConfig, LlamaForCausalLM

print("python", sys.version.split()[0])
print("torch", torch.__version__, "transformers", transformers.__version__)
print("jax", jax.__version__, "jaxlib", jax.lib.__version__ if hasattr(jax.lib, "__version__") else "?",
      "torchax", torchax.__version__)
print("jax devices", jax.devices())

# --- compile counter via jax_log_compiles ---------------------------------
COMPILES = []


class _CompileCounter(logging.Handler):
  def emit(self, record):
    msg = record.getMessage()
    if "Compiling" in msg or "compiling" in msg:
      COMPILES.append(msg.splitlines()[0][:160])


_h = _CompileCounter()
_h.setLevel(logging.DEBUG)
logging.getLogger("jax").addHandler(_h)
jax.config.update("jax_log_compiles", True)
# keep stderr readable: jax_log_compiles logs at WARNING level
logging.getLogger("jax").propagate = False


def section(name):
  print("\n" + "=" * 10, name, "=" * 10, flush=True)


def run(name, fn):
  section(name)
  try:
    fn()
  except Exception:
    print("FAILED:", name)
    traceback.print_exc(file=sys.stdout)


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
  t0 = time.perf_counter()
  for _ in range(5):
    model(ids, use_cache=False)
  print(f"plain CPU torch forward: {(time.perf_counter()-t0)/5*1e3:.2f} ms/call")

env = torchax.default_env()
RESULTS = {}


def to_cpu(t):
  if hasattr(t, "_elem") or getattr(t, "device", torch.device("cpu")).type == "jax":
    return torch.from_numpy(__import__("numpy").asarray(interop.jax_view(t))).float()
  return t.float()


# --- 1. eager torchax: model.to('jax') ----------------------------------------
def eager():
  import copy
  m = copy.deepcopy(model)
  with env:
    m.to("jax")
    x = ids.to("jax")
    n0 = len(COMPILES)
    with torch.no_grad():
      times = []
      for i in range(3):
        t0 = time.perf_counter()
        out = m(x, use_cache=False).logits
        jax.block_until_ready(interop.jax_view(out))
        times.append((time.perf_counter() - t0) * 1e3)
    print("out type:", type(out).__name__, "device:", out.device, "shape", tuple(out.shape))
    print("eager per-call ms:", [f"{t:.1f}" for t in times])
    print("jax compiles during 3 eager forwards (per-op jits):", len(COMPILES) - n0)
    d = (to_cpu(out) - ref).abs().max().item()
    print(f"EAGER max|logits_torchax - logits_cpu| = {d:.3e}")
    RESULTS["eager_diff"] = d
    # greedy generation with DynamicCache, eager
    with torch.no_grad():
      g = m.generate(x, max_new_tokens=8, do_sample=False)
    gref = model.generate(ids, max_new_tokens=8, do_sample=False)
    g_cpu = torch.from_numpy(__import__("numpy").asarray(interop.jax_view(g)))
    print("eager generate() tokens equal CPU:", torch.equal(g_cpu, gref))
    print("  torchax:", g_cpu[0].tolist())
    print("  cpu    :", gref[0].tolist())


run("1. eager torchax (model.to('jax'))", eager)


# --- 2. torchax.compile(model) (JittableModule) ---------------------------------
def compiled_module():
  import copy
  m = copy.deepcopy(model)
  with env:
    m.to("jax")
    cm = torchax.compile(m)
    x = ids.to("jax")
    x2 = ids2.to("jax")
    n0 = len(COMPILES)
    times = []
    with torch.no_grad():
      for i in range(3):
        t0 = time.perf_counter()
        out = cm(x, use_cache=False).logits
        jax.block_until_ready(interop.jax_view(out))
        times.append((time.perf_counter() - t0) * 1e3)
      print("torchax.compile per-call ms (1st includes trace+compile):", [f"{t:.1f}" for t in times])
      print("compiles for 3 same-shape calls:", len(COMPILES) - n0)
      n1 = len(COMPILES)
      t0 = time.perf_counter()
      out2 = cm(x2, use_cache=False).logits
      jax.block_until_ready(interop.jax_view(out2))
      print(f"new shape (2,12): {(time.perf_counter()-t0)*1e3:.1f} ms, compiles: {len(COMPILES)-n1}")
    d = (to_cpu(out) - ref).abs().max().item()
    d2 = (to_cpu(out2) - ref2).abs().max().item()
    print(f"COMPILED max|diff| shape(2,8) = {d:.3e}, shape(2,12) = {d2:.3e}")
    RESULTS["compiled_diff"] = max(d, d2)


run("2. torchax.compile(model)", compiled_module)


# --- 3. functional forward + jax.jit via interop, count compiles ----------------------
def functional_jit():
  import copy
  m = copy.deepcopy(model)
  with env:
    m.to("jax")
    params = {k: v for k, v in m.state_dict().items()}

    def fwd(params, input_ids):
      return torch.func.functional_call(m, params, (input_ids,), {"use_cache": False}).logits

    jax_fwd = interop.jax_view(fwd)  # torch-callable -> jax-callable
    jitted = jax.jit(jax_fwd)
    jparams = interop.jax_view(params)
    jx = jnp.asarray(ids.numpy())
    jx2 = jnp.asarray(ids2.numpy())
    n0 = len(COMPILES)
    times = []
    for i in range(3):
      t0 = time.perf_counter()
      o = jitted(jparams, jx)
      o.block_until_ready()
      times.append((time.perf_counter() - t0) * 1e3)
    c_same = len(COMPILES) - n0
    print("functional jit per-call ms:", [f"{t:.2f}" for t in times])
    print("compiles (jax_log_compiles) for 3 same-shape calls:", c_same, "| _cache_size():", jitted._cache_size())
    n1 = len(COMPILES)
    t0 = time.perf_counter()
    o2 = jitted(jparams, jx2)
    o2.block_until_ready()
    print(f"new shape (2,12): {(time.perf_counter()-t0)*1e3:.1f} ms, compiles: {len(COMPILES)-n1}, _cache_size(): {jitted._cache_size()}")
    n2 = len(COMPILES)
    o3 = jitted(jparams, jx2).block_until_ready()
    print("repeat (2,12): compiles:", len(COMPILES) - n2, "_cache_size():", jitted._cache_size())
    import numpy as np
    d = np.abs(np.asarray(o) - ref.numpy()).max()
    d2 = np.abs(np.asarray(o2) - ref2.numpy()).max()
    print(f"FUNCTIONAL-JIT max|diff| (2,8) = {d:.3e}, (2,12) = {d2:.3e}")
    print("compile log lines:", COMPILES[n0:n0 + 2])
    # also the torch-side wrapper interop.jax_jit
    tj = interop.jax_jit(fwd)
    o4 = tj(params, ids.to("jax"))
    print("interop.jax_jit (torch-in/torch-out) result type:", type(o4).__name__,
          "max|diff| =", f"{(to_cpu(o4)-ref).abs().max().item():.3e}")
    # timing steady-state
    t0 = time.perf_counter()
    for _ in range(20):
      jitted(jparams, jx).block_until_ready()
    print(f"steady-state jitted forward (2,8): {(time.perf_counter()-t0)/20*1e3:.3f} ms/call")
    RESULTS["functional_diff"] = float(max(d, d2))


run("3. functional_call inside jax.jit", functional_jit)


# --- 4. in-place KV-cache update under jit + donation ---------------------------------
def kv_inplace():
  import numpy as np
  B, H, T, D = 2, 2, 16, 4

  def upd_index_copy(cache, new, pos):
    cache.index_copy_(2, pos, new)
    return cache

  def upd_slice(cache, new, pos):
    # pos is a 0-d int tensor (traced): slicing with a traced start
    cache[:, :, pos:pos + new.shape[2]] = new
    return cache

  def upd_noreturn(cache, new, pos):
    cache.index_copy_(2, pos, new)
    return new.sum()

  with env:
    for name, fn, mkpos in [
      ("index_copy_", upd_index_copy, lambda p: torch.tensor([p, p + 1])),
      ("slice assign (traced scalar pos)", upd_slice, lambda p: torch.tensor(p)),
    ]:
      try:
        jf = interop.jax_jit(fn)
        cache = torch.zeros(B, H, T, D, device="jax")
        n0 = len(COMPILES)
        for p in (0, 2, 4):
          new = torch.full((B, H, 2, D), float(p + 1), device="jax")
          cache = jf(cache, new, mkpos(p).to("jax"))
        c = to_cpu(cache)
        ok = (c[:, :, 0:2] == 1).all() and (c[:, :, 2:4] == 3).all() and (c[:, :, 4:6] == 5).all() and (c[:, :, 6:] == 0).all()
        print(f"[{name}] correct={bool(ok)} compiles for 3 steps (varying pos)={len(COMPILES)-n0}")
      except Exception:
        print(f"[{name}] FAILED")
        traceback.print_exc(file=sys.stdout)

    # mutation of an input without returning it: is it visible outside jit?
    try:
      jf = interop.jax_jit(upd_noreturn)
      cache = torch.zeros(B, H, T, D, device="jax")
      new = torch.ones(B, H, 2, D, device="jax")
      jf(cache, new, torch.tensor([0, 1]).to("jax"))
      print("[mutate input w/o return] outside tensor updated:", bool(to_cpu(cache).abs().sum() > 0))
    except Exception:
      print("[mutate input w/o return] FAILED")
      traceback.print_exc(file=sys.stdout)

    # eager (non-jit) in-place on a jax tensor
    cache = torch.zeros(B, H, T, D, device="jax")
    cache.index_copy_(2, torch.tensor([3]).to("jax"), torch.ones(B, H, 1, D, device="jax"))
    cache[:, :, 5] = 2.0
    c = to_cpu(cache)
    print("[eager in-place index_copy_ + slice assign] correct:", bool(c[:, :, 3].eq(1).all() and c[:, :, 5].eq(2).all()))

    # donation
    for how in ["interop.jax_jit(kwargs_for_jax_jit={'donate_argnums':(0,)})", "raw jax.jit(jax_view(fn), donate_argnums=0)"]:
      try:
        if how.startswith("interop"):
          jf = interop.jax_jit(upd_index_copy, kwargs_for_jax_jit={"donate_argnums": (0,)})
          cache = torch.zeros(B, H, T, D, device="jax")
          old_arr = interop.jax_view(cache)
          ptr_before = old_arr.unsafe_buffer_pointer()
          new = torch.ones(B, H, 2, D, device="jax")
          out = jf(cache, new, torch.tensor([0, 1]).to("jax"))
          out_arr = interop.jax_view(out)
        else:
          jf = jax.jit(interop.jax_view(upd_index_copy), donate_argnums=0)
          old_arr = jnp.zeros((B, H, T, D))
          ptr_before = old_arr.unsafe_buffer_pointer()
          out_arr = jf(old_arr, jnp.ones((B, H, 2, D)), jnp.array([0, 1]))
        out_arr.block_until_ready()
        print(f"[donation via {how}] input deleted={old_arr.is_deleted()} "
              f"same buffer reused={out_arr.unsafe_buffer_pointer() == ptr_before}")
        try:
          _ = np.asarray(old_arr)
          print("   reading donated input still works")
        except Exception as e:
          print("   reading donated input ->", type(e).__name__ + ":", str(e).splitlines()[0])
      except Exception:
        print(f"[donation via {how}] FAILED")
        traceback.print_exc(file=sys.stdout)


run("4. in-place KV cache under jit + donation", kv_inplace)


# --- 5. HF StaticCache decode step under jit (bonus) -------------------------------------
def static_cache_decode():
  import copy
  import numpy as np
  from transformers import StaticCache
  m = copy.deepcopy(model)
  max_len = 32
  # CPU reference greedy with StaticCache
  ref_tokens = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
  with env:
    m.to("jax")
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    def step(input_ids, cache_position, cache):
      out = m(input_ids, past_key_values=cache, cache_position=cache_position, use_cache=True)
      return out.logits[:, -1].argmax(-1)
    # cache tensors are mutated in place inside the step: does jax_jit propagate that?
    jstep = interop.jax_jit(step)
    x = ids.to("jax")
    toks = []
    n0 = len(COMPILES)
    nxt = jstep(x, torch.arange(ids.shape[1]).to("jax"), cache)
    print("prefill ok; cache layer0 keys nonzero after jitted prefill:",
          bool(to_cpu(cache.layers[0].keys).abs().sum() > 0) if hasattr(cache, "layers") else "n/a")
  print("ref", ref_tokens[0].tolist())


run("5. bonus: HF StaticCache prefill under jax_jit", static_cache_decode)


# --- 6. torchax.compile with use_cache fixed in config (no traced python kwargs) -----------
def compiled_module_cfg():
  import copy
  m = copy.deepcopy(model)
  # config.return_dict=False was tried first and fails inside transformers 5.24:
  #   AttributeError: 'tuple' object has no attribute 'last_hidden_state'
  # so wrap the model in a module whose forward returns only the logits tensor.
  class LogitsOnly(torch.nn.Module):
    def __init__(self, inner):
      super().__init__()
      self.inner = inner

    def forward(self, input_ids):
      return (self.inner(input_ids, use_cache=False).logits,)

  with env:
    m.to("jax")
    cm = torchax.compile(LogitsOnly(m))
    x, x2 = ids.to("jax"), ids2.to("jax")
    n0 = len(COMPILES)
    times = []
    with torch.no_grad():
      for i in range(3):
        t0 = time.perf_counter()
        out = cm(x)[0]
        jax.block_until_ready(interop.jax_view(out))
        times.append((time.perf_counter() - t0) * 1e3)
      print("torchax.compile(LogitsOnly) per-call ms:", [f"{t:.2f}" for t in times],
            "compiles for 3 same-shape calls:", len(COMPILES) - n0)
      n1 = len(COMPILES)
      out2 = cm(x2)[0]
      jax.block_until_ready(interop.jax_view(out2))
      print("new shape (2,12) compiles:", len(COMPILES) - n1)
    print(f"max|diff| (2,8) = {(to_cpu(out)-ref).abs().max().item():.3e}, (2,12) = {(to_cpu(out2)-ref2).abs().max().item():.3e}")


run("6. torchax.compile(LogitsOnly(model)) (no python kwargs, tensor output)", compiled_module_cfg)


# --- 7. index_copy_ KV update: exact compile count via raw jax.jit _cache_size ----------------
def kv_cache_size():
  B, H, T, D = 2, 2, 16, 4

  def upd(cache, new, pos):
    cache.index_copy_(2, pos, new)
    return cache

  jf = jax.jit(interop.jax_view(upd), donate_argnums=0)
  cache = jnp.zeros((B, H, T, D))
  for p in range(0, 8, 2):
    cache = jf(cache, jnp.full((B, H, 2, D), p + 1.0), jnp.array([p, p + 1]))
  print("index_copy_ 4 steps with varying pos tensor: _cache_size() =", jf._cache_size(),
        "| cache[0,0,:9,0] =", np.asarray(cache)[0, 0, :9, 0].tolist())


import numpy as np
run("7. index_copy_ compile count (raw jax.jit + donate)", kv_cache_size)


# --- 8. HF StaticCache decode as a pure function (cache tensors in/out) under jax.jit ---------
def static_cache_functional():
  import copy
  from transformers import StaticCache
  m = copy.deepcopy(model)
  MAX = 32
  L = cfg.num_hidden_layers
  kvh, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
  ref_tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              cache_implementation="static")
  with env:
    m.to("jax")
    params = dict(m.state_dict())

    def step(params, input_ids, cache_position, keys, values, cum):
      cache = StaticCache(config=cfg, max_cache_len=MAX)
      for i, layer in enumerate(cache.layers):
        layer.keys, layer.values, layer.cumulative_length = keys[i], values[i], cum[i]
        layer.device = keys[i].device
        layer.batch_size, layer.num_heads = keys[i].shape[:2]
        layer.k_head_dim = layer.v_head_dim = keys[i].shape[-1]
        layer.is_initialized = True
      out = torch.func.functional_call(m, params, (input_ids,),
                                       {"past_key_values": cache, "cache_position": cache_position, "use_cache": True})
      nxt = out.logits[:, -1].argmax(-1)
      return (nxt, [l.keys for l in cache.layers], [l.values for l in cache.layers],
              [l.cumulative_length for l in cache.layers])

    jstep = jax.jit(interop.jax_view(step), donate_argnums=(3, 4, 5))
    jp = interop.jax_view(params)
    keys = [jnp.zeros((2, kvh, MAX, hd)) for _ in range(L)]
    values = [jnp.zeros((2, kvh, MAX, hd)) for _ in range(L)]
    cum = [jnp.array(0, dtype=jnp.int32) for _ in range(L)]
    T = ids.shape[1]
    t0 = time.perf_counter()
    nxt, keys, values, cum = jstep(jp, jnp.asarray(ids.numpy()), jnp.arange(T), keys, values, cum)
    print(f"prefill ok ({(time.perf_counter()-t0)*1e3:.0f} ms incl. compile), cache_size", jstep._cache_size())
    toks = [np.asarray(nxt)]
    times = []
    for s in range(5):
      t0 = time.perf_counter()
      nxt, keys, values, cum = jstep(jp, nxt[:, None], jnp.array([T + s]), keys, values, cum)
      nxt.block_until_ready()
      times.append((time.perf_counter() - t0) * 1e3)
      toks.append(np.asarray(nxt))
    print("decode step ms:", [f"{t:.2f}" for t in times], "| _cache_size() after prefill+5 decodes:", jstep._cache_size())
    got = np.stack(toks, 1)
    print("jitted StaticCache greedy tokens:", got[0].tolist())
    print("CPU generate(static) tokens     :", ref_tokens[0, T:].tolist())
    print("EQUAL:", got.tolist() == ref_tokens[:, T:].tolist())


run("8. HF StaticCache functional decode under jax.jit", static_cache_functional)

section("SUMMARY2")
print("total compiles logged:", len(COMPILES))

section("SUMMARY")
print(RESULTS)
print("total compiles logged:", len(COMPILES))
