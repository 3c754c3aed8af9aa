"""Bad input gets one clear error: the right exception class, a message naming the problem.

The API raises engine.errors.* / engine.platform.DeviceUnavailableError; the CLI exits with
status 2 and prints a single `error: ...` line (no traceback).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
from conftest import REPO_ROOT, track
from helpers import greedy

from engine.engine import Engine
from engine.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError
from engine.platform import DeviceUnavailableError
from engine.sampling_params import SamplingParams

ENGINE_OPTIONS = dict(device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=1024)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_cli_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit status 2, exactly one stderr line, starting with 'error:', naming every needle; no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr[-3000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr[-2000:]
    line = error_lines[0]
    # The message is that one line: nothing of it continues on the following lines.
    after = result.stderr.split(line, 1)[1]
    assert after.strip() == "", f"error message runs over several lines: {line!r} + {after[:500]!r}"
    for needle in needles:
        assert needle.lower() in line.lower(), (needle, line)
    return line


# ---------------------------------------------------------------------------------------------
# Model loading
# ---------------------------------------------------------------------------------------------


def test_missing_model_path(tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        Engine(model=missing, **ENGINE_OPTIONS)
    assert "no-such-model" in str(info.value)


def write_config(folder, data: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    return str(folder)


GPT2_CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
MADE_UP_CONFIG = {"model_type": "frobnicator", "architectures": ["FrobnicatorForCausalLM"], "hidden_size": 64}


def test_unsupported_architecture_known_to_transformers(tmp_path) -> None:
    folder = write_config(tmp_path / "gpt2", GPT2_CONFIG)
    with pytest.raises(UnsupportedArchitectureError) as info:
        Engine(model=folder, **ENGINE_OPTIONS)
    assert "gpt2" in str(info.value) and "llama" in str(info.value)  # names the type and what is supported


def test_unsupported_architecture_unknown_to_transformers(tmp_path) -> None:
    """A model_type nobody knows is an unsupported architecture too, said in one line.

    Engine bug: engine/loader/resolve.py _hf_config wraps AutoConfig's ValueError as a plain
    ModelLoadError ("config.json cannot be read: ...") carrying transformers' multi-paragraph text.
    """
    folder = write_config(tmp_path / "frob", MADE_UP_CONFIG)
    with pytest.raises(ModelLoadError) as info:
        Engine(model=folder, **ENGINE_OPTIONS)
    assert "frobnicator" in str(info.value)
    assert isinstance(info.value, UnsupportedArchitectureError), f"{type(info.value).__name__}: {info.value}"
    assert "\n" not in str(info.value)


def test_preset_without_dummy_weights() -> None:
    with pytest.raises(ModelLoadError, match="dummy"):
        Engine(model="smollm2-135m", **ENGINE_OPTIONS)


def test_unknown_load_format() -> None:
    with pytest.raises(ModelLoadError, match="pickle"):
        Engine(model=None, load_format="pickle", **ENGINE_OPTIONS)


def copy_checkpoint(source: str, dest) -> str:
    shutil.copytree(source, dest)
    return str(dest)


def test_truncated_safetensors(tiny_checkpoints: dict[str, str], tmp_path) -> None:
    folder = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "truncated")
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(ModelLoadError) as info:
        Engine(model=folder, **ENGINE_OPTIONS)
    assert "model.safetensors" in str(info.value) and "truncated" in str(info.value)


def test_corrupt_safetensors_header(tiny_checkpoints: dict[str, str], tmp_path) -> None:
    folder = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "corrupt")
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as handle:
        handle.seek(8)
        handle.write(b"\x00garbage-not-json")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        Engine(model=folder, **ENGINE_OPTIONS)


def test_missing_shard(tiny_checkpoints: dict[str, str], tmp_path) -> None:
    folder = copy_checkpoint(tiny_checkpoints["mistral"], tmp_path / "missing-shard")
    shard = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))[-1]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(ModelLoadError, match="missing") as info:
        Engine(model=folder, **ENGINE_OPTIONS)
    assert shard in str(info.value)


def test_checkpoint_missing_a_tensor(tiny_checkpoints: dict[str, str], tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy_checkpoint(tiny_checkpoints["qwen3"], tmp_path / "missing-tensor")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing") as info:
        Engine(model=folder, **ENGINE_OPTIONS)
    assert "down_proj" in str(info.value)


@pytest.mark.parametrize("keep", ["header", "half"])
def test_truncated_gguf(smol_gguf_path: str, tmp_path, monkeypatch: pytest.MonkeyPatch, keep: str) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))  # GGUF metadata cache: keep it local
    size = os.path.getsize(smol_gguf_path)
    count = 4096 if keep == "header" else size // 2
    path = tmp_path / "truncated.gguf"
    with open(smol_gguf_path, "rb") as source, open(path, "wb") as dest:
        dest.write(source.read(count))
    with pytest.raises(ModelLoadError) as info:
        Engine(model=str(path), **ENGINE_OPTIONS)
    assert "truncated.gguf" in str(info.value) and "GGUF" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------


def test_unknown_device() -> None:
    with pytest.raises(DeviceUnavailableError, match="tpu") as info:
        Engine(model=None, device="tpu", disable_graphs=True)
    assert "cpu" in str(info.value)  # lists the choices


def absent_device() -> str:
    """An accelerator this machine does not have (cuda and rocm never coexist, so there is always one)."""
    from backends import platform_class

    return next(name for name in ("npu", "hpu", "rocm", "cuda") if not platform_class(name)().is_available())


def test_device_not_present_here() -> None:
    device = absent_device()
    with pytest.raises(DeviceUnavailableError, match=device):
        Engine(model=None, device=device, disable_graphs=True)


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_values(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_invalid_sampling_values_changed_after_creation_are_caught_at_submit(smol_engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    params.top_p = 1.5
    with pytest.raises(InvalidRequestError, match="top_p"):
        smol_engine.add_request("Hello", params)
    assert not smol_engine.has_unfinished()


def test_prompt_longer_than_context_then_engine_still_serves(
    engine_cache: Callable[..., Engine], tiny_checkpoints: dict[str, str]
) -> None:
    engine = engine_cache(tiny_checkpoints["qwen3"], max_model_len=64)
    assert engine.max_model_len == 64
    with pytest.raises(InvalidRequestError, match="context") as info:
        engine.add_request(list(range(3, 67)), greedy(4))  # 64 tokens: no room for one more
    assert "64" in str(info.value)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request([5, 6, engine.model_config.vocab_size], greedy(4))
    with pytest.raises(InvalidRequestError, match="token"):
        engine.add_request([], greedy(4))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request("text needs a tokenizer", greedy(4))
    assert not engine.has_unfinished() and engine.kv_pages_in_use() == 0
    # A batch with one bad prompt is rejected as a whole and leaves nothing queued.
    with pytest.raises(InvalidRequestError):
        engine.generate([[5, 6, 7], list(range(3, 80))], greedy(4))
    assert not engine.has_unfinished() and engine.kv_pages_in_use() == 0
    # The longest prompt that fits still gets its one token.
    outputs = engine.generate([list(range(3, 66)), [5, 6, 7]], greedy(4))
    assert [len(o.token_ids) for o in outputs] == [1, 4]
    assert outputs[0].finish_reason == "length"


def test_bad_request_leaves_smollm2_serving(smol_engine: Engine) -> None:
    before = smol_engine.generate(["The capital of France is"], greedy(6))[0].token_ids
    with pytest.raises(InvalidRequestError):
        smol_engine.add_request("x " * (smol_engine.max_model_len + 10), greedy(4))
    with pytest.raises(InvalidRequestError):
        smol_engine.generate(["ok", ""], greedy(4))
    with pytest.raises(InvalidRequestError):
        smol_engine.generate(["a", "b"], [greedy(4)])  # params list of the wrong length
    assert not smol_engine.has_unfinished() and smol_engine.kv_pages_in_use() == 0
    assert smol_engine.generate(["The capital of France is"], greedy(6))[0].token_ids == before


def test_duplicate_request_id_is_rejected(smol_engine: Engine) -> None:
    smol_engine.add_request("Hello", greedy(2), request_id="dup")
    with pytest.raises(InvalidRequestError, match="dup"):
        smol_engine.add_request("Hello again", greedy(2), request_id="dup")
    while smol_engine.has_unfinished():
        smol_engine.step()


def test_abort_frees_pages_and_other_requests_continue(smol_engine: Engine) -> None:
    keep = smol_engine.add_request("The capital of France is", greedy(8))
    drop = smol_engine.add_request("Tell me a long story about a dragon.", greedy(50))
    finished = {}
    for _ in range(3):
        for output in smol_engine.step():
            finished[output.request_id] = output
    smol_engine.abort(drop)
    smol_engine.check_kv_invariant()
    while smol_engine.has_unfinished():
        for output in smol_engine.step():
            finished[output.request_id] = output
    assert finished[keep].finished and len(finished[keep].token_ids) == 8
    assert not finished[drop].finished
    solo = smol_engine.generate(["The capital of France is"], greedy(8))[0].token_ids
    assert finished[keep].token_ids == solo


def test_unknown_engine_option() -> None:
    from engine.errors import EngineError

    with pytest.raises(EngineError, match="no_such_option"):
        Engine(model=None, no_such_option=1)


# ---------------------------------------------------------------------------------------------
# CLI: one line, exit status 2
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--max-tokens", "0"], ["max_tokens"]),
        (["--temperature", "-1"], ["temperature"]),
        (["--top-p", "1.5"], ["top_p"]),
        (["--device", "tpu"], ["tpu"]),
        (["--device", "ABSENT"], ["ABSENT"]),
        (["--model", "/definitely/not/a/model"], ["/definitely/not/a/model"]),
    ],
    ids=["max-tokens", "temperature", "top-p", "unknown-device", "absent-device", "missing-model"],
)
def test_cli_fast_errors(args: list[str], needles: list[str]) -> None:
    if "ABSENT" in args:
        device = absent_device()
        args, needles = [device if a == "ABSENT" else a for a in args], [device]
    assert_cli_error(run_cli("run", "--prompt", "hi", *args), *needles)


def test_cli_unsupported_architecture(tmp_path) -> None:
    known = write_config(tmp_path / "gpt2", GPT2_CONFIG)
    assert_cli_error(run_cli("run", "--model", known, "--disable-graphs"), "gpt2")


def test_cli_unknown_architecture_is_one_line(tmp_path) -> None:
    """Fails while the loader passes transformers' multi-paragraph message through (see above)."""
    made_up = write_config(tmp_path / "frob", MADE_UP_CONFIG)
    assert_cli_error(run_cli("run", "--model", made_up, "--disable-graphs"), "frobnicator")


