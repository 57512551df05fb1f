"""The command line answers a user's error with one line naming the problem and the fix, and an exit code of
its kind (gspo.cli.EXIT_CODES); `--debug` shows the traceback instead."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import gspo.training.trainer
from gspo.cli import EXIT_CODES, main
from gspo.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(["train", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return code, err.strip()


def test_config_errors_are_one_line_with_the_config_code(tmp_path: Path, capsys) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: [1e-5\n")
    code, err = _run(capsys, str(broken))
    assert code == EXIT_CODES["config"] and "broken.yaml: not valid YAML: line 3" in err
    code, err = _run(capsys, TINY, "train.lr=.nan")
    assert code == EXIT_CODES["config"] and err == "error: train.lr: expected a finite number, got nan"
    code, err = _run(capsys, TINY, f"output_dir={tmp_path / 'run'}", "rewards={exact_anwser: 1.0}")
    assert code == EXIT_CODES["config"] and "did you mean 'exact_answer'" in err


def test_a_model_that_is_not_a_model_is_one_line_with_the_input_code(tmp_path: Path, capsys) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("hello")
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(12))  # a header and nothing after it
    for path, message in (
        (tmp_path / "folder", "is not a Hugging Face model directory"),
        (tmp_path / "model.gguf", "cannot be read, it is truncated or corrupt"),
    ):
        code, err = _run(
            capsys, TINY, "model.tiny=null", f"model.path={path}", f"output_dir={tmp_path / 'run'}"
        )
        assert code == EXIT_CODES["input"] and message in err


def test_a_reward_too_large_for_float32_is_one_line_with_the_reward_code(tmp_path: Path, capsys) -> None:
    rewards = tmp_path / "huge.py"
    rewards.write_text("def reward(prompts, completions, **_):\n    return [1e39] * len(completions)\n")
    code, err = _run(
        capsys,
        TINY,
        f"output_dir={tmp_path / 'run'}",
        f"rewards={{{rewards}:reward: 1.0}}",
        "tensorboard=false",
        "task.num_eval=2",
    )
    assert code == EXIT_CODES["reward"] and "beyond float32's range" in err


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            errno.ENOSPC,
            "the disk is full (RUN/config.yaml): free some space, or set output_dir to a folder on another disk",
        ),
        (errno.EROFS, "the file system is read-only (RUN/config.yaml): set output_dir to a writable folder"),
        (errno.EACCES, "permission denied (RUN/config.yaml): set output_dir to a folder you can write to"),
    ],
)
def test_a_full_read_only_or_unwritable_disk_says_so(
    tmp_path: Path, capsys, monkeypatch, error, message
) -> None:
    def cannot_write(config, path) -> None:
        raise OSError(error, "failed", str(path))

    monkeypatch.setattr(gspo.training.trainer, "save_config", cannot_write)
    code, err = _run(capsys, TINY, f"output_dir={tmp_path / 'run'}")
    assert code == EXIT_CODES["disk"]
    assert err == "error: " + message.replace("RUN", str(tmp_path / "run"))


def test_an_output_dir_inside_a_file_says_so(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    code, err = _run(capsys, TINY, f"output_dir={tmp_path / 'file' / 'run'}")
    assert code == EXIT_CODES["disk"] and err == f"error: Not a directory: {tmp_path / 'file' / 'run'}"


def test_a_folder_of_someone_else_is_refused_with_the_run_folder_code(tmp_path: Path, capsys) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "summary.md").write_text("my notes")
    code, err = _run(capsys, TINY, f"output_dir={tmp_path / 'mine'}")
    assert code == EXIT_CODES["run folder"] and "is not empty and is not a gspo run" in err
    code, err = _run(capsys, "--resume", str(tmp_path / "mine"))
    assert code == EXIT_CODES["run folder"] and "holds no gspo run to resume" in err


def test_debug_shows_the_traceback(capsys) -> None:
    with pytest.raises(ConfigError, match="finite"):
        main(["train", TINY, "train.lr=.nan", "--debug"])
    with pytest.raises(ConfigError, match="finite"):
        main(["--debug", "train", TINY, "train.lr=.nan"])


def test_the_exit_codes_are_distinct() -> None:
    assert len(set(EXIT_CODES.values())) == len(EXIT_CODES)
