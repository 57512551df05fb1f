"""Built-in reward functions, the checked combination compute_rewards, and resolve_reward."""

from __future__ import annotations

import asyncio
import doctest
import inspect
import math
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gspo.rewards.builtins as rewards_module
from gspo.rewards.builtins import BUILTIN_REWARDS, correct_number, exact_answer, number_format
from gspo.rewards.calling import RewardError, prepare, reward
from gspo.rewards.resolve import resolve_reward
from gspo.rewards.scoring import RewardWarning, compute_rewards

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def test_docstring_examples():
    result = doctest.testmod(rewards_module)
    assert result.attempted >= 6 and result.failed == 0


CORRECT_NUMBER_CASES = [
    ("The answer is 12.", "12", 1.0),
    ("12", "12", 1.0),
    ("3 + 9 = 12", 12, 1.0),  # answers may be ints
    ("12, no wait, 13", "12", 0.0),  # the LAST number counts
    ("-3", "-3", 1.0),
    ("-3", "3", 0.0),
    ("5-8 = -3", "-3", 1.0),
    ("5-3", "-3", 0.0),  # a minus after a digit is an operator
    ("It is 1,000 apples", "1000", 1.0),
    ("1000", "1,000", 1.0),
    ("12.0", "12", 1.0),
    ("2.5", 2.5, 1.0),
    ("about .5", "0.5", 0.0),  # ".5" is not read
    ("twelve", "12", 0.0),
    ("", "0", 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), CORRECT_NUMBER_CASES)
def test_correct_number(completion, answer, expected):
    assert correct_number(["p"], [completion], answer=[answer]) == [expected]


def test_correct_number_rejects_non_numeric_answer():
    with pytest.raises(ValueError, match="'cat' is not a number"):
        correct_number(["p"], ["3"], answer=["cat"])


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is 12.", "12", 0.0),
        ("12", "12", 1.0),
        ("  12.\n", "12", 1.0),
        ("12..", "12", 0.0),  # only one period goes
        ("12.0", "12", 0.0),  # text, not value
        ("12", 12, 1.0),
        ("Paris", "paris", 0.0),  # case-sensitive
    ],
)
def test_exact_answer(completion, answer, expected):
    assert exact_answer(["p"], [completion], answer=[answer]) == [expected]


def test_number_format():
    completions = ["12", "-3", " 1,000.\n", "2.5", "12 apples", "The answer is 12", "1,00", ""]
    assert number_format(["p"] * 8, completions) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_builtins_ignore_fields_meant_for_others():
    assert number_format(["p"], ["1"], answer=["2"], unit=["x"]) == [1.0]
    assert set(BUILTIN_REWARDS) == {
        "correct_number",
        "exact_answer",
        "number_format",
        "digit_fraction",
        "reasoning_gym",
    }


# ---------------------------------------------------------------------------------------------------------
# compute_rewards

PROMPTS = ["What is 1 + 1?", "What is 2 + 2?", "What is 3 + 3?"]
COMPLETIONS = ["2", "The answer is 4.", "7"]
FIELDS = {"answer": ["2", "4", "6"]}


def test_compute_rewards_weighted_sum():
    functions = [("correct", correct_number, 2.0), ("format", number_format, -0.5)]
    total, per_function = compute_rewards(functions, PROMPTS, COMPLETIONS, FIELDS)
    # correct = [1, 1, 0], format = [1, 0, 1]
    assert total.dtype == torch.float32 and total.shape == (3,)
    assert total.tolist() == [1.5, 2.0, -0.5]
    assert per_function["correct"].tolist() == [1.0, 1.0, 0.0]
    assert per_function["format"].tolist() == [1.0, 0.0, 1.0]


def test_compute_rewards_passes_fields_as_keyword_lists():
    received = {}

    def spy(prompts, completions, **fields):
        received.update(prompts=prompts, completions=completions, **fields)
        return np.array([0.25, 0.5, 0.75])  # arrays are accepted as well as lists

    fields = {"answer": ["2", "4", "6"], "unit": ["a", "b", "c"]}
    total, _ = compute_rewards([("spy", spy, 1.0)], PROMPTS, COMPLETIONS, fields)
    state, log = received.pop("trainer_state"), received.pop("log_metric")
    # gspo's keywords beside the fields, as TRL passes them: each completion's group (one group here)
    assert received == {"prompts": PROMPTS, "completions": COMPLETIONS, **fields, "group_ids": [0, 0, 0]}
    assert state.global_step == 0 and callable(log)
    assert total.tolist() == [0.25, 0.5, 0.75]


