"""Resume refuses silent config changes (and applies forced ones for real), logs no line twice, and a new run
never takes over a folder that is not one of gspo's runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import gspo.config.loading
from gspo.config import ConfigError, load_config, save_config
from gspo.run.checkpoint import latest_checkpoint, load_trainer_state
from gspo.run.metrics import read_metrics
from gspo.run.resume import RunFolderError, resume_config
from gspo.training.launch import train
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
COMMON = ["report_to=[]", "train.steps=1", "task.num_eval=4", "eval.every=0"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A tiny run trained for one step (checkpoints at steps 0 and 1)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(load_config(TINY, [f"output_dir={run}", *COMMON]))
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_resume_refuses_changes_to_what_the_run_computes_naming_each_key(finished_run, tmp_path) -> None:
    run = _copy(finished_run, tmp_path)
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"train\.lr: 0\.01 -> 0\.5.*--force"):
        train(resume=run, overrides=["train.lr=0.5"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size: 4 -> 8; train\.objective: 'gspo' -> 'grpo'"):
        train(resume=run, overrides=["rollout.group_size=8", "train.objective=grpo"])
    assert (run / "config.yaml").read_text() == before  # a refused resume writes nothing
    (run / "config.yaml").write_text("")  # an emptied config would resume with every default
    with pytest.raises(ConfigError, match=r"config\.yaml is empty: resuming would take every key's default"):
        train(resume=run)
    with pytest.raises(ConfigError, match=r"model\.tiny: 'llama' -> None"):  # --force: still not the model
        train(resume=run, force=True)


def test_resume_takes_a_longer_run_and_new_cadences(finished_run, tmp_path) -> None:
    run = _copy(finished_run, tmp_path)
    train(resume=run, overrides=["train.steps=2", "eval.every=1", "checkpoint.keep=2", "progress=false"])
    assert load_trainer_state(latest_checkpoint(run))["step"] == 2
    assert load_config(run / "config.yaml").train.steps == 2
    assert load_config(latest_checkpoint(run) / "config.yaml").train.steps == 2  # stored with the checkpoint


def test_a_forced_resume_applies_the_change_to_the_optimizer_and_the_schedule(finished_run, tmp_path) -> None:
    run = _copy(finished_run, tmp_path)
    config = resume_config(run, ["train.lr=0.5", "train.weight_decay=0.1", "train.steps=3"])
    trainer = Trainer(config, resume=run, force=True)
    group = trainer.policy.optimizer.param_groups[0]
    assert group["lr"] == 0.5 and group["initial_lr"] == 0.5 and group["weight_decay"] == 0.1
    assert trainer.policy.scheduler.base_lrs == [0.5]
    assert trainer.policy.scheduler.get_last_lr() == [0.5]
    assert load_config(run / "config.yaml").train.lr == 0.5
    with pytest.raises(ConfigError, match=r"task\.num_train.*cannot change on resume, even with --force"):
        Trainer(resume_config(run, ["task.num_train=50"]), resume=run, force=True)


def test_a_run_resumed_at_step_0_logs_its_step_0_evaluation_once(tmp_path: Path) -> None:
    config = load_config(TINY, [f"output_dir={tmp_path / 'run'}", *COMMON])
    first = Trainer(config)
    first._log_eval()  # what run() does before any update; a kill after this checkpoint
    first.checkpoint()
    first.logger.close()
    Trainer(resume_config(first.run_dir), resume=first.run_dir).run()
    evals = [r["step"] for r in read_metrics(first.run_dir) if r["kind"] == "eval"]
    assert evals == [0, 1]


def test_a_folder_that_is_not_a_gspo_run_is_refused_and_left_untouched(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    files = {"config.yaml": "my: notes\n", "summary.md": "# my results\n", "metrics.jsonl": '{"step": 5}\n'}
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.raises(RunFolderError, match=r"is not empty and is not a gspo run"):
        Trainer(load_config(TINY, [f"output_dir={folder}", *COMMON]))
    with pytest.raises(RunFolderError, match="holds no gspo run to resume"):
        train(load_config(TINY, COMMON), resume=folder)
    assert {p.name: p.read_text() for p in folder.iterdir()} == files


def test_a_gspo_run_stopped_before_its_first_checkpoint_starts_again_cleanly(tmp_path: Path) -> None:
    config = load_config(TINY, [f"output_dir={tmp_path / 'run'}", *COMMON])
    stopped = Trainer(config)  # killed during its step-0 evaluation: a metrics line, no checkpoint
    stopped.logger.log(0, {"accuracy": 0.5}, kind="eval")
    stopped.logger.close()
    Trainer(config).run()
    evals = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1] and evals[0]["accuracy"] != 0.5


def test_config_yaml_is_replaced_atomically(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "config.yaml"
    save_config(load_config(TINY), path)
    before = path.read_text()

    def killed(*args) -> None:
        raise KeyboardInterrupt  # stopped between writing the new text and putting it in place

    monkeypatch.setattr(gspo.config.loading.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_config(load_config(TINY, ["train.lr=0.5"]), path)
    assert path.read_text() == before


def _break(checkpoint: Path, how: str) -> None:
    if how == "no trainer_state.pt":
        (checkpoint / "trainer_state.pt").unlink()
    else:  # a copy cut short by a full disk
        weights = checkpoint / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


@pytest.mark.parametrize("how", ["no trainer_state.pt", "model.safetensors cut in half"])
def test_resume_skips_an_incomplete_checkpoint_and_deletes_nothing(
    two_step_run, tmp_path, capsys, how
) -> None:
    """The incomplete step_2 (its trained weights) was deleted by the resumed run's
    re-save of step 2, and metrics.jsonl truncated to step 1's lines."""
    run = _copy(two_step_run, tmp_path)
    _break(run / "checkpoints" / "step_000002", how)
    weights = (run / "checkpoints" / "step_000002" / "model" / "model.safetensors").read_bytes()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    after = [line for line in lines if json.loads(line)["step"] > 1]
    assert after  # the run logged step 2 before "the copy" lost a file
    train(resume=run, overrides=["progress=false"])
    err = capsys.readouterr().err
    assert f"{run / 'checkpoints' / 'step_000002'} is incomplete (" in err and "resuming from" in err
    kept = run / "checkpoints" / "step_000002.incomplete"
    assert (kept / "model" / "model.safetensors").read_bytes() == weights  # moved aside, not deleted
    assert load_trainer_state(latest_checkpoint(run))["step"] == 2  # step 2 done again
    assert (run / "metrics.rolled_back.jsonl").read_text().splitlines() == after
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [
        json.loads(line)["step"] for line in lines
    ]


