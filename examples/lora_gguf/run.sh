#!/usr/bin/env bash
# LoRA -> one GGUF file -> evaluate the file. Fine-tunes SmolLM2-135M-Instruct with LoRA adapters, writes
# the merged model as a GGUF file (for llama.cpp, Ollama, LM Studio), scores that file with `gspo eval`, and
# asks it a question through llama.cpp when llama-cpp-python is installed (else it says so, and how).
#   bash examples/lora_gguf/run.sh [key=value ...]   # SmolLM2-135M-Instruct (config.yaml here + overrides)
#   bash examples/lora_gguf/run.sh --smoke            # the tiny random model, seconds (CI runs this)
# RUN_DIR=... picks the run folder (default: runs/lora_gguf-<timestamp>).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
run="${RUN_DIR:-runs/lora_gguf-$(date +%Y%m%d-%H%M%S)}"
overrides=()
for arg in "$@"; do
    if [ "$arg" = "--smoke" ]; then
        overrides+=(model.tiny=llama train.steps=2 eval.every=0 task.num_eval=4)
    else
        overrides+=("$arg")
    fi
done
gspo train "$here/config.yaml" "output_dir=$run" "${overrides[@]}"
gguf="$(gspo export "$run" --format gguf --quant q8_0)"  # prints the file it wrote
gspo eval "$gguf" "$run/config.yaml" --output "$run/evals/gguf.json"
if python -c "import llama_cpp" 2>/dev/null; then
    python "$here/ask_llama_cpp.py" "$gguf" "What is 3 + 4? Answer with just the number."
else
    echo "llama.cpp: not asked, llama-cpp-python is not installed (bash scripts/setup.sh server compiles it," \
        "about half an hour on 2 cores); gspo eval above read the same GGUF file with transformers"
fi