def test_none_is_a_function_that_does_not_score_that_sample():
    """TRL's multi-task convention: a function returns None for a sample it does not apply to. Its value is
    NaN there (left out of its reward/ mean), the total the weighted sum of the functions that scored; a
    sample no function scored gets 0 and a warning naming it."""

    def math_only(prompts, completions, **_):
        return [1.0, None, 0.5]

    def code_only(prompts, completions, **_):
        return [None, 0.25, None]

    total, per = compute_rewards([("m", math_only, 2.0), ("c", code_only, 4.0)], PROMPTS, COMPLETIONS, {})
    assert total.tolist() == [2.0, 1.0, 1.0]
    assert per["m"][1].isnan() and per["c"][0].isnan() and per["m"][0] == 1.0

    def nothing(prompts, completions, **_):
        return [None, 1.0, 1.0]

    with pytest.warns(RewardWarning, match=r"every reward function returned None for sample 0"):
        total, _ = compute_rewards([("n", nothing, 1.0)], PROMPTS, COMPLETIONS, {})
    assert total.tolist() == [0.0, 1.0, 1.0]


def test_raising_function_names_function_and_sample():
    def picky(prompts, completions, **_):
        return [1.0 / len(c) for c in completions]  # an empty completion divides by zero

    completions = ["ok", "fine", ""]
    with pytest.raises(RewardError, match=r"'picky' raised ZeroDivisionError.*sample 2") as info:
        compute_rewards([("picky", picky, 1.0)], PROMPTS, completions, FIELDS)
    assert isinstance(info.value.__cause__, ZeroDivisionError)

    def rejects_long(prompts, completions, **_):
        if any(len(c) > 100 for c in completions):
            raise ValueError("too long")
        return [0.0] * len(completions)

    completions = ["ok", "x" * 200, "fine"]
    with pytest.raises(RewardError, match=r"'rejects_long'.*too long.*sample 1") as info:
        compute_rewards([("rejects_long", rejects_long, 1.0)], PROMPTS, completions, FIELDS)
    assert f"'{'x' * 80}'..." in str(info.value)  # the first 80 characters, no more
    assert "x" * 81 not in str(info.value)


def test_a_reward_error_points_at_the_users_innermost_line(tmp_path, monkeypatch):
    """The last frame of the user's code: a helper module of theirs, not gspo's or the library's frames."""
    (tmp_path / "helpers.py").write_text("import json\n\n\ndef parse(text):\n    return json.loads(text)\n")
    (tmp_path / "task.py").write_text(
        "from helpers import parse\n\n\ndef parsed(prompts, completions, **_):\n"
        "    return [float(parse(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    parsed = resolve_reward(f"{tmp_path / 'task.py'}:parsed")
    with pytest.raises(RewardError) as info:
        compute_rewards([("parsed", prepare(parsed, "parsed", timeout=5.0), 1.0)], ["p"] * 2, ["1", "x"], {})
    assert str(info.value).endswith(
        f"at sample 1 (completion 'x') in {tmp_path / 'helpers.py'}:5 `return json.loads(text)`"
    )
    with pytest.raises(RewardError) as info:  # gspo's own function: no line of the user's
        compute_rewards([("correct_number", correct_number, 1.0)], ["p"], ["1"], {})
    assert str(info.value).endswith("at sample 0 (completion '1')")


def test_batch_only_failure_is_reported_for_the_batch():
    def needs_pairs(prompts, completions, **_):
        if len(completions) != 1:
            raise RuntimeError("batch unsupported")
        return [0.0]

    with pytest.raises(RewardError, match=r"'needs_pairs'.*batch of 3 samples.*no single sample"):
        compute_rewards([("needs_pairs", needs_pairs, 1.0)], PROMPTS, COMPLETIONS, FIELDS)


@pytest.mark.parametrize(
    ("returned", "pattern"),
    [
        ([1.0, math.nan, 0.0], r"'bad' returned nan at sample 1 \(completion 'The answer is 4.'\)"),
        ([1.0, 0.0, math.inf], r"'bad' returned inf at sample 2"),
        ([1.0, "1", 0.0], r"'bad' returned '1' at sample 1"),
        # taken as 1.0: a boolean is no amount of reward
        ([1.0, True, 0.0], r"'bad' returned True at sample 1 .*not booleans: return 1\.0 or 0\.0"),
        (torch.tensor([True, False, True]), r"'bad' returned True at sample 0 .*not booleans"),
        ([1.0, 0.0], r"'bad' returned 2 values for 3 completions"),
        (1.0, r"'bad' returned float, expected a list of 3 floats"),
    ],
)
def test_bad_return_values(returned, pattern):
    def bad(prompts, completions, **_):
        return returned

    functions = [("good", number_format, 1.0), ("bad", bad, 1.0)]
    with pytest.raises(RewardError, match=pattern):
        compute_rewards(functions, PROMPTS, COMPLETIONS, FIELDS)


def test_compute_rewards_argument_checks():
    with pytest.raises(ValueError, match="'answer' has 2 entries for 3 completions"):
        compute_rewards([("f", number_format, 1.0)], PROMPTS, COMPLETIONS, {"answer": ["1", "2"]})
    with pytest.raises(ValueError, match=r"repeated: \['f'\]"):
        compute_rewards([("f", number_format, 1.0)] * 2, PROMPTS, COMPLETIONS, FIELDS)
    with pytest.raises(ValueError, match="'f' has weight nan"):
        compute_rewards([("f", number_format, math.nan)], PROMPTS, COMPLETIONS, FIELDS)
    with pytest.raises(ValueError, match="at least one"):
        compute_rewards([], PROMPTS, COMPLETIONS, FIELDS)


# ---------------------------------------------------------------------------------------------------------
# resolve_reward


def test_resolve_builtin_and_module():
    assert resolve_reward("exact_answer") is exact_answer
    assert resolve_reward("gspo.rewards.builtins:correct_number") is correct_number


def test_resolve_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def length_penalty(prompts, completions, **_):\n    return [-len(c) / 10 for c in completions]\n"
    )
    function = resolve_reward(f"{path}:length_penalty")
    assert function(["p", "p"], ["abcde", ""]) == [-0.5, 0.0]

    with pytest.raises(ValueError, match=r"no 'missing'.*\['length_penalty'\]"):
        resolve_reward(f"{path}:missing")
    with pytest.raises(FileNotFoundError, match=r"other\.py"):
        resolve_reward(f"{tmp_path / 'other.py'}:f")


