#!/usr/bin/env bash
# The `numerics` tests (tests/conftest.py NUMERICS_MODULES) under summation orders other than the developer's:
# one and three threads, ATen's plain (non-vector) kernels, and MKL's AVX2 kernels where the CPU has wider
# ones. A tolerance read off one machine fails here; one derived from an error bound holds (tests/bounds.py).
# Each setting alone: two at once can cancel (one thread with MKL's AVX2 kernels sums as the developer's
# machine did). CI's stage after the README's test command (.ci/run); about a minute per setting on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
for setting in OMP_NUM_THREADS=1 OMP_NUM_THREADS=3 ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2; do
    echo "numerics under $setting"
    env "$setting" HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -m numerics "$@"
done
