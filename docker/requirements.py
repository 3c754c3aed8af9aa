"""Pip inputs for the images: this package's requirements and the suite's pins, around the image's own torch.

    python3 docker/requirements.py [--extra test] > /tmp/requirements.txt   # setup.cfg's requirements
    python3 docker/requirements.py --constraints > /tmp/constraints.txt     # scripts/constraints.txt, adjusted

Each image brings its torch before this runs: the vendor's build in its base image (CUDA, ROCm, Gaudi),
or one installed first (the CPU build, torch for torch_npu). PyPI's torch has no HPU bridge and no
ROCm, so pip must never replace that torch: the requirements leave torch out (the Gaudi 1.24 image's
torch 2.10 is below setup.cfg's floor; vllm-gaudi installs vLLM over it the same way), and leave triton
out where the image already has a Triton (the CUDA build's triton, ROCm's pytorch-triton-rocm). The
constraints are scripts/constraints.txt, the versions the suite last passed with, except that torch and
any Triton the image has are pinned to the image's versions, so that no dependency can pull another.
Reads only files and package metadata: importing torch in the Ascend image would load torch_npu.
"""

from __future__ import annotations

import argparse
import configparser
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The distributions a vendor's torch comes with; what the image has of them is kept as it is.
TRITONS = ("triton", "pytorch-triton-rocm")
VENDOR = ("torch", *TRITONS)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    if match is None:
        raise ValueError(f"not a requirement: {line!r}")
    return canonical(match.group(1))


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip() and not line.strip().startswith("#")]


def requirements(extras: list[str], setup_cfg: Path = ROOT / "setup.cfg") -> list[str]:
    """setup.cfg's install_requires and the named extras, without torch (and triton where the image has one)."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(setup_cfg, encoding="utf-8")
    lines = _lines(config["options"]["install_requires"])
    for extra in extras:
        lines += _lines(config["options.extras_require"][extra])
    has_triton = any(installed(name) for name in TRITONS)
    drop = {"torch"} | ({"triton"} if has_triton else set())
    return [line for line in lines if requirement_name(line) not in drop]


def constraints(constraints_txt: Path = ROOT / "scripts" / "constraints.txt") -> list[str]:
    """The suite's pins, with torch and any Triton pinned to the versions installed in the image."""
    versions = {name: version for name in VENDOR if (version := installed(name))}
    if "torch" not in versions:
        raise SystemExit("torch is not installed: the image installs its torch build before this runs")
    pins = [
        line for line in _lines(constraints_txt.read_text(encoding="utf-8")) if requirement_name(line) not in versions
    ]
    return pins + [f"{name}=={version}" for name, version in sorted(versions.items())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", action="append", default=[], help="an extra of setup.cfg to include (repeatable)")
    parser.add_argument("--constraints", action="store_true", help="print the constraints instead of the requirements")
    args = parser.parse_args(argv)
    lines = constraints() if args.constraints else requirements(args.extra)
    sys.stdout.write("".join(line + "\n" for line in lines))


if __name__ == "__main__":
    main()
