#!/usr/bin/env bash
# The GPU check in one call (scripts/gpu_check.py: its docstring lists the steps; docs/gpu.md):
#   bash scripts/gpu_check.sh OUT            on a machine with an NVIDIA GPU, within 8 minutes
#   bash scripts/gpu_check.sh --dry-run OUT  every step on the CPU at toy sizes (the suite runs it)
# gspo runs from src/ with the machine's own torch (PYTHONPATH=src: nothing of gspo's pins is installed);
# wheels in .whl/ (scripts/gpu_wheels.sh: TRL, Liger-Kernel and two dependencies, about 3 MB) are installed
# into /tmp/gspo-wheels first, where a machine has no package index. Every figure goes into OUT/gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=()
if [ "${1:-}" = --dry-run ]; then dry=(--dry-run); shift; fi
out=${1:?usage: bash scripts/gpu_check.sh [--dry-run] OUT}
mkdir -p "$out"
site=
if [ ${#dry[@]} -eq 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
    site=/tmp/gspo-wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || echo "gpu_check: the wheels of .whl/ did not install; TRL's and Liger's rows will say so" >&2
fi
python=${GSPO_PYTHON:-python3}
PYTHONPATH="$PWD/src${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
    exec "$python" scripts/gpu_check.py "$out" "${dry[@]}"
