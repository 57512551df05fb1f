"""What the reliability checks (docs/reliability.md) cost, side by side in one process: each next to what it adds to.

- Checkpoint completeness: `checkpoint_problem` (files present, and each safetensors file's header read and
  checked against its size) against the file-existence test it replaced, on a checkpoint whose weights file
  holds as many tensors as SmolLM2-135M's (its header is about as long); a save calls it once per kept
  checkpoint, and a resume once per step folder.
- The run-folder lock: acquire + release, once per run.
- Config validation: `load_config` of configs/default.yaml with the value table, and the table's share.
- A tiny training step for scale (configs/tiny.yaml; the default run's step is far longer).
- With --smollm2: a checkpoint's manifest (every file's size and sha256) on a SmolLM2-135M checkpoint with
  an AdamW state of its size: the save and the load as gspo does them, and the hashing each adds (the
  manifest written at save, `verify_checkpoint` at load).

Run:  HF_HUB_OFFLINE=1 python benchmarks/reliability_overhead.py [--repeats N] [--smollm2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from gspo.config import ModelConfig, load_config
from gspo.config.rules import check_values
from gspo.models import load_model
from gspo.run import lock
from gspo.run.checkpoint import (
    STATE_FILE,
    checkpoint_problem,
    load_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_TENSORS = 273  # SmolLM2-135M's state dict (30 layers x 9, embeddings, final norm)


def _old_is_complete(checkpoint: Path) -> bool:
    """main (21475ee)'s test: the files are there."""
    model = checkpoint / "model"
    weights = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
    return (
        (checkpoint / STATE_FILE).is_file()
        and ((model / "config.json").is_file() or (model / "adapter_config.json").is_file())
        and any((model / w).is_file() for w in weights)
    )


def _median_us(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        function()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _seconds(function) -> float:
    t0 = time.perf_counter()
    function()
    return time.perf_counter() - t0


def checkpoint_manifest(tmp: Path, repeats: int = 3) -> None:
    """Save and load a SmolLM2 checkpoint (weights, tokenizer, an AdamW state: two moments per parameter)
    and hash its files as the manifest does; medians of `repeats`."""
    model, tokenizer = load_model(ModelConfig())
    moments = {
        i: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        for i, p in enumerate(model.parameters())
    }
    state = {"optimizer": {"state": moments, "param_groups": []}}
    run = tmp / "smollm2"
    save = [
        _seconds(lambda: save_checkpoint(run, 1, model=model, tokenizer=tokenizer, state=state))
        for _ in range(repeats)
    ]
    checkpoint = run / "checkpoints" / "step_000001"
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())

    def load() -> None:
        load_model(ModelConfig(path=str(checkpoint / "model")))
        load_trainer_state(checkpoint)

    loads = [_seconds(load) for _ in range(repeats)]
    hashes = [_seconds(lambda: verify_checkpoint(checkpoint)) for _ in range(repeats)]
    save_s, load_s, hash_s = (statistics.median(x) for x in (save, loads, hashes))
    print(
        f"SmolLM2-135M checkpoint ({size / 2**30:.2f} GiB with its AdamW state): save {save_s:.2f} s, "
        f"load {load_s:.2f} s; hashing every file (added once to each) {hash_s:.2f} s = "
        f"{hash_s / (save_s - hash_s):.0%} of a save without it, {hash_s / load_s:.0%} of a load "
        f"({size / 2**20 / hash_s:.0f} MiB/s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--smollm2", action="store_true", help="also the checkpoint manifest on SmolLM2")
    args = parser.parse_args()
    print(f"cpu: {platform.processor() or platform.machine()}, load average before: {os.getloadavg()}")
    if args.smollm2:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint_manifest(Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoints" / "step_000001"
        (checkpoint / "model").mkdir(parents=True)
        (checkpoint / STATE_FILE).write_bytes(b"x")
        (checkpoint / "model" / "config.json").write_text("{}")
        tensors = {f"model.layers.{i}.some_projection.weight": torch.zeros(4) for i in range(SMOLLM2_TENSORS)}
        save_file(tensors, checkpoint / "model" / "model.safetensors")
        header = int.from_bytes((checkpoint / "model" / "model.safetensors").read_bytes()[:8], "little")
        assert checkpoint_problem(checkpoint) is None and _old_is_complete(checkpoint)
        # alternate the two, so that a change of load on the machine hits both alike
        new, old = [], []
        for _ in range(5):
            new.append(_median_us(lambda: checkpoint_problem(checkpoint), args.repeats // 5))
            old.append(_median_us(lambda: _old_is_complete(checkpoint), args.repeats // 5))
        new_us, old_us = statistics.median(new), statistics.median(old)
        print(
            f"checkpoint completeness ({SMOLLM2_TENSORS} tensors, {header:,}-byte header): "
            f"{new_us:.1f} us with the header check, {old_us:.1f} us files only ({new_us / old_us:.1f}x)"
        )
        run = Path(tmp) / "run"
        run.mkdir()

        def lock_cycle() -> None:
            lock.acquire(run, "benchmark")
            lock.release(run)

        print(f"run-folder lock, acquire + release: {_median_us(lock_cycle, args.repeats // 10):.1f} us")
        default = ROOT / "configs" / "default.yaml"
        config = load_config(default)
        load_us = _median_us(lambda: load_config(default), 200)
        table_us = _median_us(lambda: check_values(config), args.repeats)
        print(
            f"load_config(configs/default.yaml): {load_us:.0f} us, of which the value table {table_us:.0f} us"
        )
        trainer = Trainer(
            load_config(ROOT / "configs" / "tiny.yaml", [f"output_dir={Path(tmp) / 'tiny'}", "report_to=[]"])
        )
        trainer.train_step()  # warm-up
        step_us = _median_us(trainer.train_step, 3)
        print(f"one training step of configs/tiny.yaml, for scale: {step_us / 1e3:.0f} ms")
        print(
            f"a checkpoint save's completeness checks (keep=1: 2 folders) per tiny step: "
            f"{2 * (new_us - old_us) / step_us:.2e}"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
