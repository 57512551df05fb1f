#!/usr/bin/env bash
# The default model (SmolLM2-135M-Instruct) trained by an LLM judge on loopback (config.yaml, judge.txt).
#   JUDGE_URL=http://host:port/v1 JUDGE_MODEL=name bash examples/judge/run.sh [key=value ...]
#       a judge of yours: any OpenAI-compatible server (vLLM, llama.cpp's server, a hosted API)
#   bash examples/judge/run.sh [key=value ...]
#       without JUDGE_URL: the default model itself, served by vLLM (bash scripts/setup.sh vllm) on
#       loopback, with structured outputs, so its answers always parse; README.md here says what it learns
# RUN_DIR=... picks the run folder (default: runs/judge-<timestamp>).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
run="${RUN_DIR:-runs/judge-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$run"
if [ -z "${JUDGE_URL:-}" ]; then
    vllm_python="${VLLM_PYTHON:-.venv-vllm/bin/python}"
    if [ ! -x "$vllm_python" ]; then
        echo "no JUDGE_URL and no $vllm_python: set JUDGE_URL to a judge's API root, or bash scripts/setup.sh vllm" >&2
        exit 2
    fi
    # the default model as a Hugging Face folder, served by vLLM as "judge"
    python -c "import sys; from gspo.config import ModelConfig; from gspo.models.loading import load_model
model, tokenizer = load_model(ModelConfig()); model.save_pretrained(sys.argv[1]); tokenizer.save_pretrained(sys.argv[1])" "$run/judge-model"
    port="${JUDGE_PORT:-8012}"
    "$vllm_python" -m vllm.entrypoints.openai.api_server --model "$run/judge-model" --served-model-name judge \
        --host 127.0.0.1 --port "$port" --dtype float32 --enforce-eager --max-model-len 2048 \
        --kv-cache-memory-bytes 1073741824 --no-enable-chunked-prefill >"$run/judge-server.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
        kill -0 $server 2>/dev/null || { tail -20 "$run/judge-server.log" >&2; exit 1; }
        sleep 1
    done
    JUDGE_URL="http://127.0.0.1:$port/v1"
    JUDGE_MODEL=judge
fi
gspo train "$here/config.yaml" "output_dir=$run/train" "judge.url=$JUDGE_URL" "judge.model=${JUDGE_MODEL:-judge}" "$@"
python "$here/report.py" "$run/train"
