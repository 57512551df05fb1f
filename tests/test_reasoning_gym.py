"""reasoning-gym as a task source and reward: its own generators and scorers, seeded disjoint splits, errors.

Two datasets: chain_sum (numbers, scored as decimals with partial credit for a longer text holding the
answer) and spell_backward (strings, per-position partial credit).
"""

from __future__ import annotations

import sys
from decimal import Decimal
from pathlib import Path

import pytest
import reasoning_gym
import torch

from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.rewards.builtins import extract_answer
from gspo.rewards.builtins import reasoning_gym as reasoning_gym_reward
from gspo.rewards.resolve import check_examples, resolve_rewards
from gspo.rollout.data import DataError, batch_fields
from gspo.rollout.reasoning_gym import ANSWER_FORMAT, reasoning_gym_task
from gspo.training.inputs import build_examples
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
# 10 x 10 first operands and second operands, 2 operators: 200 distinct questions
SMALL_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _config(*overrides: str):
    return load_config(None, ["task.name=reasoning_gym", *overrides])


def _score(examples, completions):
    fields = batch_fields(examples)
    return reasoning_gym_reward([e.prompt for e in examples], completions, **fields)


# ---------------------------------------------------------------------------------------------------------
# Problems


def test_problems_are_reasoning_gyms_items_in_order_and_deterministic_per_seed() -> None:
    examples = reasoning_gym_task(30, dataset="spell_backward", dataset_config={"max_word_len": 6}, seed=5)
    assert examples == reasoning_gym_task(
        30, dataset="spell_backward", dataset_config={"max_word_len": 6}, seed=5
    )
    own = reasoning_gym.create_dataset("spell_backward", max_word_len=6, seed=5, size=30)
    # no repeats among the first 30 words here, so the problems are reasoning-gym's items 0..29 themselves
    assert [e.fields["entry"] for e in examples] == [own[i] for i in range(30)]
    assert examples[0].prompt == f"{own[0]['question']}\n\n{ANSWER_FORMAT}"
    assert examples[0].fields["answer"] == own[0]["answer"] == own[0]["metadata"]["word"][::-1]
    other = reasoning_gym_task(30, dataset="spell_backward", dataset_config={"max_word_len": 6}, seed=6)
    assert [e.prompt for e in other] != [e.prompt for e in examples]


def test_questions_never_repeat_so_the_held_out_split_is_disjoint_from_training() -> None:
    # 150 of the 200 possible questions: the first 150 items hold repeats, which must be skipped
    config = _config(
        "task.dataset=chain_sum",
        f"task.dataset_config={SMALL_SUMS}",
        "task.num_train=110",
        "task.num_eval=40",
    )
    train, held_out = build_examples(config)
    assert (len(train), len(held_out)) == (110, 40)
    questions = [e.fields["entry"]["question"] for e in train + held_out]
    assert len(set(questions)) == 150
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    own = reasoning_gym.create_dataset("chain_sum", **SMALL_SUMS, seed=1234, size=150)
    assert len({own[i]["question"] for i in range(150)}) < 150  # repeats are there to be skipped
    # every answer is reasoning-gym's own, and right
    for example in train + held_out:
        expression = example.fields["entry"]["metadata"]["expression"]
        assert int(example.fields["answer"]) == eval(expression)


def test_too_small_a_problem_space_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"gave 200 distinct questions .* fewer than the 250 asked for"):
        build_examples(
            _config("task.dataset=chain_sum", f"task.dataset_config={SMALL_SUMS}", "task.num_train=210")
        )


# ---------------------------------------------------------------------------------------------------------
# Reward


def test_extract_answer_takes_the_last_tagged_block_else_the_last_non_empty_line() -> None:
    assert extract_answer("<answer>3</answer> no, <answer>\n 4 \n</answer>\nso 4.") == "4"
    assert extract_answer("First 2 + 2 = 4.\n  The answer is 4.  \n\n \n") == "The answer is 4."
    assert extract_answer("<answer>4") == "<answer>4"  # an unclosed tag is no block
    assert extract_answer("") == extract_answer(" \n ") == ""


