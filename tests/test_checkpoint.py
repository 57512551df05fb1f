"""Checkpoints survive a SIGKILL at every phase of a save, and load nothing but tensors and plain data.

The kill test runs the tiny config in processes forked from one that imported gspo once (tests/forkrun.py),
each killing itself at one phase of one checkpoint save; every kill must leave a latest checkpoint equal,
bit for bit, to the uninterrupted run's at that step, and the resumed run must end equal to it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import reseal
from gspo.config import load_config, save_config
from gspo.models import tiny_model, tiny_tokenizer
from gspo.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_trainer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from gspo.run.metrics import read_metrics
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _same_checkpoint(a: Path, b: Path) -> bool:
    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    return _same(wa, wb) and _same(load_trainer_state(a), load_trainer_state(b))


def _lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in read_metrics(run_dir)]


def test_a_run_killed_at_every_phase_of_a_checkpoint_save_resumes_to_the_uninterrupted_run(
    tmp_path: Path, forkserver
) -> None:
    common = [
        str(TINY),
        "train.steps=3",
        "checkpoint.every=1",
        "checkpoint.keep=3",
        "eval.every=0",
        "report_to=[]",
        "task.num_eval=4",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert forkserver(tmp_path / "ref.log", argv=["train", *common, f"output_dir={ref}"]) == 0
    # Each kill continues the same run: a fresh start, then `--resume`s, and a last resume that finishes it.
    # Checkpoints are written in the background while the next batch is drawn (gspo.run.start.Run.save):
    # each kill lands in the writing thread, the run's own thread sampling beside it.
    kills = [
        ("step_000001", "before_rename", None),  # no checkpoint yet: --resume starts the run again
        ("step_000001", "after_rename", 1),  # no `latest` yet: the complete folder is found
        ("step_000002", "mid_write", 1),
        ("step_000002", "before_rename", 1),
        ("step_000002", "after_pointer", 2),
        ("step_000003", "after_rename", 2),  # `latest` still names step 2, a complete step 3 lies beside
        (
            "step_000003",
            "after_aside",
            2,
        ),  # so the resumed run re-saves step 3: a kill with the old copy aside
    ]
    for i, (name, phase, step) in enumerate(kills):
        argv = ["train", *common, f"output_dir={run}"] if i == 0 else ["train", "--resume", str(run)]
        log = tmp_path / f"kill{i}.log"
        code = forkserver(log, argv=argv, kill={"phase": phase, "name": name})
        assert code == -9, f"{phase} of {name} was not reached: {log.read_text()[-2000:]}"
        latest = latest_checkpoint(run)
        if step is None:
            assert latest is None
        else:
            assert load_trainer_state(latest)["step"] == step, (phase, name)
            assert _same_checkpoint(latest, ref / "checkpoints" / f"step_{step:06d}"), (phase, name)
    log = tmp_path / "resumed.log"
    assert forkserver(log, argv=["train", "--resume", str(run)]) == 0, log.read_text()[-2000:]
    for step in (1, 2, 3):
        name = f"step_{step:06d}"
        assert _same_checkpoint(run / "checkpoints" / name, ref / "checkpoints" / name), name
    assert _lines(run) == _lines(ref)  # no line lost or written twice
    assert len({(r["step"], r["kind"]) for r in _lines(run)}) == len(_lines(run))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        p.name for p in (ref / "checkpoints").iterdir()
    )  # no temporary or moved-aside folder left


RESAVE = """
from gspo.models import tiny_model, tiny_tokenizer
from gspo.run.checkpoint import save_checkpoint
tokenizer = tiny_tokenizer()
model = tiny_model("llama", len(tokenizer), seed=1)
save_checkpoint({run!r}, 1, model=model, tokenizer=tokenizer, state={{"copy": 2}}, keep=2)
"""


@pytest.mark.parametrize(
    "phase", ["mid_write", "before_rename", "after_aside", "after_rename", "after_pointer"]
)
def test_a_kill_while_re_saving_a_step_leaves_one_complete_copy(tmp_path: Path, forkserver, phase) -> None:
    tokenizer = tiny_tokenizer()
    run = tmp_path / "run"
    save_checkpoint(
        run, 0, model=tiny_model("llama", len(tokenizer), 0), tokenizer=tokenizer, state={"copy": 0}
    )
    save_checkpoint(
        run, 1, model=tiny_model("llama", len(tokenizer), 0), tokenizer=tokenizer, state={"copy": 1}
    )
    log = tmp_path / "resave.log"
    code = forkserver(log, code=RESAVE.format(run=str(run)), kill={"phase": phase, "name": "step_000001"})
    assert code == -9, log.read_text()[-2000:]
    latest = latest_checkpoint(run)
    state = load_trainer_state(latest)
    assert state["step"] == 1
    # the old copy until the new one is renamed into place, the new one from then on
    assert state["copy"] == (2 if phase in ("after_rename", "after_pointer") else 1)
    weights = load_file(latest / "model" / "model.safetensors")
    seed = 1 if state["copy"] == 2 else 0
    expected = tiny_model("llama", len(tokenizer), seed).state_dict()
    assert all(torch.equal(weights[k], expected[k]) for k in weights)


class Planted:
    """Unpickling this runs a shell command: what an attacker would put into trainer_state.pt."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _planted_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run folder made by someone else: a valid config and model, and a trainer_state.pt with a payload."""
    run = tmp_path / "theirs"
    tokenizer = tiny_tokenizer()
    config = load_config(TINY, [f"output_dir={run}", "report_to=[]"])
    model = tiny_model("llama", len(tokenizer), 0)
    save_checkpoint(run, 1, model=model, tokenizer=tokenizer, state={}, config=config)
    save_config(config, run / "config.yaml")
    marker = tmp_path / "pwned"
    checkpoint = latest_checkpoint(run)
    torch.save({"step": 1, "optimizer": Planted(marker)}, checkpoint / "trainer_state.pt")
    reseal(checkpoint)  # its author rewrites the manifest too
    return run, marker


