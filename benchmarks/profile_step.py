"""Where one rollout batch of the default run spends its time: torch's profiler over one `train_step`.

Runs the default config (SmolLM2-135M) for --warmup rollout batches, then profiles the next one and prints
its phase times (time_rollout, time_update, ...) and the operators by their own CPU time.

    HF_HUB_OFFLINE=1 python benchmarks/profile_step.py [--warmup 3] [--rows 25] [key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile

from torch.profiler import profile

from gspo.config import load_config
from gspo.training.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run:
        overrides = [f"output_dir={run}/run", "checkpoint.every=0", "eval.every=1000", "report_to=[]"]
        config = load_config(None, [*overrides, *args.overrides])
        trainer = Trainer(config)
        for _ in range(args.warmup):
            trainer.train_step()
        with profile() as prof:
            metrics = trainer.train_step()
        keys = ("time_", "skipped_", "update_tokens", "unique_tokens", "generation_tokens")
        print({k: round(v, 3) for k, v in metrics.items() if k.startswith(keys)})
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