def test_cli_text_prompt_for_model_without_tokenizer(tiny_checkpoints: dict[str, str]) -> None:
    result = run_cli("run", "--model", tiny_checkpoints["qwen3"], "--disable-graphs", "--prompt", "hello")
    assert_cli_error(result, "tokenizer")


def test_cli_prompt_longer_than_context() -> None:
    prompt = "The capital of France is a city with a long history, many museums and old bridges over the river."
    result = run_cli("run", "--disable-graphs", "--max-model-len", "16", "--prompt", prompt)
    assert_cli_error(result, "context", "16")


def test_short_context_gets_a_kv_pool(tiny_checkpoints: dict[str, str]) -> None:
    """A context shorter than one page still gets a pool when the pool is sized automatically.

    Engine bug: engine/engine.py _allocate_kv_pool sizes the pool to
    max_num_seqs * max_model_len tokens and then floors to whole pages, so e.g.
    `engine run --max-model-len 4` (max_num_seqs 1, page 16) gets 0 pages and fails with
    "KV pool too small: 4 tokens" although the user asked for nothing unusual.
    """
    options = dict(device="cpu", dtype="float32", disable_graphs=True, page_size=16, max_num_seqs=1)
    engine = track(Engine(model=tiny_checkpoints["qwen3"], max_model_len=4, **options))
    assert engine.max_model_len == 4
    assert len(engine.generate([[5, 6, 7]], greedy(8))[0].token_ids) == 1  # the context ends at 4 tokens


def test_engine_built_after_errors_is_clean(tiny_checkpoints: dict[str, str]) -> None:
    """Failed constructions leave no global state behind that breaks the next engine."""
    with pytest.raises(ModelLoadError):
        Engine(model="/nope", **ENGINE_OPTIONS)
    engine = track(Engine(model=tiny_checkpoints["qwen2"], **ENGINE_OPTIONS))
    assert len(engine.generate([[3, 4, 5]], greedy(3))[0].token_ids) == 3


def test_serve_rejects_a_bad_thread_count_before_loading_anything() -> None:
    assert_cli_error(run_cli("serve", "--torch-threads", "0"), "--torch-threads", ">= 1")
