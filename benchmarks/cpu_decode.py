"""Decode tok/s of the engine next to HF transformers on the CPU: `engine bench` as a script.

python benchmarks/cpu_decode.py --batch-sizes 1,16 --repeats 3
"""

from __future__ import annotations

import os
import sys

# Runnable from a checkout without `pip install -e .`: the repository root holds `engine`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import main

if __name__ == "__main__":
    # The same parser and code path as `engine bench`; defaults to the CPU device.
    argv = sys.argv[1:]
    if not any(a == "--device" or a.startswith("--device=") for a in argv):
        argv = ["--device", "cpu", *argv]
    sys.exit(main(["bench", *argv]))
