"""Samplers of your own: a factory named by ``rollout.engine: "file.py:function"`` (as objectives and
rewards are) runs a tiny train; a broken one gives one line that names its file; a run folder's runs only
when named (docs/rollout_servers.md, "Your own sampler")."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import tiny_config
from gspo.cli import main
from gspo.run.trust import UntrustedRunFolder, check_run_folder_config
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_loss"
GSPO_BY_HAND = f"{EXAMPLE / 'gspo_loss.py'}:gspo_by_hand"

SAMPLERS = textwrap.dedent(
    '''
    from gspo.training.samplers import hf_sampler

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
    module = __import__("sys").modules[trainer.sampler.generate.__module__]
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


def test_a_run_folder_s_sampler_code_runs_only_when_named(sampler_file, tmp_path):
    config = tiny_config(tmp_path / "run", f"rollout.engine={sampler_file}:counted")
    with pytest.raises(UntrustedRunFolder, match=r"names the sampler factory .*samplers.py:counted"):
        check_run_folder_config(config, [], folder=tmp_path / "run")
    check_run_folder_config(config, [f"rollout.engine={sampler_file}:counted"], folder=tmp_path / "run")


def test_an_unknown_engine_says_what_is_there(tmp_path):
    from gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.engine: 'vlm' is not one of .*; did you mean 'vllm'"):
        tiny_config(tmp_path, "rollout.engine=vlm")


def test_every_built_in_engine_has_a_factory():
    from gspo.config.schema import ENGINES
    from gspo.training.samplers import SAMPLERS

    assert tuple(SAMPLERS) == ENGINES