def test_chain_sum_scores_with_reasoning_gyms_decimal_scorer() -> None:
    (example,) = reasoning_gym_task(1, dataset="chain_sum", dataset_config=SMALL_SUMS, seed=3)
    entry = example.fields["entry"]
    assert entry["question"].endswith(f"{entry['metadata']['expression']} =")
    answer = example.fields["answer"]
    wrong = str(int(answer) + 1)
    completions = [
        f"Let me add.\n<answer>{answer}</answer>",  # right, tagged
        f"Step 1 ...\n{answer}\n",  # right, last line
        f"<answer>{int(answer):+d}.00</answer>",  # right: the scorer reads decimals ("+8.00" == "8")
        f"<answer>{wrong}</answer>",  # wrong
        f"<answer>{answer}</answer>\nWait, it is {wrong}\n<answer>{wrong}</answer>",  # the last block counts
        f"The answer is {answer}",  # format broken: partial credit len(answer) / len(line)
        f"<answer>{answer}",  # unclosed: the line "<answer>8" holds the answer
        "",  # nothing
    ]
    n = len(answer)
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, n / (14 + n), n / (8 + n), 0.0]
    assert _score([example] * len(completions), completions) == pytest.approx(expected)


def test_spell_backward_scores_with_reasoning_gyms_per_letter_scorer() -> None:
    (example,) = reasoning_gym_task(1, dataset="spell_backward", dataset_config={"min_word_len": 5}, seed=0)
    answer = example.fields["answer"]
    assert example.prompt.startswith("Spell this word backward") and len(answer) >= 5
    broken = answer[:-1] + ("x" if answer[-1] != "x" else "y")
    completions = [
        f"Reversed:\n<answer>{answer.upper()}</answer>",  # right (the scorer ignores case)
        f"The letters in reverse order\n{answer}",  # right, last line
        f"<answer>{broken}</answer>",  # last letter wrong: (n-1)/n of the letters in place
        f"<answer>{answer}</answer>\n<answer>x{answer}</answer>",  # last block, shifted: few letters match
        f"The word backward is {answer}",  # format broken: the line's first letters are compared
    ]
    word = answer
    shifted = "x" + word
    line = f"The word backward is {word}"
    expected = [
        1.0,
        1.0,
        (len(word) - 1) / len(word),
        sum(a == b for a, b in zip(word, shifted, strict=False)) / len(word),
        sum(a == b for a, b in zip(word.lower(), line.lower(), strict=False)) / len(word),
    ]
    assert _score([example] * len(completions), completions) == pytest.approx(expected)


def test_the_scorer_is_built_with_the_tasks_settings() -> None:
    # decimal_arithmetic accepts answers within one unit of the last of max_num_decimal_places places
    for places, expected in ((1, 1.0), (3, 0.0)):
        settings = {"min_num_decimal_places": places, "max_num_decimal_places": places}
        (example,) = reasoning_gym_task(1, dataset="decimal_arithmetic", dataset_config=settings, seed=0)
        near = Decimal(example.fields["answer"]) + Decimal("0.05")  # within 0.1, not within 0.001
        assert _score([example], [f"<answer>{near}</answer>"]) == [expected]


def test_a_run_scores_with_the_reasoning_gym_reward_and_checks_fields_at_start_up(tmp_path: Path) -> None:
    config = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            "report_to=[]",
            "task.name=reasoning_gym",
            "task.dataset=chain_sum",
            f"task.dataset_config={SMALL_SUMS}",
            "rewards={reasoning_gym: 1.0, digit_fraction: 0.1}",
            "train.steps=1",
            "checkpoint.every=0",
        ],
    )
    metrics = Trainer(config).train_step()
    assert torch.isfinite(torch.tensor(metrics["reward_mean"]))
    train, _ = build_examples(config)
    rewards = resolve_rewards(config, None)
    check_examples(rewards, train)  # passes
    bad = [type(train[0])(train[0].prompt, {**train[0].fields, "dataset": "chain_summ"})]
    with pytest.raises(
        DataError, match=r"'chain_summ' is not a reasoning-gym dataset; did you mean 'chain_sum'"
    ):
        check_examples(rewards, bad)


