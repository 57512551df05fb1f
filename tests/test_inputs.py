"""Start-up guards: data the run could not use is refused before training, naming the row; a reward function
that hangs stops the run; unknown reward names are config errors."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from gspo.config import ConfigError, load_config
from gspo.rewards.calling import RewardError
from gspo.rollout.data import DataError
from gspo.run.checkpoint import latest_checkpoint
from gspo.training.trainer import Trainer


def _file_task(path: Path) -> list[str]:
    return ["task.name=file", f"task.data_path={path}", "task.num_eval=1"]


def test_a_prompt_longer_than_the_context_is_refused_at_start_naming_the_row(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    rows[3]["prompt"] = "x" * 600  # the tiny model has 512 positions
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DataError, match=r"data\.jsonl row 4: the prompt is 6\d\d tokens .* > the model's context of 512"
    ):
        Trainer(tiny_config(tmp_path / "run", *_file_task(data)))


def test_a_key_value_cache_that_cannot_fit_is_refused_at_start_with_the_estimate(
    tmp_path: Path, monkeypatch
) -> None:
    """The tiny Llama caches 2 (keys, values) x 2 layers x 2 kv heads x 16 dims x 4 bytes (float32) = 512
    bytes per token of each sequence; 64 slots (of 4 x 64 samples) of T tokens need 32,768 x T bytes."""
    from gspo.training import inputs as build

    monkeypatch.setattr(build, "available_memory", lambda device: 10 * 2**20)
    overrides = ["rollout.group_size=64", "rollout.max_new_tokens=400"]
    with pytest.raises(ConfigError) as error:
        Trainer(tiny_config(tmp_path / "run", *overrides))
    message = str(error.value)
    tokens = int(re.search(r"^64 sequences of up to (\d+) tokens", message)[1])
    assert 400 < tokens <= 512  # the longest prompt, templated, + rollout.max_new_tokens
    assert (
        f"need a key/value cache of about {64 * 512 * tokens / 2**20:.1f} MiB, and 10.0 MiB is free"
        in message
    )
    assert message.endswith("lower rollout.generation_batch_size or rollout.max_new_tokens")
    Trainer(tiny_config(tmp_path / "run2", *overrides, "rollout.generation_batch_size=16"))  # 1/4 fits


def test_an_answer_a_reward_cannot_use_is_refused_at_start_naming_the_row(tmp_path: Path) -> None:
    data = tmp_path / "data.csv"
    data.write_text(
        "prompt,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\nWhat is 3 + 3?,six\nWhat is 1 + 4?,5\n"
    )
    with pytest.raises(
        DataError, match=r"data\.csv row 3: answer 'six' is not a number, which reward 'correct_number'"
    ):
        Trainer(tiny_config(tmp_path / "run", *_file_task(data)))
    # a field a reward needs that the data does not have
    data.write_text("prompt,solution\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    overrides = [*_file_task(data), "task.answer_fields=[solution]"]
    with pytest.raises(DataError, match=r"row 1: reward 'correct_number' needs the field\(s\) \['answer'\]"):
        Trainer(tiny_config(tmp_path / "run", *overrides))
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_an_unknown_reward_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"rewards\.exact_anwser: unknown reward .*did you mean 'exact_answer'"
    ):
        Trainer(tiny_config(tmp_path / "run", "rewards={exact_anwser: 1.0}"))


def test_a_hung_reward_function_stops_the_run_and_saves_no_step_0(tmp_path: Path) -> None:
    """Step 1's rewards hang: the run stops with the function's line; nothing was trained, so there is
    no checkpoint (no step 0 is saved) and the same command starts the run again."""
    never = threading.Event()
    calls = {"n": 0}

    def hangs_in_step_1(prompts, completions, **_):
        calls["n"] += 1
        if calls["n"] == 2:  # the step-0 evaluation, then step 1's rollout
            never.wait()
        return [0.0] * len(completions)

    config = tiny_config(tmp_path / "run", "rewards={hangs: 1.0}", "reward_timeout=1", "eval.every=0")
    trainer = Trainer(config, reward_functions={"hangs": hangs_in_step_1})
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"'hangs' did not return within 1 s"):
        trainer.run()
    never.set()
    assert time.perf_counter() - start < 30
    assert latest_checkpoint(trainer.run_dir) is None


def _brevity(prompts, completions, **_):
    return [1.0 if len(c) < 3 else 0.0 for c in completions]


def test_reward_functions_from_python_replace_the_configured_rewards(tmp_path: Path) -> None:
    from gspo.rewards.builtins import number_format
    from gspo.rewards.resolve import resolve_rewards

    config = tiny_config(tmp_path, "rewards={correct_number: 1.0, brevity: 0.25}")
    resolved = resolve_rewards(config, {"number_format": number_format, "brevity": _brevity})
    # exactly the functions given, in their order (the first is the accuracy); a weight the config
    # gives their name applies, else 1.0; correct_number, configured but not given, is gone
    assert [(name, weight) for name, _, weight in resolved] == [("number_format", 1.0), ("brevity", 0.25)]
    assert resolved[1][1](["p"] * 2, ["12", "1234"]) == [1.0, 0.0]
    # without Python functions, the config's rewards as they are
    assert [n for n, _, _ in resolve_rewards(tiny_config(tmp_path), None)] == list(
        tiny_config(tmp_path).rewards
    )

    trainer = Trainer(tiny_config(tmp_path), reward_functions={"brevity": _brevity})
    assert trainer.config.rewards == {"brevity": 1.0}  # what the run folder's config.yaml says it used
    assert load_config(trainer.run_dir / "config.yaml").rewards == {"brevity": 1.0}
    trainer.logger.close()


def test_configured_rewards_are_named_by_their_function_unless_two_share_one() -> None:
    from gspo.rewards.resolve import reward_labels

    names = [
        "correct_number",
        "/tasks/a/rewards.py:score",
        "b.py:score",
        "pkg.mod:brevity",
        "c.py:exact_answer",
    ]
    assert reward_labels(names) == {
        "correct_number": "correct_number",
        "/tasks/a/rewards.py:score": "/tasks/a/rewards.py:score",  # two functions named score
        "b.py:score": "b.py:score",
        "pkg.mod:brevity": "brevity",
        "c.py:exact_answer": "exact_answer",
    }


def test_the_linear_schedule_is_transformers_own_after_the_warm_up() -> None:
    """train.schedule=linear (TRL's default lr_scheduler_type): after the warm-up, the factor of every update
    is transformers' get_linear_schedule_with_warmup's, down to 0 at the last update."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    from gspo.run.build import lr_schedule

    config = load_config(None, ["train.schedule=linear", "train.warmup_updates=3"])
    ours = lr_schedule(config, total_updates=20)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    theirs = get_linear_schedule_with_warmup(optimizer, 3, 20).lr_lambdas[0]
    assert [ours(u) for u in range(3, 21)] == [theirs(u) for u in range(3, 21)]
    assert ours(20) == 0.0 and ours(3) == 1.0
