#!/usr/bin/env bash
# The transformers range pyproject.toml declares, tested at both ends: its lower bound and the newest release
# it allows. Each end gets a fresh venv (under $GSPO_RANGE_VENVS, default /tmp/gspo-transformers-range):
# torch==2.13.0 first (the CPU wheel), then gspo[dev] with that transformers; then the tiny run with
# transformers' FutureWarning and DeprecationWarning as errors, so a deprecation shows before the removal
# that breaks users. With --tests, the test suite too (its `-m 'not slow'` part). docs/reliability.md.
#
#   bash scripts/transformers_range.sh [--tests] [VERSION ...]   # default: the lower bound, and the newest
set -euo pipefail
cd "$(dirname "$0")/.."
tests=0
if [ "${1:-}" = "--tests" ]; then tests=1; shift; fi
lower=$(grep -o '"transformers>=[0-9.]*' pyproject.toml | cut -d= -f2)
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=("$lower" newest)
root=${GSPO_RANGE_VENVS:-/tmp/gspo-transformers-range}
failed=0
for version in "${versions[@]}"; do
    venv="$root/$version"
    python3 -m venv --clear "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    if [ "$version" = newest ]; then
        "$venv/bin/pip" install -q -e ".[dev]"  # the newest transformers pyproject.toml's range allows
    else
        "$venv/bin/pip" install -q -e ".[dev]" "transformers==$version"
    fi
    installed=$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')
    out=$(mktemp -d)
    if HF_HUB_OFFLINE=1 "$venv/bin/python" -W error::FutureWarning -W error::DeprecationWarning \
        -m gspo train configs/tiny.yaml output_dir="$out/run" >"$out/log" 2>&1; then
        echo "transformers $installed: gspo train configs/tiny.yaml, warnings as errors: ok"
    else
        echo "transformers $installed: gspo train configs/tiny.yaml, warnings as errors: FAILED"
        tail -5 "$out/log"
        failed=1
    fi
    if [ $tests = 1 ]; then
        if HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q -m 'not slow' -p no:cacheprovider; then
            echo "transformers $installed: tests: ok"
        else
            echo "transformers $installed: tests: FAILED"
            failed=1
        fi
    fi
done
exit $failed