def test_a_planted_pickle_in_a_checkpoint_is_refused_and_never_executed(tmp_path: Path) -> None:
    run, marker = _planted_run(tmp_path)
    with pytest.raises(CheckpointError, match="pickled object"):
        load_trainer_state(latest_checkpoint(run))
    with pytest.raises(CheckpointError, match="pickled object"):
        Trainer(load_config(run / "config.yaml"), resume=run)
    assert not marker.exists()


def test_latest_may_only_name_a_checkpoint_folder_of_the_run(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    elsewhere = tmp_path / "elsewhere"
    save_checkpoint(elsewhere, 3, model=tiny_model("llama", len(tokenizer), 0), tokenizer=tokenizer, state={})
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for planted in ("../../elsewhere/checkpoints/step_000003", "/etc", "step_000003/../../x"):
        (run / "checkpoints" / "latest").write_text(planted)
        with pytest.raises(CheckpointError, match="not a checkpoint name"):
            latest_checkpoint(run)


def test_a_checkpoint_without_its_model_files_is_not_complete(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    run = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(
            run, step, model=tiny_model("llama", len(tokenizer), 0), tokenizer=tokenizer, state={}, keep=2
        )
    (run / "checkpoints" / "step_000002" / "model" / "model.safetensors").unlink()
    assert latest_checkpoint(run) == run / "checkpoints" / "step_000001"  # the newest complete one
    (run / "checkpoints" / "step_000001" / "model" / "config.json").unlink()
    assert latest_checkpoint(run) is None


def test_rng_states_are_saved_as_plain_data_and_restored_exactly(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # numpy caches the second gaussian of a pair: its state says so
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(), torch.rand(1))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.standard_normal(), torch.rand(1)) == expected


def test_a_full_disk_during_a_checkpoint_says_so(tmp_path: Path, monkeypatch) -> None:
    import shutil

    import gspo.run.checkpoint as checkpoint

    def failing_save(model, tokenizer, directory) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 4096 vs 1024")

    monkeypatch.setattr(checkpoint, "save_model", failing_save)
    monkeypatch.setattr(
        checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0)
    )
    with pytest.raises(OSError) as raised:
        save_checkpoint(tmp_path / "run", 0, model=None, tokenizer=None, state={})
    assert raised.value.errno == errno.ENOSPC
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # the partial folder is gone


def _damage(file: Path) -> None:
    """4 KB overwritten in the middle of the file, its length kept: only a checksum can tell."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(255 - b for b in data[middle : middle + 4096])
    file.write_bytes(bytes(data))


def _gspo(capsys, *argv: str) -> tuple[int, str]:
    from gspo.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_the_manifest_lists_every_file_of_a_checkpoint_with_its_size_and_sha256(two_step_run: Path) -> None:
    checkpoint = two_step_run / "checkpoints" / "step_000002"
    listed = json.loads((checkpoint / "manifest.json").read_text())["files"]
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert {"model/model.safetensors", "trainer_state.pt", "config.yaml"} <= set(listed)
    assert listed == {
        p.relative_to(checkpoint).as_posix(): {
            "size": len(p.read_bytes()),
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in files
    }


def test_a_damaged_checkpoint_is_refused_by_resume_eval_and_export_and_an_earlier_one_resumes(
    two_step_run: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    weights = run / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    _damage(weights)
    for argv, hint in [
        (["train", "--resume", str(run)], "--from-step N"),
        (["eval", str(run)], "--step N"),
        (["export", str(run), "--format", "hf"], "--step N"),
    ]:
        code, err = _gspo(capsys, *argv)
        assert (code, err.count("\n")) == (5, 0), err
        assert err.startswith(f"error: {weights} is damaged: its sha256 differs"), err
        assert hint in err and "earlier complete steps: [1]" in err, err
    assert not (run / "export").exists() and not (run / "evals").exists()
    code, err = _gspo(capsys, "train", "--resume", str(run), "--from-step", "1")
    assert code == 0, err
    assert (run / "checkpoints" / "step_000002" / "model" / "model.safetensors").read_bytes() == (
        two_step_run / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    ).read_bytes()  # step 2 again, from step 1: the very same weights


REMOVED_AT = {
    # `latest` names step 2, then the folder goes: the run's next write (a metrics line, TensorBoard's)
    "after_latest": """
