"""A run that stopped learning says so: zero reward spread in every group, or a zero gradient norm, for
train.warn_after_flat_steps rollout batches in a row."""

from __future__ import annotations

from pathlib import Path

from gspo.config import load_config
from gspo.training.progress import StallWatch
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def test_a_streak_warns_once_when_it_reaches_its_length_and_shows_in_the_progress_bar() -> None:
    watch = StallWatch(after=2, groups_per_step=4)
    flat = {"zero_std_groups": 4.0, "grad_norm": 0.0}
    assert watch.update(1, flat) == [] and watch.postfix() == {}
    due = watch.update(2, flat)
    assert len(due) == 2 and due[0].startswith("steps 1-2: every group's completions got the same reward")
    assert due[1].startswith("steps 1-2: the gradient norm was 0")
    assert watch.postfix() == {"warn": "no reward spread, zero grad"}
    assert watch.update(3, flat) == []  # once per streak
    assert watch.update(4, {"zero_std_groups": 3.0, "grad_norm": 0.5}) == [] and watch.postfix() == {}
    assert StallWatch(after=0, groups_per_step=4).update(1, flat) == []  # 0: off


def test_a_run_with_no_reward_spread_warns_on_stderr(tmp_path: Path, capsys) -> None:
    config = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            "report_to=[]",
            "rewards={same: 1.0}",
            "train.steps=2",
            "train.warn_after_flat_steps=2",
            "eval.every=0",
            "checkpoint.every=0",
            "task.num_eval=2",
        ],
    )
    Trainer(
        config, reward_functions={"same": lambda prompts, completions, **_: [1.0] * len(completions)}
    ).run()
    err = capsys.readouterr().err
    assert "warning: steps 1-2: every group's completions got the same reward" in err
    assert "warning: steps 1-2: the gradient norm was 0" in err
