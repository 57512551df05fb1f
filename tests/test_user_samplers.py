"""Samplers of your own: a factory named by ``rollout.engine: "file.py:function"`` (as objectives and
rewards are) runs a tiny train; a broken one gives one line that names its file; a run folder's runs only
when named (docs/rollout_servers.md, "Your own sampler")."""

from __future__ import annotations

import functools
import math
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import tiny_config
from gspo.cli import EXIT_CODES, main
from gspo.models import tiny_tokenizer
from gspo.rollout.samplers import CheckedSampler, Rollouts, check_rollouts
from gspo.run.metrics import read_metrics
from gspo.run.trust import UntrustedRunFolder, check_run_folder_config
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_loss"
GSPO_BY_HAND = f"{EXAMPLE / 'gspo_loss.py'}:gspo_by_hand"

SAMPLERS = textwrap.dedent(
    '''
    from gspo.sampling.factories import hf_sampler

    calls = []


    def counted(config, policy, tokenizer, run_dir):
        """The trainer's own sampler, counting its rollout batches."""
        sampler = hf_sampler(config, policy, tokenizer, run_dir)
        generate = sampler.generate

        def counting(*args, **kwargs):
            calls.append(len(args[0]))
            return generate(*args, **kwargs)

        sampler.generate = counting
        return sampler


    def raises(config, policy, tokenizer, run_dir):
        return {}["no sampler"]


    def broken(config, policy, tokenizer, run_dir):
        """The trainer's own sampler, its rollouts broken as GSPO_TEST_BREAK says."""
        import math
        import os

        sampler = hf_sampler(config, policy, tokenizer, run_dir)
        generate, how = sampler.generate, os.environ["GSPO_TEST_BREAK"]

        def broken_generate(*args, **kwargs):
            if how == "raises":
                raise KeyError("no rollouts")
            rollouts = generate(*args, **kwargs)
            if how in ("none", "dict"):
                return None if how == "none" else {"completion_ids": rollouts.completion_ids}
            if how in ("out_of_vocabulary", "negative"):
                rollouts.completion_ids[0][0] = 10**6 if how == "out_of_vocabulary" else -1
            if how == "one_row_too_few":
                for field in ("prompt_ids", "completion_ids", "sampler_logprobs", "truncated", "completions"):
                    del getattr(rollouts, field)[-1]
            if how == "misaligned":
                rollouts.sampler_logprobs[0] = rollouts.sampler_logprobs[0][:-1]
            if how in ("nan", "plus_5"):
                rollouts.sampler_logprobs[0][0] = math.nan if how == "nan" else 5.0
            if how == "empty":  # every sample stopped at once, listing no token (its EOS included)
                n = len(rollouts)
                rollouts.completion_ids, rollouts.sampler_logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
                rollouts.truncated, rollouts.completions = [False] * n, [""] * n
            return rollouts

        sampler.generate = broken_generate
        return sampler


    def not_a_sampler(config, policy, tokenizer, run_dir):
        return 42
    '''
)


@pytest.fixture
def sampler_file(tmp_path: Path) -> Path:
    path = tmp_path / "samplers.py"
    path.write_text(SAMPLERS)
    return path


def test_a_sampler_named_by_file_runs_a_tiny_train(sampler_file, tmp_path):
    config = tiny_config(tmp_path / "run", f"rollout.engine={sampler_file}:counted", "train.steps=2")
    trainer = Trainer(config)
    module = __import__("sys").modules[trainer.sampler.sampler.generate.__module__]  # under its check
    result = trainer.run()
    assert module.calls == [config.rollout.prompts_per_step] * 2  # it sampled both rollout batches
    assert result["eval_accuracy_last"] is not None
    assert trainer.spec.old_logprobs == "sampler"  # it says it is current: the trainer's own weights


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (
            "raises",
            r"rollout\.engine: the sampler factory '.*samplers\.py:raises' raised KeyError: 'no sampler' in ",
        ),
        ("not_a_sampler", r"rollout\.engine: '.*samplers\.py:not_a_sampler' returned a int without generate"),
        ("missing", r"rollout\.engine: sampler '.*samplers\.py:missing': .* has no 'missing'"),
    ],
)
def test_a_broken_sampler_is_one_line_naming_its_file(sampler_file, tmp_path, capsys, function, message):
    code = main(
        [
            "train",
            str(ROOT / "configs" / "tiny.yaml"),
            f"output_dir={tmp_path / 'run'}",
            "progress=false",
            "report_to=[]",
            f"rollout.engine={sampler_file}:{function}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (3, 4) and len(err) == 1, err
    assert str(sampler_file) in err[0]
    assert __import__("re").search(message, err[0]), err[0]


def _train(tmp_path: Path, engine: str, *overrides: str) -> int:
    return main(
        [
            "train",
            str(ROOT / "configs" / "tiny.yaml"),
            f"output_dir={tmp_path / 'run'}",
            "progress=false",
            "report_to=[]",
            "eval.every=0",
            f"rollout.engine={engine}",
            *overrides,
        ]
    )


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (
            "raises",
            r"the sampler '.*samplers\.py:broken' raised KeyError: 'no rollouts' in .*samplers\.py:\d+",
        ),
        ("none", r"returned a NoneType, not gspo\.rollout\.samplers\.Rollouts"),
        ("dict", r"returned a dict, not gspo\.rollout\.samplers\.Rollouts"),
        ("out_of_vocabulary", r"completion_ids\[0\]\[0\] = 1000000, outside the trainer's vocabulary of 99"),
        ("negative", r"completion_ids\[0\]\[0\] = -1, outside the trainer's vocabulary of 99"),
        ("one_row_too_few", r"prompt_ids has 15 rows for 16 samples \(one row per sample\)"),
        ("misaligned", r"sampler_logprobs\[0\] has 1 values for the 2 tokens of its completion_ids row"),
        ("nan", r"sampler_logprobs\[0\]\[0\] = nan, which no probability has"),
        ("plus_5", r"sampler_logprobs\[0\]\[0\] = 5\.0, which no probability has"),
    ],
)
def test_a_samplers_output_is_checked_as_a_servers_one_line_exit_8(
    sampler_file, tmp_path, capsys, monkeypatch, how, message
):
    """Each was a traceback and exit 1 (a bug of gspo's), or, for NaN and +5, trained on silently."""
    monkeypatch.setenv("GSPO_TEST_BREAK", how)
    code = _train(tmp_path, f"{sampler_file}:broken", "train.steps=1")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_CODES["server"] and len(err) == 1, err
    assert err[0].startswith("error: rollout.engine: the sampler ") and str(sampler_file) in err[0], err[0]
    assert re.search(message, err[0]), err[0]


