"""scripts/gpu_check.sh, the GPU check in one call, in its --dry-run: every step on the CPU at toy sizes,
the same JSON as on a GPU. A name the check uses that moves (a test file, a benchmark flag, a config key)
fails here, not in the GPU call. Its benchmark step is benchmarks/gpu.py's CPU smoke run: every system's
update phase on tiny models, and the head alone."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GSPO_PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    return {"report": report, "out": out, "printed": done.stdout}


def test_the_dry_run_runs_every_step_and_writes_the_json(dry_run: dict) -> None:
    report = dry_run["report"]
    assert report["dry_run"] is True
    steps = report["steps"]
    assert list(steps) == ["environment", "cuda_tests", "benchmark", "train", "fsdp2", "sequence_parallel"]
    assert {name: step["status"] for name, step in steps.items()} == {
        "environment": "ok",
        "cuda_tests": "skipped",  # collected: they need CUDA
        "benchmark": "ok",
        "train": "ok",
        "fsdp2": "skipped",
        "sequence_parallel": "skipped",
    }
    assert (
        steps["environment"]["figures"]["torch"]
        and steps["environment"]["figures"]["cuda_available"] is False
    )
    collected = steps["cuda_tests"]["figures"]["collected"]
    assert any("test_gspo_train_runs_end_to_end_on_the_gpu" in name for name in collected)
    assert "would run" in steps["cuda_tests"]["note"] and "needs CUDA" in steps["fsdp2"]["note"]
    runs = {(r["model"], r["lag"]): r for r in steps["train"]["figures"]}
    assert set(runs) == {("tiny", 0), ("tiny", 1), ("smollm2-shaped", 0), ("smollm2-shaped", 1)}
    assert all(r["exit"] == 0 and r["steps"] == 2 and r["time_update"] > 0 for r in runs.values())
    assert all(isinstance(step["seconds"], float) for step in steps.values())


def test_the_benchmark_step_prints_every_system_and_the_head(dry_run: dict) -> None:
    rows = [r for r in dry_run["report"]["steps"]["benchmark"]["figures"] if r.get("kind") != "head"]
    systems = {(r["model"], r["system"]) for r in rows}
    for model in ("tiny-llama", "tiny-moe"):
        for system in ("gspo:torch", "trl", "liger"):
            assert (model, system) in systems, systems
    installed = {"trl": importlib.util.find_spec("trl"), "liger": importlib.util.find_spec("liger_kernel")}
    for row in rows:
        if row["system"] == "gspo:torch" or installed.get(row["system"]):
            assert row["tokens_per_s"] > 0, row
        else:
            assert "not installed" in row.get("note", ""), row
    heads = [r for r in dry_run["report"]["steps"]["benchmark"]["figures"] if r.get("kind") == "head"]
    assert {r["path"] for r in heads} >= {"gspo:torch", "naive"}
