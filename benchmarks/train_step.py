"""Time a rollout batch phase by phase, count the tokens each phase computes, and the update phase's FLOP/s.

Default mode (any config + overrides, the default run's by default), per measured step: generation,
old-policy log-probs and update times; tokens computed per unique token in each phase (a unique token
counts a group's prompt once: what the rollout batch holds without repeats); tokens/s; and the update
phase's achieved FLOP/s against a torch matmul peak measured in the same process, in the dtype the
updates compute in. The update phase's FLOPs are counted by torch's FlopCounterMode on one extra step
(matmuls and attention, forward and backward, through learn's around_update hook), and its FLOPs per
computed token applied to the timed steps.

--lora RANK: a LoRA update against a full one on the same rollout batches. Each measured round samples a
rollout batch with the full fine-tune's trainer, then runs the update phase (`learn`: old-policy log-probs
and train.minibatches optimizer updates) of a full fine-tune and of a rank-RANK LoRA fine-tune (lora.rank,
the config's lora.target_modules and alpha) on it, in alternating order; prints each one's median times,
their ratio, the trainable parameters and the optimizer state, and the FLOPs per update token of each
(counted on one more batch, as above).

--long-prefix: the agent and tool-use case. Synthetic rollout batches of P prompts of 512 tokens, G=8
completions of 32 tokens each (random token ids; the update phase costs the same whatever the tokens),
and the update phase of `learn` timed for today's layout (packed rows, samples split across minibatches)
and the shared-prefix layout (whole groups per minibatch), alternating, on the config's model.
--system N: the prompts' first N tokens are one system prompt common to all of them, and the shared-prefix
layout with samples split across minibatches (the default split) is timed too.

Run:  HF_HUB_OFFLINE=1 python benchmarks/train_step.py [CONFIG] [key=value ...] [--steps N]
      HF_HUB_OFFLINE=1 python benchmarks/train_step.py --lora 16 [CONFIG] [key=value ...] [--steps N]
      HF_HUB_OFFLINE=1 python benchmarks/train_step.py --long-prefix [--system N] [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from gspo.config import load_config
from gspo.core.layout import TokenSequence
from gspo.core.seeds import step_seed
from gspo.learning.batch import Batch, make_batch
from gspo.learning.learner import learn
from gspo.training.trainer import Trainer

LONG_PREFIX = {"prompt": 512, "group_size": 8, "completion": 32}


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


def _phases(trainer: Trainer) -> dict[str, float]:
    """One rollout batch, with each phase's time and computed / unique tokens."""
    out = trainer.train_step()
    # unique tokens: each group's prompt once, then every sampled token (no group is filtered out here)
    out["generation_per_unique"] = out["generation_tokens"] / out["unique_tokens"]
    old_computed = out["update_tokens"] if out["old_logprobs_recomputed"] else 0.0
    out["old_per_unique"] = old_computed / out["unique_tokens"]
    out["update_per_unique"] = out["update_tokens"] / out["unique_tokens"]
    return out


