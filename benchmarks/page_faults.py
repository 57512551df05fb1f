"""Page faults and update time of the default run with glibc's default malloc and with
gspo.run.allocator.keep_freed_memory (what `gspo train` and `gspo serve` call), alternating.

Each variant runs in a process of its own: the default config (SmolLM2-135M) for --steps rollout batches,
every sample computed (train.skip_zero_advantage=false: the same work in every batch). Prints, per run,
the median update time and minor page faults per rollout batch after the first, and the peak memory.

    HF_HUB_OFFLINE=1 python benchmarks/page_faults.py [--steps 5] [--rounds 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, resource, statistics, sys, tempfile
if sys.argv[1] == "keep":
    from gspo.run.allocator import keep_freed_memory
    assert keep_freed_memory(), "glibc malloc not adjustable here"
from gspo.config import load_config
from gspo.training.trainer import Trainer
steps, overrides = int(sys.argv[2]), sys.argv[3:]
with tempfile.TemporaryDirectory() as run:
    config = load_config(None, [f"output_dir={run}/run", "checkpoint.every=0", "eval.every=1000",
                                "report_to=[]", "train.skip_zero_advantage=false", *overrides])
    trainer = Trainer(config)
    updates, faults = [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        metrics = trainer.train_step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        updates.append(metrics["time_update"])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"update_s": statistics.median(updates[1:]), "faults": statistics.median(faults[1:]),
                  "peak_mib": peak}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "child.py")
        with open(script, "w") as f:
            f.write(CHILD)
        for round_ in range(1, args.rounds + 1):
            for variant in ("default", "keep"):
                out = subprocess.run(
                    [sys.executable, script, variant, str(args.steps), *args.overrides],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                best[variant] = min(best.get(variant, float("inf")), row["update_s"])
                print(
                    f"round {round_} {variant:>7}: update {row['update_s']:.2f} s, "
                    f"{row['faults']:.0f} page faults per rollout batch, peak {row['peak_mib']:.0f} MiB"
                )
    print(
        f"best update: default {best['default']:.2f} s, kept {best['keep']:.2f} s: "
        f"{best['default'] / best['keep']:.2f}x"
    )


if __name__ == "__main__":
    main()