def test_resolve_unknown_name_lists_builtins_and_closest():
    with pytest.raises(
        ValueError, match=r"'correct_numbr'.*correct_number.*exact_answer.*number_format"
    ) as info:
        resolve_reward("correct_numbr")
    assert "did you mean 'correct_number'?" in str(info.value)
    with pytest.raises(ImportError, match="no_such_module"):
        resolve_reward("no_such_module:f")


def test_a_reward_too_large_for_float32_is_an_error_naming_it():
    with pytest.raises(RewardError, match=r"'huge' returned 1e\+39 at sample 1 .*beyond float32's range"):
        compute_rewards([("huge", lambda p, c, **_: [0.0, 1e39], 1.0)], ["p", "p"], ["a", "b"], {})
    with pytest.raises(RewardError, match=r"weighted sum of the rewards .* overflows float32 at sample 0"):
        compute_rewards([("big", lambda p, c, **_: [3e38], 10.0)], ["p"], ["a"], {})


def test_a_hung_reward_function_times_out_once_without_retries_per_sample():
    import threading
    import time

    never = threading.Event()
    calls = []

    def hangs(prompts, completions, **_):
        calls.append(len(completions))
        never.wait()

    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"'hangs' did not return within 0\.3 s \(reward_timeout\)"):
        compute_rewards([("hangs", prepare(hangs, "hangs", timeout=0.3), 1.0)], ["p"] * 4, ["c"] * 4, {})
    assert time.perf_counter() - start < 3 and calls == [4]  # not retried one sample at a time
    never.set()
    # a function that returns in time is unchanged, errors included
    assert prepare(number_format, "fmt", timeout=5.0)(["p"], ["12"]) == [1.0]
    with pytest.raises(RewardError, match="raised ZeroDivisionError"):
        compute_rewards(
            [("div", prepare(lambda p, c, **_: [1 / 0], "div", timeout=5.0), 1.0)], ["p"], ["c"], {}
        )


# ---- calling conventions: TRL's keywords, and the positional callers of before -----------------------
def reward_len(completions, **kwargs):
    """TRL's documented example reward: its signature names no prompts, so they must come by keyword."""
    return [-abs(5 - len(completion)) for completion in completions]


def accuracy_like(completions, solution, **kwargs):  # TRL's accuracy_reward: a column as a named parameter
    return [float(c == s) for c, s in zip(completions, solution, strict=True)]