def test_a_run_with_only_incomplete_checkpoints_is_refused_not_restarted(two_step_run, tmp_path) -> None:
    run = _copy(two_step_run, tmp_path)
    for checkpoint in (run / "checkpoints").glob("step_*"):
        (checkpoint / "trainer_state.pt").unlink()
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with pytest.raises(
        RunFolderError, match=r"has no complete checkpoint, only incomplete ones \(step_000001"
    ):
        train(resume=run)
    with pytest.raises(RunFolderError, match=r"has no complete checkpoint, only incomplete ones"):
        train(load_config(TINY, [f"output_dir={run}", *COMMON]))
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # nothing removed


def test_resume_needs_the_checkpoints_own_config_or_force(two_step_run, tmp_path) -> None:
    """Without it, the resume took any change (objective, group size, lr) silently."""
    run = _copy(two_step_run, tmp_path)
    (latest_checkpoint(run) / "config.yaml").unlink()
    (
        latest_checkpoint(run) / "manifest.json"
    ).unlink()  # as an old gspo wrote it: a manifest lists the config
    for overrides in ([], ["train.lr=0.5", "train.objective=grpo"]):
        with pytest.raises(ConfigError, match=r"step_000002 has no config\.yaml of its own.*pass --force"):
            train(resume=run, overrides=["train.steps=3", *overrides])
    assert load_trainer_state(latest_checkpoint(run))["step"] == 2  # refused: nothing ran
    train(resume=run, overrides=["train.steps=3", "progress=false"], force=True)
    assert load_trainer_state(latest_checkpoint(run))["step"] == 3


def test_a_refused_resume_names_a_key_only_one_config_has_as_absent(
    two_step_run: Path, tmp_path: Path, capsys
) -> None:
    """A reward that only one of the two configs names was shown as `<object object at 0x...>`."""
    from gspo.cli import main

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    code = main(["serve", "--resume", str(run), "rewards={digit_fraction: 1.0}", "serve.port=0"])
    err = capsys.readouterr().err
    assert code == 3 and "object at 0x" not in err, err
    assert "rewards.correct_number: 1.0 -> (absent)" in err


def test_an_incomplete_checkpoint_moved_aside_is_said_to_lack_what_it_lacked(tmp_path: Path, capsys) -> None:
    """The note always said "(no trainer_state.pt)": it was asked after the folder had moved."""
    from gspo.models import tiny_model, tiny_tokenizer
    from gspo.run.checkpoint import save_checkpoint

    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", len(tokenizer), 0)
    incomplete = tmp_path / "run" / "checkpoints" / "step_000001"
    incomplete.mkdir(parents=True)
    (incomplete / "trainer_state.pt").write_bytes(b"state")  # its model folder is what it lacks
    save_checkpoint(tmp_path / "run", 1, model=model, tokenizer=tokenizer, state={})
    err = capsys.readouterr().err
    assert "was incomplete (no model/config.json or model/adapter_config.json): moved to" in err, err


def test_checkpoints_without_optimizer_state_are_smaller_by_adams_two_moments_and_resume_with_a_note(
    tmp_path: Path, capsys
) -> None:
    """checkpoint.optimizer=false leaves AdamW's two fp32 moments per weight out of a checkpoint (for
    SmolLM2, 1.08 GB of 1.6); the run still resumes, saying that AdamW starts afresh."""
    from gspo.models import tiny_model, tiny_tokenizer

    full, cheap = tmp_path / "full", tmp_path / "cheap"
    train(load_config(TINY, [f"output_dir={full}", *COMMON]))
    train(load_config(TINY, [f"output_dir={cheap}", *COMMON, "checkpoint.optimizer=false"]))

    def size(run: Path) -> int:
        return sum(f.stat().st_size for f in latest_checkpoint(run).rglob("*") if f.is_file())

    weights = sum(p.numel() for p in tiny_model("llama", len(tiny_tokenizer()), 0).parameters())
    assert "optimizer" in load_trainer_state(latest_checkpoint(full))
    assert "optimizer" not in load_trainer_state(latest_checkpoint(cheap))
    moments = 2 * 4 * weights  # exp_avg and exp_avg_sq in fp32; the rest: each tensor's pickled record
    assert moments <= size(full) - size(cheap) < 1.05 * moments
    capsys.readouterr()
    train(resume=cheap, overrides=["train.steps=2", "progress=false"])
    assert "holds no optimizer state (checkpoint.optimizer=false): AdamW's moments start from zero" in (
        capsys.readouterr().err
    )
    assert load_trainer_state(latest_checkpoint(cheap))["step"] == 2
