"""The entropy bonus's coefficient (gspo.learning.entropy): fixed, or adapted toward a target entropy by
Skywork-OR1's rule; its state travels in the checkpoint, so a resumed run adapts as an uninterrupted one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gspo.learning.entropy import EntropyControl
from gspo.run.checkpoint import latest_checkpoint, load_trainer_state
from gspo.run.metrics import read_metrics
from gspo.training.trainer import Trainer


def test_the_adaptive_coefficient_follows_skywork_or1s_rule_on_a_hand_made_sequence():
    control = EntropyControl(coef=0.01, target=1.0, delta=0.005, max_coef=0.02)
    assert control.active and control.applied() == 0.0  # nothing measured yet: no bonus on the first update
    seen = []
    for entropy in (1.5, 0.8, 0.9, 0.7, 0.6, 1.2, 0.5):
        control.observe(entropy)
        seen.append((round(control.coef, 12), round(control.applied(), 12)))
    # above the target the coefficient falls (and no bonus applies), at or below it rises, within [0, 0.02]
    assert seen == [
        (0.005, 0.0),
        (0.01, 0.01),
        (0.015, 0.015),
        (0.02, 0.02),
        (0.02, 0.02),  # the ceiling
        (0.015, 0.0),
        (0.02, 0.02),
    ]
    falling = EntropyControl(coef=0.004, target=1.0, delta=0.005)
    falling.observe(3.0)
    assert falling.coef == 0.0 and falling.applied() == 0.0  # never below 0
    assert falling.state_dict() == {"coef": 0.0, "last": 3.0}


def test_a_fixed_coefficient_stays_as_set():
    control = EntropyControl(coef=0.02)
    for entropy in (3.0, 0.1):
        control.observe(entropy)
        assert control.applied() == 0.02 and control.last == math.inf
    assert not EntropyControl().active


ADAPTIVE = ["train.entropy_coef=0.01", "train.entropy_target=100.0", "train.entropy_coef_delta=0.01"]
ADAPTIVE += ["eval.every=0", "checkpoint.every=2"]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")


def test_an_adapted_coefficient_is_in_the_checkpoint_and_a_resume_continues_it(tmp_path):
    """The tiny model's entropy (~4.5 nats) is below the target of 100: the coefficient rises by 0.01 per
    update (2 per step). Resumed at step 2, the run continues from the coefficient it reached."""
    Trainer(tiny_config(tmp_path / "whole", *ADAPTIVE, "train.steps=4")).run()
    Trainer(tiny_config(tmp_path / "cut", *ADAPTIVE, "train.steps=2")).run()
    state = load_trainer_state(latest_checkpoint(tmp_path / "cut"))
    assert state["entropy"]["coef"] == pytest.approx(0.05) and state["entropy"]["last"] < 100.0
    resumed = load_config_for_resume(tmp_path / "cut")
    Trainer(resumed, resume=tmp_path / "cut").run()
    rows = [r for r in read_metrics(tmp_path / "whole") if r["kind"] == "train"]
    # per step, the mean of its 2 updates' coefficients: none on the first update, then 0.02, 0.03, ...
    assert [round(r["entropy_coef"], 9) for r in rows] == [0.01, 0.035, 0.055, 0.075]
    again = [r for r in read_metrics(tmp_path / "cut") if r["kind"] == "train"]
    assert [round(r["entropy_coef"], 9) for r in again] == [0.01, 0.035, 0.055, 0.075]
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)


def load_config_for_resume(run_dir: Path):
    from gspo.run.resume import resume_config

    return resume_config(run_dir, ["train.steps=4"])