# ---------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["task.dataset=chain_summ"],
            "task.dataset='chain_summ' is not a reasoning-gym dataset; did you mean 'chain_sum', "
            "'decimal_chain_sum'?",
        ),
        (
            ["task.dataset=chain_sum", "task.dataset_config={min_term: 2}"],
            "task.dataset_config.min_term is not a setting of 'chain_sum'; did you mean 'min_terms'? chain_sum's "
            "settings (defaults): min_terms=2, max_terms=6, min_digits=1, max_digits=4, allow_negation=False",
        ),
        (
            ["task.dataset=chain_sum", "task.dataset_config={max_digits: two}"],
            "task.dataset_config.max_digits: expected an integer (the default is 4), got 'two'; chain_sum's settings",
        ),
        (
            ["task.dataset=chain_sum", "task.dataset_config={min_terms: 5, max_terms: 3}"],
            "reasoning-gym rejects it for 'chain_sum': max_terms must be >= min_terms; chain_sum's settings",
        ),
        (
            ["task.dataset=spell_backward", "task.dataset_config={size: 10}"],
            "task.dataset_config.size: gspo sets it from task.num_train and task.num_eval; remove it",
        ),
        (
            ["task.dataset=word_sorting", "task.dataset_config={transformation: reversed}"],
            "task.dataset_config.transformation: expected one of ['lowercase', 'uppercase', 'original', "
            "'randomcase'] (the default is 'original'), got 'reversed'",
        ),
        (
            ["task.dataset=chain_sum", "task.dataset_config={allow_negation: sometimes}"],
            "task.dataset_config.allow_negation: expected true or false (the default is False), got 'sometimes'",
        ),
        (
            ["task.dataset=basic_arithmetic", "task.dataset_config={operators: '+-'}"],
            "task.dataset_config.operators: expected a list (the default is ('+', '-', '*', '/')), got '+-'",
        ),
    ],
    ids=[
        "unknown-dataset",
        "unknown-setting",
        "bad-type",
        "rejected-value",
        "own-setting",
        "bad-choice",
        "bad-bool",
        "bad-list",
    ],
)
def test_bad_datasets_and_settings_are_config_errors_naming_the_field(overrides, message) -> None:
    with pytest.raises(ConfigError) as error:
        build_examples(_config(*overrides))
    assert message in str(error.value)


def test_a_list_setting_takes_a_yaml_list_and_a_setting_changes_the_problems() -> None:
    config = _config("task.dataset=basic_arithmetic", "task.dataset_config={operators: ['*'], max_terms: 2}")
    train, _ = build_examples(config)
    expressions = [e.fields["entry"]["metadata"]["expression"] for e in train]
    assert all("*" in x and "+" not in x and " - " not in x for x in expressions), expressions[:5]


def test_the_dataset_goes_with_task_name_reasoning_gym() -> None:
    with pytest.raises(
        ConfigError, match=r"task\.dataset names a reasoning-gym dataset and goes with task\.name"
    ):
        _config()  # task.name=reasoning_gym without task.dataset
    with pytest.raises(ConfigError, match=r"goes with task\.name=reasoning_gym"):
        load_config(None, ["task.dataset=chain_sum"])
    with pytest.raises(
        ConfigError, match=r"task\.dataset_config sets a reasoning-gym dataset, but task\.name='arithmetic'"
    ):
        load_config(None, ["task.dataset_config={min_terms: 2}"])


def test_a_missing_reasoning_gym_says_how_to_install_it(monkeypatch, tmp_path: Path, capsys) -> None:
    for module in [name for name in sys.modules if name.split(".")[0] == "reasoning_gym"]:
        monkeypatch.setitem(sys.modules, module, None)  # None in sys.modules: importing it raises ImportError
    with pytest.raises(ImportError, match=r"need reasoning-gym .*: pip install 'gspo\[reasoning\]'"):
        build_examples(_config("task.dataset=chain_sum"))
    overrides = ["model.tiny=llama", "task.name=reasoning_gym", "task.dataset=chain_sum", "progress=false"]
    code = main(["train", f"output_dir={tmp_path / 'run'}", "report_to=[]", *overrides])
    assert code == 9  # EXIT_CODES["package"]
    assert "pip install 'gspo[reasoning]'" in capsys.readouterr().err
