#!/usr/bin/env bash
# The vLLM tests (tests/test_vllm.py, tests/test_vllm_nccl.py) in .venv-vllm, which `bash scripts/setup.sh vllm` builds: CI's second stage.
# `import vllm` first, so that a broken install fails here rather than letting every test skip.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv-vllm/bin/python -c "import vllm" 2>/dev/null || {
    echo "error: .venv-vllm cannot import vllm: run bash scripts/setup.sh vllm" >&2
    exit 1
}
HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest -q tests/test_vllm.py tests/test_vllm_nccl.py "$@"
