"""Time per rollout batch of the long-completion run at a base commit against this checkout, alternating.

The run is configs/reasoning_gym.yaml's task (a reasoning-gym dataset, its own scorer, completions up to
``rollout.max_new_tokens``). So that both commits do the same work, the problems are written once to a
JSONL file and scored by a standalone reward file (reasoning-gym's ``score_answer`` on the text inside the
last answer tags, else the last line: gspo's own extraction), which any gspo since the custom-task support
reads; the base commit needs no reasoning-gym support of its own. Each run trains ``--steps`` rollout
batches from the same seed with no checkpoints and no evaluation; the figure is the median over its batches
of the logged phases (``time_*``), with the tokens it generated beside it. The learning rate is 1e-9 by
default: every update is computed in full, but the model barely moves, so each batch at both commits
samples from the same distribution and generates about as many tokens (at the config's rate the two runs'
completion lengths drift apart within two batches: 16 vs 62 tokens in one trial). ``--lr config`` trains at
the config's rate.

    HF_HUB_OFFLINE=1 python benchmarks/long_completion.py [--base 926cf50] [--rounds 2] [--steps 3]

Prints each run's seconds per rollout batch split into phases, then the ratio of the best base run to the
best run of this checkout, the CPU and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
FORMAT = "Think step by step, then give your final answer inside <answer></answer> tags."

REWARD_FILE = '''"""reasoning-gym's own scorer, standalone (benchmarks/long_completion.py writes this file)."""
import re
import reasoning_gym

DATASET = reasoning_gym.create_dataset({dataset!r}, seed={seed}, size={size}, **{settings!r})


def _answer(text):
    blocks = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if blocks:
        return blocks[-1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def score(prompts, completions, *, index, **_):
    return [
        float(DATASET.score_answer(_answer(c), DATASET[int(i)]) or 0.0)
        for c, i in zip(completions, index, strict=True)
    ]
'''


def write_task(config: dict, folder: Path, num_eval: int, lr: str) -> list[str]:
    """The problems as JSONL and the reward file in ``folder``; returns the overrides that use them."""
    import reasoning_gym

    task = config["task"]
    size = task.get("num_train", 60) + num_eval
    seed = task.get("seed", 1234)
    settings = dict(task.get("dataset_config") or {})
    dataset = reasoning_gym.create_dataset(task["dataset"], seed=seed, size=size, **settings)
    rows = [
        {"prompt": f"{dataset[i]['question']}\n\n{FORMAT}", "answer": str(dataset[i]["answer"]), "index": i}
        for i in range(size)
    ]
    (folder / "problems.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = REWARD_FILE.format(dataset=task["dataset"], seed=seed, size=size, settings=settings)
    (folder / "reward.py").write_text(text)
    rollout, train = config.get("rollout", {}), config.get("train", {})
    return [
        "task.name=file",
        f"task.data_path={folder / 'problems.jsonl'}",
        "task.answer_fields=[answer, index]",
        f"task.num_eval={num_eval}",
        f"rewards={{{folder / 'reward.py'}:score: 1.0}}",
        *(
            f"rollout.{key}={rollout[key]}"
            for key in ("max_new_tokens", "prompts_per_step", "group_size")
            if key in rollout
        ),
        f"train.lr={train.get('lr', 1e-5) if lr == 'config' else lr}",
    ]


def run(label: str, pythonpath: str, overrides: list[str], folder: Path, steps: int) -> dict[str, float]:
    """One ``gspo train`` of ``steps`` rollout batches; the median seconds per phase and tokens per batch."""
    out = folder / f"{label}-{len(list(folder.glob(label + '-*')))}"
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "gspo", "train", f"output_dir={out}", f"train.steps={steps}"]
    command += ["eval.every=1000", "checkpoint.every=0", "report_to=[]", "progress=false", *overrides]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{label} run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    batches = [row for row in rows if "time_update" in row]
    phases = sorted({key for row in batches for key in row if key.startswith("time_")})
    figures = {key: statistics.median(row[key] for row in batches) for key in phases}
    figures["total"] = statistics.median(sum(row[key] for key in phases) for row in batches)
    figures["tokens"] = statistics.median(row.get("generation_tokens", float("nan")) for row in batches)
    return figures


def _show(label: str, figures: dict[str, float]) -> str:
    split = ", ".join(f"{key[5:]} {value:.1f}" for key, value in figures.items() if key.startswith("time_"))
    return f"{label}: {figures['total']:.1f} s per rollout batch ({split}); {figures['tokens']:.0f} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="926cf50")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "reasoning_gym.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num-eval", type=int, default=8)
    parser.add_argument("--lr", default="1e-9", help="the learning rate, or 'config' for the config's")
    args = parser.parse_args()
    print(f"CPU: {_cpu_name() or platform.machine()}, {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        archive = subprocess.run(
            ["git", "archive", args.base, "src"], cwd=ROOT, capture_output=True, check=True
        )
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            tar.extractall(folder / "base", filter="data")
        overrides = write_task(yaml.safe_load(args.config.read_text()), folder, args.num_eval, args.lr)
        print("overrides:", " ".join(overrides))
        base, work = [], []
        for round_ in range(1, args.rounds + 1):
            base.append(run("base", str(folder / "base" / "src"), overrides, folder, args.steps))
            work.append(run("work", str(ROOT / "src"), overrides, folder, args.steps))
            print(
                f"round {round_}: "
                + _show(f"base {args.base}", base[-1])
                + " | "
                + _show("this checkout", work[-1])
            )
    best_base, best_work = min(f["total"] for f in base), min(f["total"] for f in work)
    print(
        f"best: base {best_base:.1f} s, this checkout {best_work:.1f} s per rollout batch: {best_base / best_work:.2f}x"
    )
    print(f"load after: {os.getloadavg()[0]:.2f}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