def test_empty_completions_are_taken_as_the_built_in_engines_take_them(sampler_file, tmp_path, monkeypatch):
    """A completion that stopped at once without listing a token: its EOS, with an unknown log-prob that the
    trainer computes (gspo.rollout.openai does so for a server that does not list the EOS). It was trained
    on as an empty sequence."""
    monkeypatch.setenv("GSPO_TEST_BREAK", "empty")
    assert _train(tmp_path, f"{sampler_file}:broken", "train.steps=1") == 0
    train_lines = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["completion_len_mean"] for r in train_lines] == [1.0]  # the EOS alone, each
    tokenizer = tiny_tokenizer()
    sampler = CheckedSampler(
        SimpleNamespace(generate=lambda *a, **k: Rollouts([[5]], [[]], [[]], [False], [""])), "x", tokenizer
    )
    rollouts = sampler.generate(["p"], group_size=1, max_new_tokens=2)
    assert rollouts.completion_ids == [[tokenizer.eos_token_id]] and math.isnan(
        rollouts.sampler_logprobs[0][0]
    )


def test_check_rollouts_takes_what_a_server_may_report_and_refuses_what_no_model_gives():
    """None (a server's null) and NaN on a final EOS are unknown log-probs; a rounding above 0 is 0."""
    check = functools.partial(check_rollouts, samples=2, max_new_tokens=3, vocabulary=10, eos=2)
    rollouts = Rollouts(
        [[1], [1]], [[4, 2], [5, 6, 7]], [[-0.5, math.nan], [None, 0.0005, -1]], [False, True], ["a", "b"]
    )
    checked = check(rollouts)
    assert checked.completion_ids == [[4, 2], [5, 6, 7]] and checked.truncated == [False, True]
    assert checked.sampler_logprobs[0][0] == -0.5 and math.isnan(checked.sampler_logprobs[0][1])
    assert math.isnan(checked.sampler_logprobs[1][0]) and checked.sampler_logprobs[1][1:] == [0.0, -1.0]
    for row, why in (
        ([[math.nan, -1.0], [-1.0] * 3], r"sampler_logprobs\[0\]\[0\] = nan"),  # not on the final EOS
        ([[-1.0, -1.0], [-1.0, -1.0, True]], r"sampler_logprobs\[1\]\[2\] = True, which is a bool"),
    ):
        with pytest.raises(ValueError, match=why):
            check(Rollouts([[1], [1]], [[4, 2], [5, 6, 7]], row, [False, True], ["a", "b"]))
    with pytest.raises(ValueError, match=r"completion_ids\[1\] has 4 tokens, more than max_new_tokens=3"):
        check(Rollouts([[1], [1]], [[4], [5, 6, 7, 8]], [[-1.0], [-1.0] * 4], [False, True], ["a", "b"]))
    with pytest.raises(ValueError, match=r"completion_ids\[0\] is empty, and truncated\[0\] says"):
        check(Rollouts([[1], [1]], [[], [5]], [[], [-1.0]], [True, True], ["", "b"]))
    with pytest.raises(ValueError, match=r"truncated\[1\] is 1, not a bool"):
        check(Rollouts([[1], [1]], [[4], [5]], [[-1.0], [-1.0]], [False, 1], ["a", "b"]))


def test_a_run_folder_s_sampler_code_runs_only_when_named(sampler_file, tmp_path):
    config = tiny_config(tmp_path / "run", f"rollout.engine={sampler_file}:counted")
    with pytest.raises(UntrustedRunFolder, match=r"names the sampler factory .*samplers.py:counted"):
        check_run_folder_config(config, [], folder=tmp_path / "run")
    check_run_folder_config(config, [f"rollout.engine={sampler_file}:counted"], folder=tmp_path / "run")


def test_an_unknown_engine_says_what_is_there(tmp_path):
    from gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.engine: 'vlm' is not one of .*; did you mean 'vllm'"):
        tiny_config(tmp_path, "rollout.engine=vlm")


def test_every_built_in_engine_names_a_factory_that_is_there():
    """The registry is the one list of engines: each entry's factory resolves to a callable of the sampling
    side's factories module (a renamed factory fails here, not in a user's first run)."""
    import importlib

    from gspo.config.engines import ENGINES

    for name, engine in ENGINES.items():
        module, _, function = engine.factory.partition(":")
        assert module == "gspo.sampling.factories", name
        assert callable(getattr(importlib.import_module(module), function)), name
