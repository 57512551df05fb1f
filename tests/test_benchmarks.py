"""What the docs cite, the suite runs: every benchmark and script that README.md or docs/ name starts (a
moved import fails here, not at the next reader), and benchmarks/train_step.py, whose figures
docs/performance.md quotes, runs a tiny case of each mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = sorted(
    {
        found
        for document in DOCUMENTS
        for found in re.findall(r"\b((?:benchmarks|scripts)/[\w./-]*\.(?:py|sh))\b", document.read_text())
    }
)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def run(*command: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_the_docs_cite_benchmarks_and_scripts() -> None:
    assert "benchmarks/train_step.py" in CITED and len(CITED) > 20


@pytest.mark.parametrize("path", CITED)
def test_every_benchmark_and_script_the_docs_cite_starts(path: str) -> None:
    """Python: `--help` (its imports, its argument parser); shell: `bash -n` (it parses)."""
    if path.endswith(".sh"):
        run("bash", "-n", path)
    else:
        run(sys.executable, path, "--help")


def test_train_step_times_the_phases_and_compares_a_lora_update_with_a_full_one(tmp_path: Path) -> None:
    """The default mode and --lora on the tiny config, one measured step each: the tables come out (the
    figures themselves are taken on a quiet machine, docs/performance.md)."""
    tiny = str(ROOT / "configs" / "tiny.yaml")
    default = run(sys.executable, "benchmarks/train_step.py", tiny, "--steps", "1").stdout
    assert "median: generate " in default and "update phase" in default
    lora = run(sys.executable, "benchmarks/train_step.py", tiny, "--lora", "4", "--steps", "1").stdout
    full_line, lora_line = (line for line in lora.splitlines() if "median update phase" in line)
    assert full_line.startswith("full ") and lora_line.startswith("lora r=4 ")
    trained = [
        int(re.search(r"([\d,]+) trained parameters", line)[1].replace(",", ""))
        for line in (full_line, lora_line)
    ]
    # rank 4 on q, k, v, o (64 -> 64, 32, 32, 64) and gate, up, down (64 <-> 128) of 2 layers: 4 x (in + out) each
    assert trained == [80384, 2 * 4 * (128 + 96 + 96 + 128 + 3 * 192)]
