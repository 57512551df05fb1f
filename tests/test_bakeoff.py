"""The bake-off script (scripts/bakeoff.py) end to end at its reduced size: report, plots, every method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow  # a cold start and 10 tiny runs: 20-35 s on 2 cores
def test_reduced_bakeoff_writes_its_report(tmp_path: Path, script) -> None:
    argv = ["--reduced", "--runs-dir", str(tmp_path / "runs"), "--report-dir", str(tmp_path / "report")]
    assert script("bakeoff").main(argv) == 0
    report = (tmp_path / "report" / "bakeoff.md").read_text()
    assert report.count("| **") == 8  # a verdict per method but GSPO, for accuracy and reward
    for png in ("bakeoff_reward", "bakeoff_clipping", "bakeoff_ratios", "bakeoff_routing"):
        assert (tmp_path / "report" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png}.png)" in report
    summary = json.loads((tmp_path / "runs" / "summary.json").read_text())
    assert set(summary["table"]) == {"gspo", "grpo", "gmpo", "sapo", "cispo"}
    assert all(len(row["accuracy_end"]) == 1 for row in summary["table"].values())  # one seed when reduced
