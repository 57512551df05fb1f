"""benchmarks/gpu.py's model-FLOP count against the published parameter counts. Its CPU smoke run (every
system's update phase on tiny models, and the head alone) is the GPU check's dry run: tests/test_gpu_check.py.
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


def test_model_flops_count_the_known_parameter_counts() -> None:
    """6 N per trained token: the dense configurations' active matmul parameters are the published ones."""
    bench = _benchmark()
    spec = bench.MODELS["qwen2.5-1.5b"]
    per_token = spec.forward_flops(1, 0) - 2 * spec.layers * spec.heads * 128  # minus the T^2 term at T=1
    assert per_token / 2 == pytest.approx(1.31e9, rel=0.02)  # Qwen2.5-1.5B: 1.31B non-embedding parameters
    spec = bench.MODELS["smollm2-135m"]
    per_token = spec.forward_flops(1, 0) - 2 * spec.layers * spec.heads * 64
    assert per_token / 2 == pytest.approx(135e6 - 49152 * 576, rel=0.05)
