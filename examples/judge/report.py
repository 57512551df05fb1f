"""What a judge-trained run learned: held-out accuracy (exact_answer, weighed 0: the measure only) at each
evaluation, and, per rollout batch, the judge's mean score and how many groups it scored all alike (no
spread: nothing to learn from them).

    python examples/judge/report.py RUN_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

rows = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines() if line]
evals = [(r["step"], r["accuracy"]) for r in rows if r["kind"] == "eval"]
print("held-out accuracy by step:", ", ".join(f"{step}: {accuracy:.3f}" for step, accuracy in evals))
for r in (r for r in rows if r["kind"] == "train"):
    print(
        f"step {r['step']}: judge mean {r['reward/judge']:.3f}, right answers {r['reward/exact_answer']:.3f}, "
        f"groups scored alike {r['zero_std_groups']:.0f}"
    )