def test_trl_signatures_are_called_with_keywords_and_positional_ones_as_before():
    seen: dict[str, object] = {}

    def positional(p, c, **fields):  # names of its own: positions, as gspo always called it
        seen["positional"] = (p, c, fields)
        return [0.0] * len(c)

    def star_args(*args, **fields):  # reads positions: keeps them
        seen["star"] = args
        return [0.0] * len(args[1])

    def everything(**kwargs):  # keywords only: TRL's way
        seen["keywords"] = sorted(kwargs)
        return [0.0] * len(kwargs["completions"])

    functions = [
        ("reward_len", prepare(reward_len, "reward_len"), 1.0),
        ("accuracy_like", prepare(accuracy_like, "accuracy_like"), 1.0),
        ("positional", prepare(positional, "positional"), 1.0),
        ("star", prepare(star_args, "star_args"), 1.0),
        ("keywords", prepare(everything, "everything"), 1.0),
        (
            "correct",
            prepare(correct_number, "correct_number"),
            1.0,
        ),  # gspo's own contract: prompts, completions named
    ]
    fields = {"answer": ["2", "4", "6"], "solution": ["2", "x", "7"]}
    _, per_function = compute_rewards(functions, PROMPTS, COMPLETIONS, fields)
    assert per_function["reward_len"].tolist() == [-4.0, -11.0, -4.0]
    assert per_function["accuracy_like"].tolist() == [1.0, 0.0, 1.0]
    assert per_function["correct"].tolist() == [1.0, 1.0, 0.0]
    shared = ["group_ids", "log_metric", "trainer_state"]  # gspo's keywords, to what takes **kwargs
    assert seen["positional"][:2] == (PROMPTS, COMPLETIONS)
    assert {k: v for k, v in seen["positional"][2].items() if k not in shared} == fields
    assert sorted(seen["positional"][2]) == sorted([*fields, *shared])
    assert seen["star"] == (PROMPTS, COMPLETIONS)
    assert seen["keywords"] == sorted(["answer", "completions", "prompts", "solution", *shared])
    # the wrapper keeps what start-up reads: the signature (fields a reward needs) and validate_example
    assert prepare(correct_number, "correct_number").validate_example is correct_number.validate_example
    assert "answer" in inspect.signature(prepare(correct_number, "correct_number")).parameters


def test_a_trl_reward_given_in_python_runs_and_its_failing_sample_is_named():
    """resolve_rewards prepares each function once at start-up: TRL's reward_len takes no positional prompts
    ("takes 1 positional argument but 2 were given" before), and the per-sample retry of a failing batch
    calls it the same way."""
    from gspo.config import Config
    from gspo.rewards.resolve import resolve_rewards

    def picky(completions, **kwargs):
        return [1.0 / len(c) for c in completions]

    rewards = resolve_rewards(Config(), [reward_len, picky])
    _, per_function = compute_rewards(rewards[:1], PROMPTS, COMPLETIONS, {})
    assert per_function["reward_len"].tolist() == [-4.0, -11.0, -4.0]
    with pytest.raises(RewardError, match=r"'picky' raised ZeroDivisionError.* at sample 1"):
        compute_rewards(rewards[1:], PROMPTS, ["a", "", "b"], {})


# ---- how a function is declared: by batch or per completion, async or plain, in threads -----------------
ANSWERS = {"answer": ["2", "4", "6"]}


def graded(prompts, completions, *, answer, **_):
    """The plain batch function the others are twins of: its values, in its order."""
    return [float(c.strip().endswith(a)) + len(c) / 100 for c, a in zip(completions, answer, strict=True)]


async def graded_async(prompts, completions, *, answer, **_):
    await asyncio.sleep(0.01)
    return graded(prompts, completions, answer=answer)


def graded_one(completion, *, answer, **_):
    return float(completion.strip().endswith(answer)) + len(completion) / 100


async def graded_one_async(completion, answer, prompt):  # no **kwargs: given the keywords it takes only
    await asyncio.sleep(0.03 - 0.01 * COMPLETIONS.index(completion))  # the first ends last
    return graded_one(completion, answer=answer)


@reward(threads=True)
def graded_one_threaded(completion, *, answer, **_):
    time.sleep(0.03 - 0.01 * COMPLETIONS.index(completion))
    return graded_one(completion, answer=answer)


