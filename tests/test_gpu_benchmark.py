"""benchmarks/gpu.py's CPU smoke run: every system's update phase on tiny models, and the head alone.

On a GPU the same script measures the real configurations (docs/gpu.md); here it checks that each path
runs and prints its row. TRL and Liger-Kernel rows run when they are installed (`gspo[dev]` installs them).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_run_prints_every_system(monkeypatch, capsys, tmp_path) -> None:
    out = tmp_path / "rows.jsonl"
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--device", "cpu", "--small", "--head", "--out", str(out)])
    _benchmark().main()
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines() if line.startswith(("tiny-llama", "tiny-moe"))]
    systems = {(r[0], r[2]) for r in rows}
    for model in ("tiny-llama", "tiny-moe"):
        for system in ("gspo:torch", "trl", "liger"):
            assert (model, system) in systems, printed
    assert "failed" not in printed, printed
    installed = {"trl": importlib.util.find_spec("trl"), "liger": importlib.util.find_spec("liger_kernel")}
    for r in rows:
        if r[2] == "gspo:torch" or installed.get(r[2]):
            assert float(r[5]) > 0, r  # tokens/s
        else:
            assert "not installed" in " ".join(r), r
    assert "head tiny-llama" in printed and "summary:" in printed
    assert len(out.read_text().splitlines()) == len(rows) + printed.count("\nhead ")


def test_model_flops_count_the_known_parameter_counts() -> None:
    """6 N per trained token: the dense configurations' active matmul parameters are the published ones."""
    bench = _benchmark()
    spec = bench.MODELS["qwen2.5-1.5b"]
    per_token = spec.forward_flops(1, 0) - 2 * spec.layers * spec.heads * 128  # minus the T^2 term at T=1
    assert per_token / 2 == pytest.approx(1.31e9, rel=0.02)  # Qwen2.5-1.5B: 1.31B non-embedding parameters
    spec = bench.MODELS["smollm2-135m"]
    per_token = spec.forward_flops(1, 0) - 2 * spec.layers * spec.heads * 64
    assert per_token / 2 == pytest.approx(135e6 - 49152 * 576, rel=0.05)
