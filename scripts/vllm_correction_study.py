"""Learning with vLLM's bf16 log-probs: GSPO and GRPO, each with vLLM's log-probs as the old policy's (no
recompute, no correction) and with the old policy recomputed plus a truncated importance-sampling correction,
at several seeds (docs/vllm.md, "Learning with bf16 vLLM").

vLLM samples in bf16 (`rollout.vllm.dtype=bfloat16`, as on GPUs) beside the fp32 trainer, on the default
task. Runs each arm x seed with `gspo train` into OUT/cmp-ARM-sSEED (skipping folders that already hold a
finished run), then prints a table and draws the held-out accuracy curves:

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv-vllm/bin/python scripts/vllm_correction_study.py \
        --out runs/vllm_study --seeds 0 1 2 --plot docs/vllm_correction.png

`--summarize` only reads OUT.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import mean

ARMS = {
    "gspo-sampler": ["train.objective=gspo", "train.old_logprobs=sampler"],
    "gspo-tis": [
        "train.objective=gspo",
        "train.old_logprobs=recompute",
        "train.sampler_correction=sequence_truncate",
    ],
    "grpo-sampler": ["train.objective=grpo", "train.old_logprobs=sampler"],
    "grpo-tis": [
        "train.objective=grpo",
        "train.old_logprobs=recompute",
        "train.sampler_correction=token_truncate",
    ],
}
"""Each arm's overrides: "sampler", vLLM's log-probs as pi_old; "tis", pi_old recomputed by the trainer and
each sequence's (GSPO) or token's (GRPO) term weighted by pi_old / pi_vLLM truncated at 2."""
COMMON = [
    "rollout.engine=vllm",
    "rollout.vllm.dtype=bfloat16",
    "progress=false",
    "checkpoint.every=0",
    "report_to=[]",
]


AVERAGED = (
    "sampler_seq_outside_clip_frac",
    "sampler_token_outside_clip_frac",
    "clip_frac_seq",
    "clip_frac_token",
    "time_old_logprobs",
)
"""Train metrics averaged over every step of an arm's runs."""


def run_folder(out: Path, arm: str, seed: int) -> Path:
    return out / f"cmp-{arm}-s{seed}"


def train(out: Path, arm: str, seed: int) -> None:
    folder = run_folder(out, arm, seed)
    if (folder / "summary.md").exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "gspo",
        "train",
        *COMMON,
        *ARMS[arm],
        f"seed={seed}",
        f"output_dir={folder}",
    ]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)


def read(folder: Path) -> tuple[dict[int, float], list[dict]]:
    """(held-out accuracy by step, the train rows) of one run's metrics.jsonl."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    accuracy = {row["step"]: row["accuracy"] for row in rows if row["kind"] == "eval"}
    return accuracy, [row for row in rows if row["kind"] == "train"]


def summarize(out: Path, seeds: list[int]) -> tuple[str, dict[str, list[dict[int, float]]]]:
    lines = [
        "| arm | held-out accuracy at step 40, by seed | mean | train reward, last 10 steps | outside the band, "
        "vLLM against the trainer: sequences (GSPO's) / tokens (GRPO's) | clipped by the update: sequences / "
        "tokens | old-policy pass |",
        "|---|---|---|---|---|---|---|",
    ]
    curves = {}
    for arm in ARMS:
        runs = [
            read(run_folder(out, arm, seed))
            for seed in seeds
            if (run_folder(out, arm, seed) / "summary.md").exists()
        ]
        if not runs:
            continue
        curves[arm] = [accuracy for accuracy, _ in runs]
        finals = [accuracy[max(accuracy)] for accuracy, _ in runs]
        train_rows = [row for _, rows in runs for row in rows]
        last = [row["reward_mean"] for _, rows in runs for row in rows[-10:]]
        avg = {key: mean(row.get(key, 0.0) for row in train_rows) for key in AVERAGED}

        lines.append(
            f"| {arm} | {' / '.join(f'{f:.3f}' for f in finals)} | {mean(finals):.3f} | {mean(last):.3f} | "
            f"{avg['sampler_seq_outside_clip_frac']:.0%} / {avg['sampler_token_outside_clip_frac']:.1%} | "
            f"{avg['clip_frac_seq']:.2f} / {avg['clip_frac_token']:.2f} | {avg['time_old_logprobs']:.2f} s |"
        )
    return "\n".join(lines), curves


def draw(curves: dict[str, list[dict[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for arm, runs in curves.items():
        steps = sorted(set.intersection(*(set(run) for run in runs)))
        means = [mean(run[step] for run in runs) for step in steps]
        line = ax.plot(steps, means, marker="o", label=f"{arm} (mean of {len(runs)})")[0]
        for run in runs:
            ax.plot(steps, [run[step] for step in steps], color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set(xlabel="rollout batch", ylabel="held-out accuracy", title="vLLM bf16 sampling, fp32 trainer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/vllm_study"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--summarize", action="store_true", help="only read the runs in --out")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    if not args.summarize:
        for seed in args.seeds:
            for arm in args.arms:
                train(args.out, arm, seed)
    table, curves = summarize(args.out, args.seeds)
    print(table)
    if args.plot:
        draw(curves, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
