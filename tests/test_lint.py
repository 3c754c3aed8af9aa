"""The checks .ci/run runs before the tests (ruff, ruff format, lint-imports, mypy) catch what they are there for.

Each is run on a copy of real project code with one defect put in, with the project's own configuration
(pyproject.toml), and must fail naming it; the unbroken copy passes where that is cheap to show. CI runs the
same tools over the whole tree; these tests only prove that a break would be seen.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def _tool(name: str) -> str:
    """The console script installed beside this interpreter (scripts/setup.sh installs the test extra)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def _copy(relative: str, to: Path) -> Path:
    target = to / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / relative, target)
    return target


def test_ruff_check_fails_on_an_unused_import_and_a_long_line(tmp_path: Path) -> None:
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    module = _copy("engine/radix_cache.py", tmp_path)
    assert _run(_tool("ruff"), "check", ".", cwd=tmp_path).returncode == 0
    text = module.read_text(encoding="utf-8")
    module.write_text(text.replace("import heapq\n", "import heapq\nimport json\n") + f"# {'x' * 130}\n")
    result = _run(_tool("ruff"), "check", "--output-format", "concise", ".", cwd=tmp_path)
    assert result.returncode == 1, result.stdout
    assert "F401" in result.stdout and "E501" in result.stdout, result.stdout


def test_ruff_format_fails_on_unformatted_code(tmp_path: Path) -> None:
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    module = _copy("engine/radix_cache.py", tmp_path)
    assert _run(_tool("ruff"), "format", "--check", ".", cwd=tmp_path).returncode == 0
    module.write_text(module.read_text(encoding="utf-8") + "\nx = {  'a':1 }\n", encoding="utf-8")
    result = _run(_tool("ruff"), "format", "--check", ".", cwd=tmp_path)
    assert result.returncode == 1 and "radix_cache.py" in result.stdout, result.stdout


def _layers() -> list[str]:
    config = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    (contract,) = (c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers")
    return contract["layers"]


def test_every_module_of_engine_and_graphs_sits_in_a_layer() -> None:
    """The layers name modules one by one (engine/ and graphs/ each hold two layers), so a new module that
    nobody added to the contract would escape it: every one must be named, or sit in a named package."""
    named = {name.strip() for layer in _layers() for name in layer.replace("|", ":").split(":")}
    missing = []
    for package in ("engine", "graphs"):
        for path in sorted((ROOT / package).iterdir()):
            if path.name.startswith("__") or not (path.suffix == ".py" or (path / "__init__.py").exists()):
                continue
            module = f"{package}.{path.stem}"
            if module not in named:
                missing.append(module)
    assert missing == [], f"add these to a layer in pyproject.toml [tool.importlinter]: {missing}"


def test_lint_imports_fails_on_an_import_up_the_layers(tmp_path: Path) -> None:
    """A copy of the three packages passes the contract as it is, and fails once the scheduler (core) imports
    the server (application)."""
    for package in ("engine", "graphs", "backends"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.c", "*.h", "__pycache__"))
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    command = (_tool("lint-imports"), "--no-cache")
    kept = _run(*command, cwd=tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    scheduler = tmp_path / "engine" / "scheduler.py"
    scheduler.write_text(scheduler.read_text(encoding="utf-8") + "\nimport engine.server.app\n", encoding="utf-8")
    broken = _run(*command, cwd=tmp_path)
    assert broken.returncode == 1, broken.stdout
    assert "BROKEN" in broken.stdout and "engine.scheduler -> engine.server.app" in broken.stdout, broken.stdout


@pytest.mark.parametrize(
    "defect,message",
    [
        ('\n\ndef _broken() -> int:\n    return "not an int"\n', "Incompatible return value type"),
        ("\n\ndef _broken(node: RadixNode | None) -> int:\n    return node.last_access\n", "union-attr"),
    ],
)
def test_mypy_fails_on_a_type_error(tmp_path: Path, defect: str, message: str) -> None:
    """The project's mypy settings over a copy of a core module: clean as it is, an error once broken."""
    config = tmp_path / "mypy.toml"
    settings = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["mypy"]
    lines = ["[tool.mypy]"] + [
        f"{key} = {value!r}".replace("'", '"').replace("True", "true").replace("False", "false")
        for key, value in settings.items()
        if key not in ("files", "exclude", "overrides")
    ]
    config.write_text("\n".join(lines) + "\n", encoding="utf-8")
    module = _copy("engine/radix_cache.py", tmp_path)
    command = (sys.executable, "-m", "mypy", "--config-file", str(config), "--no-incremental", str(module))
    clean = _run(*command, cwd=tmp_path)
    assert clean.returncode == 0, clean.stdout
    module.write_text(module.read_text(encoding="utf-8") + defect, encoding="utf-8")
    broken = _run(*command, cwd=tmp_path)
    assert broken.returncode == 1 and message in broken.stdout, broken.stdout