def test_every_declaration_gives_its_plain_twins_values_in_its_order():
    """An async batch function, and per-completion ones (plain, async, in threads) whose calls end out of
    order, give the plain batch function's values sample for sample, exactly."""
    twins = [graded_async, graded_one, graded_one_async, graded_one_threaded]
    functions = [("graded", graded, 1.0)] + [(f.__name__, f, 1.0) for f in twins]
    total, per_function = compute_rewards(functions, PROMPTS, COMPLETIONS, ANSWERS)
    want = graded(PROMPTS, COMPLETIONS, **ANSWERS)
    for f in twins:
        assert per_function[f.__name__].tolist() == torch.tensor(want).tolist(), f.__name__
    assert total.tolist() == (5 * torch.tensor(want)).tolist()
    kinds = {f.__name__: prepare(f, f.__name__) for f in twins}
    assert kinds["graded_one_async"].per_completion and kinds["graded_one_async"].is_async
    assert kinds["graded_one_threaded"].threads and not kinds["graded_async"].per_completion


def _in_flight():
    """An async per-completion reward that counts its calls in flight, and the largest count seen."""
    state = {"now": 0, "peak": 0}

    async def counted(completion, **_):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.02)
        state["now"] -= 1
        return 1.0

    return counted, state


@pytest.mark.parametrize("bound", [1, 8, 32])
def test_async_calls_run_concurrently_up_to_the_bound(bound):
    counted, state = _in_flight()
    completions = [f"c{i}" for i in range(40)]
    compute_rewards(
        [("counted", prepare(counted, "counted", concurrency=bound), 1.0)], ["p"] * 40, completions, {}
    )
    assert state["peak"] == bound and state["now"] == 0


def test_an_errors_or_a_timeouts_call_is_named_by_its_sample():
    async def flaky(completion, **_):
        if completion == COMPLETIONS[2]:
            raise ValueError("the judge is down")
        return 1.0

    async def hangs(completion, **_):
        if completion == COMPLETIONS[1]:
            await asyncio.sleep(60)
        return 1.0

    async def batch_flaky(prompts, completions, **_):
        return [1.0 / (c != COMPLETIONS[1]) for c in completions]

    cases = [
        (
            prepare(flaky, "flaky"),
            r"'flaky' raised ValueError: the judge is down at sample 2 \(completion '7'\)",
        ),
        (prepare(hangs, "hangs", timeout=0.2), r"'hangs' did not return within 0\.2 s \(reward_timeout\)"),
        (prepare(batch_flaky, "batch_flaky"), r"'batch_flaky' raised ZeroDivisionError.* at sample 1"),
        (
            prepare(graded_one, "graded_one"),
            r"'graded_one' raised TypeError.* at sample 0",
        ),  # no answer field
    ]
    for prepared, pattern in cases:
        start = time.perf_counter()
        with pytest.raises(RewardError, match=pattern):
            fields = ANSWERS if prepared.name != "graded_one" else {}
            compute_rewards([(prepared.name, prepared, 1.0)], PROMPTS, COMPLETIONS, fields)
        assert time.perf_counter() - start < 10  # a hung call is abandoned at its deadline


def test_an_async_reward_that_fails_stops_the_run_in_one_line_and_the_run_resumes(tmp_path, capsys):
    from gspo.cli import main
    from gspo.run.checkpoint import latest_checkpoint, load_trainer_state

    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        textwrap.dedent(
            """
            import asyncio
            from pathlib import Path

            CALLS = Path(__file__).with_name("calls")


            async def judged(completion, **_):
                await asyncio.sleep(0)
                return float(len(completion) % 2)


            async def flaky(prompts, completions, **_):
                calls = int(CALLS.read_text()) + 1 if CALLS.exists() else 1
                CALLS.write_text(str(calls))
                if calls == 3 and not Path(__file__).with_name("fixed").exists():
                    raise ConnectionError("the judge is down")
                return [0.0] * len(completions)
            """
        )
    )
    common = ["progress=false", "report_to=[]", "eval.every=0", "task.num_eval=0", "checkpoint.every=1"]
    common += ["train.steps=4", f"rewards={{{rewards}:judged: 1.0, {rewards}:flaky: 0.0}}"]
    code = main(["train", str(TINY), f"output_dir={tmp_path / 'run'}", *common])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 7 and len(err) == 1, err
    assert "'flaky' raised ConnectionError: the judge is down" in err[0] and "gspo train --resume" in err[0]
    assert load_trainer_state(latest_checkpoint(tmp_path / "run"))["step"] == 2
    (tmp_path / "fixed").write_text("")
    assert main(["train", "--resume", str(tmp_path / "run"), *common[:1]]) == 0
    assert load_trainer_state(latest_checkpoint(tmp_path / "run"))["step"] == 4
