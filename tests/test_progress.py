"""A run that stopped learning says so, once, with the step it began (gspo.training.stalls.FlatWatch): a
collapse (most groups agree on one answer below the rewards' best), saturation (most groups all right), or a
zero gradient norm, for train.warn_after_flat_steps rollout batches in a row; in the progress output and in
summary.md."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import tiny_config
from gspo.config import Config
from gspo.rollout.samplers import Rollouts
from gspo.training.stalls import FlatWatch
from gspo.training.trainer import Trainer

COLLAPSING = {"groups_drawn": 8.0, "groups_solved": 0.0, "groups_stuck": 6.0, "groups_agreeing": 5.0}
SATURATED = {"groups_drawn": 8.0, "groups_solved": 6.0, "groups_stuck": 0.0, "groups_agreeing": 0.0}
LEARNING = {"groups_drawn": 8.0, "groups_solved": 2.0, "groups_stuck": 1.0, "groups_agreeing": 1.0}


def test_a_collapse_is_told_once_with_the_step_it_began_and_what_helps() -> None:
    config = Config()
    config.rollout.dynamic_sampling, config.rollout.temperature = False, 1.0
    watch = FlatWatch(config, after=3)
    assert watch.update(1, {**LEARNING, "grad_norm": 1.0}) == []
    assert watch.update(2, {**COLLAPSING, "grad_norm": 1.0}, answer="11") == []
    assert watch.update(3, {**COLLAPSING, "grad_norm": 1.0}) == []
    (due,) = watch.update(4, {**COLLAPSING, "grad_norm": 1.0})
    assert due.startswith(
        "warning: collapse: in steps 2-4, at least half of each rollout batch's groups agree"
    )
    assert "(e.g. '11')" in due
    assert "rollout.dynamic_sampling=true" in due and "rollout.temperature=1.2" in due
    assert watch.postfix() == {"warn": "collapse"}
    assert watch.update(5, {**COLLAPSING, "grad_norm": 1.0}) == []  # once
    assert watch.began == {"collapsed": 2}


def test_a_collapse_with_the_remedies_on_names_what_is_left() -> None:
    watch = FlatWatch(Config(), after=1)  # the default: dynamic sampling and temperature 1.2
    (due,) = watch.update(1, {**COLLAPSING, "grad_norm": 1.0})
    assert "are on already" in due and "shaping reward" in due


def test_groups_all_right_are_saturated_not_collapsed() -> None:
    watch = FlatWatch(Config(), after=2)
    assert watch.update(1, {**SATURATED, "grad_norm": 0.0}) == []
    due = watch.update(2, {**SATURATED, "grad_norm": 0.0})
    assert [d.split(":")[:2] for d in due] == [["note", " saturated"], ["warning", " steps 1-2"]]
    assert "the gradient norm was 0" in due[1]
    assert not any("collapse" in d for d in due)
    assert watch.postfix() == {"warn": "saturated, zero grad"}


def test_no_note_while_learning_and_none_when_off() -> None:
    watch = FlatWatch(Config(), after=2)
    assert [watch.update(s, {**LEARNING, "grad_norm": 1.0}) for s in range(1, 6)] == [[]] * 5
    assert FlatWatch(Config(), after=0).update(1, COLLAPSING) == []  # 0: never
    assert FlatWatch(Config(), after=1).update(1, {"grad_norm": 1.0}) == []  # a line without the counts


class AnsweringSampler:
    """Every sample of every prompt is one fixed completion, or (``right``) the prompt's sum: groups that
    agree, on a wrong answer or on the right one."""

    current = True

    def __init__(self, *, right: bool) -> None:
        self.right = right

    def answer(self, prompt: str) -> str:
        a, b = map(int, re.search(r"(\d+) \+ (\d+)", prompt).groups())
        return str(a + b) if self.right else "11"

    def generate(self, prompts, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        out = Rollouts([], [], [], [], [])
        for prompt in prompts:
            text = self.answer(prompt)
            ids = [5, 6][:max_new_tokens]  # what the tiny model scores; the rewards read the text
            for _ in range(group_size):
                out.prompt_ids.append([1, 2, 3])
                out.completion_ids.append(ids)
                out.sampler_logprobs.append([-0.5] * len(ids))
                out.truncated.append(False)
                out.completions.append(text)
        return out

    def sync_weights(self, model, tokenizer, step) -> None:
        pass


def _run(tmp_path: Path, *, right: bool) -> str:
    config = tiny_config(
        tmp_path / "run",
        "rewards={exact_answer: 1.0, number_format: 0.25}",
        "train.steps=3",
        "train.warn_after_flat_steps=2",
        "rollout.dynamic_sampling=false",
        "eval.every=0",
        "checkpoint.every=0",
        "task.operand_min=1",
        "task.operand_max=4",  # no sum is 11: every group agrees on a wrong answer
        "task.num_train=12",
        "task.num_eval=4",
    )
    Trainer(config, sampler=AnsweringSampler(right=right)).run()
    return (tmp_path / "run" / "summary.md").read_text()


def test_a_run_whose_groups_agree_on_a_wrong_answer_is_told_it_collapsed(tmp_path, capsys) -> None:
    summary = _run(tmp_path, right=False)
    err = capsys.readouterr().err
    assert "warning: collapse: in steps 1-2" in err and "(e.g. '11')" in err
    assert "- Collapse: in steps 1-2" in summary
    assert "stuck (below it) 1.0000, of which agreeing on one answer 1.0000" in summary


def test_a_run_whose_groups_are_all_right_is_told_it_saturated(tmp_path, capsys) -> None:
    summary = _run(tmp_path, right=True)
    err = capsys.readouterr().err
    assert "collapse" not in err and "note: saturated: in steps 1-2" in err
    assert "- Saturated: in steps 1-2" in summary and "Collapse" not in summary
    assert "solved (at the rewards' best) 1.0000" in summary