def default_mode(args: argparse.Namespace) -> None:
    config_path, overrides = _config_args(args)
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(
            config_path, [*overrides, f"output_dir={run_dir}", "report_to=[]", "progress=false"]
        )
        trainer = Trainer(config)
        # the peak of the dtype the matmuls run in: bf16 with train.mixed_precision=bf16
        dtype = trainer.policy.compute_dtype or next(trainer.policy.model.parameters()).dtype
        peaks = [matmul_peak(dtype)]
        spec = trainer.spec
        print(
            f"batch: {config.rollout.prompts_per_step} prompts x G={config.rollout.group_size}, {spec.minibatches} "
            f"minibatches split by {spec.minibatch_split}, layout {spec.layout}, old log-probs {spec.old_logprobs}"
        )
        _phases(trainer)  # warm-up: allocator, first-call overheads
        rows = [_phases(trainer) for _ in range(args.steps)]

        # one more step's updates, each inside a FLOP counter (learn's around_update hook)
        flops_per_token = _update_flops(trainer, _next_batch(trainer))
        peaks.append(matmul_peak(dtype))  # the higher of before and after: the stricter reference
    peak = max(peaks)
    print(
        f"threads {torch.get_num_threads()}, {dtype} matmul peak {peak:.1f} GFLOP/s "
        f"(best of 10 2048^3 matmuls, before and after the steps: {peaks[0]:.1f}, {peaks[1]:.1f})"
    )
    header = (
        f"{'step':>4} {'generate s':>10} {'old logp s':>10} {'update s':>9} {'tokens/s':>9} "
        f"{'computed/unique: gen':>20} {'old':>5} {'update':>6} {'update GFLOP/s':>14} {'% of peak':>9}"
    )
    print(header)
    print("-" * len(header))
    for i, r in enumerate(rows, 1):
        total = r["time_rollout"] + r["time_old_logprobs"] + r["time_update"]
        gflops = flops_per_token * r["update_tokens"] / r["time_update"] / 1e9
        print(
            f"{i:>4} {r['time_rollout']:>10.2f} {r['time_old_logprobs']:>10.2f} {r['time_update']:>9.2f} "
            f"{r['real_tokens'] / total:>9.0f} {r['generation_per_unique']:>20.2f} {r['old_per_unique']:>5.2f} "
            f"{r['update_per_unique']:>6.2f} {gflops:>14.1f} {100 * gflops / peak:>8.1f}%"
        )
    med = {
        k: statistics.median(r[k] for r in rows) for k in ("time_rollout", "time_old_logprobs", "time_update")
    }
    gflops = statistics.median(flops_per_token * r["update_tokens"] / r["time_update"] / 1e9 for r in rows)
    print(
        f"median: generate {med['time_rollout']:.2f} s, old log-probs {med['time_old_logprobs']:.2f} s, "
        f"updates {med['time_update']:.2f} s, {sum(med.values()):.2f} s per rollout batch; update phase "
        f"{gflops:.1f} GFLOP/s = {100 * gflops / peak:.0f}% of the matmul peak"
    )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def _config_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The config file and the overrides of the command line (a first word with "=" is an override)."""
    config_path = args.config if args.config and "=" not in args.config else None
    return config_path, ([args.config] if args.config and "=" in args.config else []) + args.overrides


def _update_flops(trainer: Trainer, batch: Batch) -> float:
    """FLOPs per update token of `trainer`'s update phase on `batch` (matmuls and attention, forward and
    backward, counted through learn's around_update hook)."""
    counters: list[FlopCounterMode] = []

    def count() -> FlopCounterMode:
        counters.append(FlopCounterMode(display=False))
        return counters[-1]

    # every sample computed, also of groups whose rewards all tie (skipped in training): FLOPs per token
    # are then defined whatever the batch's rewards
    spec = dataclasses.replace(trainer.spec, skip_zero_advantage=False)
    probe = learn(trainer.policy, spec, batch, seed=step_seed(trainer.config.seed, 0), around_update=count)
    return sum(c.get_total_flops() for c in counters) / probe["update_tokens"]


def _next_batch(trainer: Trainer) -> Batch:
    """The trainer's next rollout batch, its step moved on so that the one after is drawn (as train_step
    does, without its update: the benchmark runs `learn` itself)."""
    samples, _ = trainer.sample()
    trainer.step += 1
    trainer.rollouts.updated(trainer.policy.model, trainer.step)
    return make_batch(samples)[0]