real = checkpoint.replace_file
def replace_file(path, data, **kwargs):
    real(path, data, **kwargs)
    if Path(path).name == "latest" and data == "step_000002":
        shutil.rmtree(run)
checkpoint.replace_file = replace_file
""",
    # the model is in .tmp_step_000002, the training state not yet: the background write fails
    "mid_write": """
real = checkpoint.save_model
def save_model(model, tokenizer, directory):
    real(model, tokenizer, directory)
    if Path(directory).parent.name == ".tmp_step_000002":
        shutil.rmtree(run)
checkpoint.save_model = save_model
""",
}


@pytest.mark.parametrize(("moment", "lag"), [("after_latest", 2), ("mid_write", 1)])
def test_a_run_folder_removed_mid_run_stops_it_with_the_disk_code_and_one_line(
    tmp_path: Path, forkserver, moment: str, lag: int
) -> None:
    """Both ended with exit 4 (a missing input file) and a raw errno line, and TensorBoard's writer thread
    printed a traceback of its own."""
    run = tmp_path / "run"
    argv = ["train", str(TINY), f"output_dir={run}", "progress=false", "report_to=[tensorboard]"]
    argv += [f"rollout.lag={lag}", "train.steps=4", "eval.every=0", "task.num_eval=4"]
    code = (
        "import shutil\nfrom pathlib import Path\nimport gspo.cli\nimport gspo.run.checkpoint as checkpoint\n"
    )
    code += f"run = Path({str(run)!r})\n{REMOVED_AT[moment]}raise SystemExit(gspo.cli.main({argv!r}))\n"
    log = tmp_path / f"{moment}.log"
    assert forkserver(log, code=code) == 6, log.read_text()[-3000:]
    assert not run.exists()  # removed, not made again by a later write
    assert log.read_text().splitlines() == [
        f"error: the run folder {run} was removed, moved or replaced while the run wrote into it: the run "
        "stopped. A folder moved elsewhere continues there with --resume; else start the run again, with an "
        "output_dir nothing else removes"
    ]


@pytest.mark.parametrize("index", ['"a string"', '{"weight_map": ["model.safetensors"]}', "{"])
def test_a_malformed_shard_index_is_refused_by_the_manifest_in_a_checkpoint_and_named_in_a_model_folder(
    two_step_run: Path, tmp_path: Path, capsys, index: str
) -> None:
    """A model.safetensors.index.json planted in a checkpoint, or in model.path's folder, ended `gspo train
    --resume`, `gspo eval` and `gspo export` in `AttributeError: 'str' object has no attribute 'is_file'`."""
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    planted = run / "checkpoints" / "step_000002" / "model" / "model.safetensors.index.json"
    planted.write_text(index)
    for argv in (["train", "--resume", str(run)], ["eval", str(run)], ["export", str(run), "--format", "hf"]):
        code, err = _gspo(capsys, *argv)
        assert (code, err.count("\n")) == (5, 0), err
        assert err.startswith(f"error: {planted} is damaged: it is not in manifest.json: something added it")
        assert "earlier complete steps: [1]" in err, err
    code, err = _gspo(capsys, "eval", str(planted.parent), str(TINY))  # a model folder of the user's: input
    assert (code, err.count("\n")) == (4, 0), err
    assert f"{planted}: not a safetensors index (its weight_map must map tensor names" in err, err
    assert not (run / "export").exists() and not (run / "evals").exists()


def test_an_incomplete_checkpoint_names_its_missing_file_and_one_without_a_manifest_loads_with_a_note(
    two_step_run: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    checkpoint = run / "checkpoints" / "step_000002"
    (checkpoint / "model" / "tokenizer.json").unlink()
    code, err = _gspo(capsys, "export", str(run), "--format", "hf")
    assert (code, err.count("\n")) == (5, 0), err
    assert f"{checkpoint / 'model' / 'tokenizer.json'} is damaged: it is missing" in err
    shutil.copy(
        two_step_run / "checkpoints" / "step_000002" / "model" / "tokenizer.json", checkpoint / "model"
    )
    (checkpoint / "manifest.json").unlink()  # as a gspo from before manifests wrote it
    code, err = _gspo(capsys, "export", str(run), "--format", "hf")
    assert code == 0, err
    assert f"note: {checkpoint} has no manifest.json" in err
