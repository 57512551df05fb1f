"""The bake-off script (scripts/bakeoff.py) end to end at its reduced size: report, plots, every method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reduced_bakeoff_writes_its_report(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    command = [
        sys.executable,
        str(ROOT / "scripts" / "bakeoff.py"),
        "--reduced",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--report-dir",
        str(tmp_path / "report"),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "report" / "bakeoff.md").read_text()
    assert report.count("| **") == 8  # a verdict per method but GSPO, for accuracy and reward
    for png in ("bakeoff_reward", "bakeoff_clipping", "bakeoff_ratios", "bakeoff_routing"):
        assert (tmp_path / "report" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png}.png)" in report
    summary = json.loads((tmp_path / "runs" / "summary.json").read_text())
    assert set(summary["table"]) == {"gspo", "grpo", "gmpo", "sapo", "cispo"}
    assert all(len(row["accuracy_end"]) == 1 for row in summary["table"].values())  # one seed when reduced