def lora_mode(args: argparse.Namespace) -> None:
    """A full fine-tune's and a LoRA fine-tune's update phase on the same rollout batches (docstring)."""
    config_path, overrides = _config_args(args)
    common = ["report_to=[]", "progress=false", "eval.every=0"]
    with tempfile.TemporaryDirectory() as full_dir, tempfile.TemporaryDirectory() as lora_dir:
        full = Trainer(load_config(config_path, [*overrides, *common, f"output_dir={full_dir}"]))
        lora_config = load_config(
            config_path, [*overrides, *common, f"output_dir={lora_dir}", f"lora.rank={args.lora}"]
        )
        lora = Trainer(lora_config)
        trainers = {"full": full, f"lora r={args.lora}": lora}
        spec = full.spec
        print(
            f"batch: {full.config.rollout.prompts_per_step} prompts x G={full.config.rollout.group_size}, "
            f"{spec.minibatches} minibatches, layout {spec.layout} (LoRA: {lora.spec.layout}), old log-probs "
            f"{spec.old_logprobs} (LoRA: {lora.spec.old_logprobs}); threads {torch.get_num_threads()}"
        )
        times: dict[str, dict[str, list[float]]] = {name: {"update": [], "old": []} for name in trainers}
        for round_ in range(args.steps + 1):  # the first round warms up
            batch = _next_batch(full)
            order = list(trainers.items())
            for name, trainer in order if round_ % 2 else order[::-1]:
                metrics = learn(
                    trainer.policy, trainer.spec, batch, seed=step_seed(trainer.config.seed, round_)
                )
                if round_:
                    times[name]["update"].append(metrics["time_update"])
                    times[name]["old"].append(metrics["time_old_logprobs"])
                print(
                    f"  round {round_}{' (warm-up)' if not round_ else ''}: {name}: update phase "
                    f"{metrics['time_update']:.2f} s, old log-probs {metrics['time_old_logprobs']:.2f} s",
                    flush=True,
                )
        batch = _next_batch(full)
        flops = {name: _update_flops(trainer, batch) for name, trainer in trainers.items()}
        sizes = {}
        for name, trainer in trainers.items():
            trained = [p for p in trainer.policy.model.parameters() if p.requires_grad]
            state = trainer.policy.optimizer.state.values()
            optimizer_bytes = sum(
                t.numel() * t.element_size() for s in state for t in s.values() if torch.is_tensor(t)
            )
            sizes[name] = (sum(p.numel() for p in trained), optimizer_bytes)
    base = statistics.median(times["full"]["update"])
    for name in trainers:
        update, old = statistics.median(times[name]["update"]), statistics.median(times[name]["old"])
        params, optimizer_bytes = sizes[name]
        print(
            f"{name:<10} median update phase {update:7.2f} s ({base / update:.2f}x the full one's speed), "
            f"old log-probs {old:.2f} s; {flops[name] / 1e6:.1f} MFLOP per update token; {params:,} trained "
            f"parameters, AdamW state {optimizer_bytes / 2**20:.1f} MiB"
        )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def long_prefix_batch(prompts: int, vocab: int, seed: int, system: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    sequences, groups = [], []
    common = torch.randint(3, vocab, (system,), generator=g).tolist() if system else []
    for group in range(prompts):
        prompt = common + torch.randint(3, vocab, (LONG_PREFIX["prompt"] - system,), generator=g).tolist()
        for _ in range(LONG_PREFIX["group_size"]):
            completion = torch.randint(3, vocab, (LONG_PREFIX["completion"],), generator=g).tolist()
            sequences.append(TokenSequence(prompt, completion, [True] * len(completion)))
            groups.append(group)
    advantages = torch.randn(len(sequences), generator=g)
    return Batch(sequences, advantages, [[float("nan")] * len(s.completion_ids) for s in sequences], groups)


def long_prefix_mode(args: argparse.Namespace) -> None:
    config_path = args.config if args.config and "=" not in args.config else None
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(
            config_path,
            [*args.overrides, f"output_dir={run_dir}", "report_to=[]", "progress=false", "eval.every=0"],
        )
        trainer = Trainer(config)
        vocab = trainer.policy.model.get_input_embeddings().num_embeddings
        variants = {
            "today (packed rows, sample split)": dataclasses.replace(
                trainer.spec, layout="packed", minibatch_split="sample", old_logprobs="recompute"
            ),
            "shared prefix, group split": dataclasses.replace(
                trainer.spec, layout="shared_prefix", minibatch_split="group", old_logprobs="recompute"
            ),
        }
        if args.system:
            variants["shared prefix, sample split"] = dataclasses.replace(
                trainer.spec, layout="shared_prefix", minibatch_split="sample", old_logprobs="recompute"
            )
        print(
            f"long prefix: {args.prompts} prompts of {LONG_PREFIX['prompt']} tokens x G={LONG_PREFIX['group_size']} "
            f"completions of {LONG_PREFIX['completion']} tokens ({args.system} of them common to all prompts), "
            f"{trainer.spec.minibatches} minibatches; "
            f"threads {torch.get_num_threads()}"
        )
        times: dict[str, list[float]] = {name: [] for name in variants}
        ratios: dict[str, float] = {}
        for step in range(args.steps + 1):  # the first round warms up
            for name, spec in variants.items():
                batch = long_prefix_batch(args.prompts, vocab, step, args.system)
                metrics = learn(trainer.policy, spec, batch, seed=step)
                ratios[name] = metrics["update_tokens"] / metrics["unique_tokens"]
                if step:
                    times[name].append(metrics["time_update"])
                print(
                    f"  round {step}{' (warm-up)' if not step else ''}: {name}: update phase "
                    f"{metrics['time_update']:.2f} s, old log-probs {metrics['time_old_logprobs']:.2f} s",
                    flush=True,
                )
    base = statistics.median(next(iter(times.values())))
    for name, t in times.items():
        print(
            f"{name:<36} median update phase {statistics.median(t):7.2f} s, computed/unique tokens "
            f"{ratios[name]:.2f}, {base / statistics.median(t):.2f}x faster than today's layout"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", help="YAML config (default: the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--steps", type=int, default=3, help="measured rollout batches (after one warm-up)")
    parser.add_argument(
        "--long-prefix", action="store_true", help="512-token prompts, G=8, 32-token completions"
    )
    parser.add_argument(
        "--lora", type=int, default=0, metavar="RANK", help="a rank-RANK LoRA update against a full one"
    )
    parser.add_argument("--prompts", type=int, default=4, help="--long-prefix: prompts per rollout batch")
    parser.add_argument(
        "--system", type=int, default=0, help="--long-prefix: leading prompt tokens common to all prompts"
    )
    args = parser.parse_args()
    if not 0 <= args.system <= LONG_PREFIX["prompt"]:
        parser.error(f"--system must be between 0 and the prompt length, {LONG_PREFIX['prompt']}")
    if args.lora < 0 or (args.lora and args.long_prefix):
        parser.error("--lora takes a rank > 0, and goes without --long-prefix")
    mode = long_prefix_mode if args.long_prefix else lora_mode if args.lora else default_mode
    mode(args)


if __name__ == "__main__":
    main()
