"""Time one rollout batch of the default run, phase by phase, and how well the update phase uses the CPU.

For the default model and batch shape (or any config + overrides) it prints, per measured step:
generation, old-policy log-probs and update times; tokens/s; and the layout's padding overhead
(tokens computed / real tokens in the updates). It also prints the peak RSS, and the update phase's
achieved FLOP/s against a torch matmul peak measured in the same process, in the dtype the updates compute
in (fp32, or bf16 with train.mixed_precision=bf16). The update phase's FLOPs
are counted by torch's FlopCounterMode on one extra step: matmuls and attention, forward and backward. Its
FLOPs per computed token are applied to the timed steps. The counted step itself is not timed, since the
counter slows dispatch.

Goals (issue 4): update phase >= 50% of the matmul peak; padding overhead <= 5%.

Run:  HF_HUB_OFFLINE=1 python benchmarks/train_step.py [CONFIG] [key=value ...] [--steps N]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from gspo.config import load_config
from gspo.learning.batch import make_batch
from gspo.learning.learner import learn
from gspo.training.trainer import Trainer


def matmul_peak(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of a square matmul in `dtype` with this process's threads (best of `repeats`)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", help="YAML config (default: the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--steps", type=int, default=3, help="measured rollout batches (after one warm-up)")
    args = parser.parse_args()
    config_path = args.config if args.config and "=" not in args.config else None
    overrides = ([args.config] if args.config and "=" in args.config else []) + args.overrides
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(
            config_path, [*overrides, f"output_dir={run_dir}", "tensorboard=false", "progress=false"]
        )
        trainer = Trainer(config)
        # the peak of the dtype the matmuls run in: bf16 with train.mixed_precision=bf16
        dtype = trainer.policy.compute_dtype or next(trainer.policy.model.parameters()).dtype
        peaks = [matmul_peak(dtype)]
        print(
            f"batch: {config.rollout.prompts_per_step} prompts x G={config.rollout.group_size}, "
            f"{config.train.minibatches_per_rollout} minibatches, packing={config.train.packing} "
            f"(pack_length {config.train.pack_length})"
        )
        trainer.train_step()  # warm-up: allocator, first-call overheads
        rows = [trainer.train_step() for _ in range(args.steps)]

        # one more step's updates, each inside a FLOP counter (learn's around_update hook)
        counters: list[FlopCounterMode] = []

        def count() -> FlopCounterMode:
            counters.append(FlopCounterMode(display=False))
            return counters[-1]

        samples, _ = trainer.sample()
        batch, _ = make_batch(samples)
        probe = learn(trainer.policy, trainer.spec, batch, seed=trainer.step_seed(), around_update=count)
        flops_per_token = sum(c.get_total_flops() for c in counters) / probe["update_tokens"]
        peaks.append(matmul_peak(dtype))  # the higher of before and after: the stricter reference
    peak = max(peaks)
    print(
        f"threads {torch.get_num_threads()}, {dtype} matmul peak {peak:.1f} GFLOP/s "
        f"(best of 10 2048^3 matmuls, before and after the steps: {peaks[0]:.1f}, {peaks[1]:.1f})"
    )

    header = f"{'step':>4} {'generate s':>10} {'old logp s':>10} {'update s':>9} {'tokens/s':>9} {'computed/real':>13} {'update GFLOP/s':>14} {'% of peak':>9}"
    print(header)
    print("-" * len(header))
    for i, r in enumerate(rows, 1):
        total = r["time_rollout"] + r["time_old_logprobs"] + r["time_update"]
        gflops = flops_per_token * r["update_tokens"] / r["time_update"] / 1e9
        print(
            f"{i:>4} {r['time_rollout']:>10.2f} {r['time_old_logprobs']:>10.2f} {r['time_update']:>9.2f} "
            f"{r['real_tokens'] / total:>9.0f} {r['update_tokens'] / r['real_tokens']:>13.3f} "
            f"{gflops:>14.1f} {100 * gflops / peak:>8.1f}%"
        )
    med = {
        k: statistics.median(r[k] for r in rows) for k in ("time_rollout", "time_old_logprobs", "time_update")
    }
    overhead = statistics.median(r["update_tokens"] / r["real_tokens"] for r in rows) - 1
    gflops = statistics.median(flops_per_token * r["update_tokens"] / r["time_update"] / 1e9 for r in rows)
    print(
        f"median: generate {med['time_rollout']:.2f} s, old log-probs {med['time_old_logprobs']:.2f} s, "
        f"updates {med['time_update']:.2f} s; padding overhead {100 * overhead:.1f}%; "
        f"update phase {gflops:.1f} GFLOP/s = {100 * gflops / peak:.0f}% of the matmul peak"
    )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
