#!/usr/bin/env bash
# The wheels benchmarks/gpu.py needs on a GPU machine without a package index, beyond a CUDA PyTorch image
# (TRL and Liger-Kernel, with the two dependencies of datasets such images lack), into .whl/ (git-ignored):
# about 3 MB. docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>"$(git rev-parse --git-path info/exclude)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5
ls -l .whl
