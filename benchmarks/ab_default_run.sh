#!/usr/bin/env bash
# A/B timing of `gspo train` between a base commit and the working tree, alternating runs on this machine.
# Usage (from the project root, after the README set-up):
#   bash benchmarks/ab_default_run.sh BASE_COMMIT [ROUNDS=2] [CONFIG.yaml] [key=value ...]
# Each run: the default config or CONFIG.yaml (plus your overrides) for 3 rollout batches, no checkpoints,
# no TensorBoard (tensorboard=false: the key older base commits know; report_to=[] since).
# Prints each run's median seconds per rollout batch (sum of the logged time_* phases) and its held-out
# accuracy before and after (the evaluations at the first and last step), then the ratio of the best base
# run to the best working-tree run. Machines are noisy (+-15% between identical runs): use ratios.
set -euo pipefail
base=${1:?usage: bash benchmarks/ab_default_run.sh BASE_COMMIT [ROUNDS] [CONFIG.yaml] [key=value ...]}; shift
rounds=2; if [[ "${1:-}" =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
config=(); if [[ "${1:-}" == *.yaml ]]; then config=("$(realpath "$1")"); shift; fi  # default: gspo's default
py=$(pwd)/.venv/bin/python; [ -x "$py" ] || { echo "run the README set-up first (.venv missing)"; exit 1; }
tmp=$(mktemp -d); git archive "$base" src | tar -x -C "$tmp"
run() {  # $1 label, $2 PYTHONPATH ('' = the working tree's gspo)
  out="$tmp/$1-$RANDOM"
  (cd "$tmp" && PYTHONPATH="$2" HF_HUB_OFFLINE=1 "$py" -m gspo train "${config[@]}" output_dir="$out" train.steps=3 \
     eval.every=1000 checkpoint.every=0 tensorboard=false progress=false "${@:3}" > "$out.log" 2>&1) \
     || { tail -5 "$out.log" >&2; echo "$1 run failed" >&2; exit 1; }
  "$py" - "$out/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
t = sorted(sum(v for k, v in r.items() if k.startswith("time_")) for r in rows if "time_update" in r)
acc = [r["accuracy"] for r in rows if r.get("kind") == "eval"]
skipped = [r.get("skipped_samples_frac", 0.0) for r in rows if "time_update" in r]
print(f"  accuracy {acc[0]:.3f} -> {acc[-1]:.3f}, skipped {sum(skipped) / len(skipped):.2f} of the samples",
      file=sys.stderr)
print(f"{t[len(t) // 2]:.2f}")
PYEOF
}
bs=(); hs=()
for i in $(seq "$rounds"); do
  b=$(run base "$tmp/src" "$@"); h=$(run work "" "$@"); bs+=("$b"); hs+=("$h")
  echo "round $i: base $b s, working tree $h s per rollout batch"
done
"$py" -c "import sys; b=min(map(float,sys.argv[1].split())); h=min(map(float,sys.argv[2].split())); print(f'best: base {b:.2f} s, working tree {h:.2f} s: {b/h:.2f}x')" "${bs[*]}" "${hs[*]}"
rm -rf "$tmp"
