"""The command line answers a user's error with one line naming the problem and the fix, and an exit code of
its kind (gspo.cli.EXIT_CODES); `--debug` shows the traceback instead."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import gspo.run.start
import gspo.training.trainer
from gspo.cli import EXIT_CODES, main, next_steps
from gspo.config import Config, ConfigError, load_config
from gspo.training.progress import Progress, skip_notice

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
        "report_to=[]",
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

    monkeypatch.setattr(gspo.run.start, "save_config", cannot_write)
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
    # a path that names nothing: it said "no checkpoint in RUN/checkpoints", as if the run were there
    code, err = _run(capsys, "--resume", str(tmp_path / "nowhere"))
    assert code == EXIT_CODES["run folder"] and err.startswith(
        f"error: {tmp_path / 'nowhere'} does not exist"
    )
    assert "checkpoint" not in err and not (tmp_path / "nowhere").exists()


def test_debug_shows_the_traceback(capsys) -> None:
    with pytest.raises(ConfigError, match="finite"):
        main(["train", TINY, "train.lr=.nan", "--debug"])
    with pytest.raises(ConfigError, match="finite"):
        main(["--debug", "train", TINY, "train.lr=.nan"])


def test_the_exit_codes_are_distinct() -> None:
    assert len(set(EXIT_CODES.values())) == len(EXIT_CODES)


def _quiet_command(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -W error::FutureWarning -m gspo ...` in a subprocess (stderr is a pipe: no progress bar)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):  # the defaults a new user has
        env.pop(name, None)
    command = [sys.executable, "-W", "error::FutureWarning", "-m", "gspo", *argv]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_commands_print_no_third_party_warning_or_bar(tmp_path: Path) -> None:
    """A LoRA run of the tiny config, its HF export and `gspo config`: nothing on stderr (peft's and
    transformers' warnings and loading bars filtered, gspo's bar off without a terminal)."""
    config = _quiet_command("config", cwd=tmp_path)
    assert config.returncode == 0 and config.stderr == "", config.stderr
    trained = _quiet_command(
        "train", TINY, "output_dir=run", "lora.rank=4", "train.steps=2", "progress=false", cwd=tmp_path
    )
    assert trained.returncode == 0 and trained.stderr == "", trained.stderr
    assert "held-out accuracy" in trained.stdout
    exported = _quiet_command("export", "run", "--format", "hf", cwd=tmp_path)
    assert exported.returncode == 0 and exported.stderr == "", exported.stderr


@pytest.mark.progress_lines
def test_progress_shows_on_a_terminal_only(monkeypatch) -> None:
    class Stderr:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    trainer = SimpleNamespace(config=SimpleNamespace(progress=True))
    for tty, progress, bar, lines in [
        (True, True, True, False),
        (False, True, False, True),
        (True, False, False, False),
        (False, False, False, False),
    ]:
        monkeypatch.setattr(sys, "stderr", Stderr(tty))
        trainer.config.progress = progress
        assert Progress.shows_bar(trainer) is bar
        assert Progress.prints_lines(trainer) is lines


@pytest.mark.progress_lines
def test_a_run_without_a_terminal_prints_a_line_per_rollout_batch(tmp_path: Path, capsys) -> None:
    """Piped, under nohup or in an IDE: no bar, but a line per rollout batch and per evaluation."""
    common = [str(TINY), "train.steps=3", "eval.every=2", "report_to=[]", "checkpoint.every=0"]
    assert main(["train", *common, f"output_dir={tmp_path / 'lines'}"]) == 0
    err = capsys.readouterr().err.splitlines()
    batches = [line for line in err if re.match(r"step \d/3: reward [\d.]+, clip [\d.]+, gen [\d.]+s", line)]
    assert [line.split(":")[0] for line in batches] == ["step 1/3", "step 2/3", "step 3/3"], err
    evals = [line.split(":")[0] for line in err if "eval accuracy" in line]
    assert evals == ["step 0", "step 2", "step 3"], err
    assert main(["train", *common, f"output_dir={tmp_path / 'quiet'}", "progress=false"]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]


def test_a_runs_first_line_says_in_words_what_skipping_does() -> None:
    """It read `train.skip_zero_advantage: ... (exact: the loss has no KL term)`: jargon as a run's first line."""
    config = load_config(None)
    skipping, computing = (
        SimpleNamespace(skip_zero_advantage=True),
        SimpleNamespace(skip_zero_advantage=False),
    )
    lead = "gspo: completions that scored the same as the rest of their group teach nothing; they are "
    assert skip_notice(config, skipping) == (
        f"{lead}skipped in the updates, which changes no weight and saves their time (train.skip_zero_advantage)"
    )
    config.train.beta = 0.1
    assert skip_notice(config, computing) == (
        f"{lead}trained anyway: a term of the loss (train.beta, train.entropy_coef) depends on every one (train.skip_zero_advantage)"
    )


# ---- file format errors are one line with the file and the position; each command's
# user errors exit with their kind's code (docs/reliability.md's table) ----------------------------------------
def _gspo(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return code, err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_truncated_model_safetensors_is_one_line_naming_the_file_and_the_byte(
    two_step_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    weights = run / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:5000])
    monkeypatch.chdir(tmp_path)
    where = f"{weights}: truncated at byte 5,000 of the {size:,} its header lists"
    for argv in (
        ["eval", str(run), "--step", "2"],
        ["export", str(run), "--format", "hf", "--step", "2"],
    ):
        code, err = _gspo(capsys, *argv)
        assert code == EXIT_CODES["run folder"] and where in _one_line(err), err
    code, err = _gspo(capsys, "eval", str(weights.parent), str(TINY))  # a model folder: input
    assert code == EXIT_CODES["input"] and where in _one_line(err), err
    code, err = _gspo(capsys, "export", str(run))  # the latest complete one, with a note; hf by default
    assert code == 0 and f"note: skipping the incomplete checkpoint {weights.parent.parent}" in err
    assert (run / "export" / "step_000001-hf" / "model.safetensors").is_file()


def test_the_llama_cpp_engine_without_its_package_names_the_install(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec: not installed
    code, err = _gspo(capsys, "train", TINY, f"output_dir={tmp_path / 'run'}", "rollout.engine=llama_cpp")
    assert code == EXIT_CODES["package"]
    assert "rollout.engine=llama_cpp needs llama-cpp-python" in _one_line(err)
    assert not (tmp_path / "run" / "llama_cpp").exists()  # found before the policy was exported


@pytest.mark.parametrize(
    ("source", "kind", "message"),
    [
        (
            "import sys\ndef reward(prompts, completions, **_):\n    sys.exit(3)\n",
            "reward",
            "reward function 'reward' called sys.exit(3) (a reward returns its values; it does not end "
            "the process) at sample 0",
        ),
        ("import sys\nsys.exit(3)\n", "input", "{file} (line 2): importing it called sys.exit(3)"),
        ("x = 1 +\n", "input", "{file} (line 1): importing it raised SyntaxError"),
    ],
)
def test_a_reward_that_calls_sys_exit_is_its_error_not_gspos_exit(
    tmp_path: Path, capsys, source: str, kind: str, message: str
) -> None:
    """It used to end gspo with the reward's exit code (0 for sys.exit()), without a word."""
    file = tmp_path / "exits.py"
    file.write_text(source)
    code, err = _gspo(
        capsys,
        "train",
        TINY,
        f"output_dir={tmp_path / 'run'}",
        f"rewards={{{file}:reward: 1.0}}",
        "task.num_eval=2",
    )
    assert code == EXIT_CODES[kind], err
    assert message.format(file=file) in _one_line(err)


FLAKY = """\
calls = 0


def flaky(prompts, completions, **_):
    global calls
    calls += 1
    if calls >= {fail_at}:
        return [len(c) / 0.0 for c in completions]
    return [float(len(c) % 2) for c in completions]
"""


@pytest.mark.parametrize(
    ("fail_at", "cadence", "kept"),
    [
        (3, ["checkpoint.every=1", "eval.every=0"], 1),  # calls: eval 0, step 1, step 2 (raises)
        (4, ["checkpoint.every=0", "eval.every=2"], 2),  # eval 0, steps 1 and 2, eval 2 (raises)
    ],
)
def test_a_failing_reward_shows_its_line_and_keeps_the_run(
    tmp_path: Path, capsys, monkeypatch, fail_at: int, cadence: list[str], kept: int
) -> None:
    """The error names the user's file and line, what the run kept, and the command that continues it; a
    failure in an evaluation keeps the update before it."""
    file = tmp_path / "flaky.py"
    file.write_text(FLAKY.format(fail_at=fail_at))
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    reward = f"rewards={{{file}:flaky: 1.0}}"
    code, err = _run(capsys, TINY, f"output_dir={run}", reward, "train.steps=4", "task.num_eval=2", *cadence)
    assert code == EXIT_CODES["reward"], err
    checkpoint = run / "checkpoints" / f"step_{kept:06d}"
    command = f"gspo train --resume {run} 'rewards={{{file}:flaky: 1}}'"
    assert err.endswith(
        f"in {file}:8 `return [len(c) / 0.0 for c in completions]`; the run is kept up to step {kept} "
        f"({checkpoint}): fix the reward function, then `{command}`"
    )
    file.write_text(FLAKY.format(fail_at=10**6))
    assert main(shlex.split(command)[1:]) == 0
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1] == "step_000004"


def test_every_commands_user_errors_have_their_kinds_exit_code(
    two_step_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """eval and export exited 1 (a bug's code) for user errors; data errors exited 3 (config's)."""
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("prompt,answer\nWhat is 1 + 1?,2,3\n")
    existing = tmp_path / "model.gguf"
    existing.write_text("not mine")
    inside = two_step_run / "checkpoints" / "step_000001" / "model"
    cases = [
        (["export", str(empty), "--format", "hf"], "run folder", "no complete checkpoint"),
        (
            ["export", str(two_step_run), "--format", "gguf", "--output", str(existing)],
            "run folder",
            "exists",
        ),
        (
            ["export", str(two_step_run), "--format", "hf", "--output", str(inside), "--force"],
            "run folder",
            "inside the checkpoint",
        ),
        (
            ["eval", str(two_step_run), "--output", str(inside / "r.json"), "--force"],
            "run folder",
            "inside the checkpoint",
        ),
        (["plot", str(empty)], "run folder", "holds no metrics.jsonl"),
        (
            ["train", TINY, f"output_dir={tmp_path / 'r'}", "task.name=file", f"task.data_path={ragged}"],
            "input",
            "ragged.csv: line 2 (row 1) has 3 cells",
        ),
        (
            ["train", TINY, f"output_dir={tmp_path / 'r'}", f"rewards={{{tmp_path / 'none.py'}:f: 1}}"],
            "input",
            "reward file not found",
        ),
    ]
    for argv, kind, message in cases:
        code, err = _gspo(capsys, *argv)
        assert code == EXIT_CODES[kind] and message in _one_line(err), (argv, err)
    assert existing.read_text() == "not mine"
    bad = tmp_path / "bad_metrics"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1}\n[[\n{"step": 2}\n')
    code, err = _gspo(capsys, "plot", str(bad))
    assert code == EXIT_CODES["run folder"] and "metrics.jsonl: line 2 is not a metrics line" in _one_line(
        err
    )
    code, err = _gspo(capsys, "train", "--trust-run-folder")
    assert code == EXIT_CODES["usage"] and "--trust-run-folder goes with --resume RUN_DIR" in _one_line(err)
    for argv in (
        ["eval", str(two_step_run), "--temperature", "0"],
        ["eval", str(two_step_run), "--temperature", "nan"],
        ["eval", str(two_step_run), "--samples", "0"],
        ["export", str(two_step_run), "--format", "gguf", "--quant", "q3_k"],
    ):
        with pytest.raises(SystemExit) as exit:  # argparse's own usage errors
            main(argv)
        assert exit.value.code == EXIT_CODES["usage"], argv
    capsys.readouterr()


def test_the_command_table_in_docs_is_the_codes() -> None:
    from gspo.cli import COMMAND_ERRORS

    text = (ROOT / "docs" / "reliability.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| command |"))
    codes = [int(c) for c in header.strip("|").split("|")[1:]]
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `gspo ") and "(coming" not in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`").removeprefix("gspo ")] = {
                c for c, mark in zip(codes, cells[1:], strict=True) if mark
            }
    assert rows == {cmd: {EXIT_CODES[kind] for kind in kinds} for cmd, kinds in COMMAND_ERRORS.items()}


def test_eval_of_a_model_writes_no_report_unless_asked(
    two_step_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`gspo eval MODEL CONFIG` wrote ./eval_report.json into the working directory unasked."""
    monkeypatch.chdir(tmp_path)
    model = two_step_run / "checkpoints" / "step_000002" / "model"
    assert main(["eval", str(model), TINY, "task.num_eval=2"]) == 0
    out = capsys.readouterr().out
    assert "(2 problems, held-out split" in out and "report: not written (--output FILE" in out
    assert list(tmp_path.iterdir()) == []
    assert main(["eval", str(model), TINY, "task.num_eval=2", "--output", "mine.json"]) == 0
    assert json.loads((tmp_path / "mine.json").read_text())["problems"] == 2
    assert list(tmp_path.iterdir()) == [tmp_path / "mine.json"]


def test_ctrl_c_says_what_the_run_kept_and_how_to_continue(tmp_path: Path, capsys, monkeypatch) -> None:
    """It printed `error: interrupted` and nothing about the run folder or --resume."""
    real = gspo.training.trainer.Trainer.train_step

    def interrupted_at_step_3(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(gspo.training.trainer.Trainer, "train_step", interrupted_at_step_3)
    run = tmp_path / "run"
    code, err = _run(capsys, TINY, f"output_dir={run}", "train.steps=4", "task.num_eval=2")
    assert code == EXIT_CODES["interrupted"]
    assert err == (
        f"error: interrupted; the run is kept up to step 2 ({run / 'checkpoints' / 'step_000002'}): "
        f"continue it with `gspo train --resume {run}`"
    )
    monkeypatch.setattr(gspo.training.trainer.Trainer, "train_step", real)
    assert main(shlex.split(err.rpartition("`gspo ")[2].rstrip("`"))) == 0
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1] == "step_000004"


@pytest.mark.parametrize("lag", [0, 2])
def test_a_reward_that_raises_keyboard_interrupt_keeps_the_steps_trained_at_every_lag(
    tmp_path: Path, capsys, monkeypatch, lag: int
) -> None:
    """At lag 2 it exited 130 saying the run "holds no checkpoint yet" although step 1 had trained, then
    with a bare "error: interrupted": the checkpoint of the stop met the batch ahead whose scoring had
    raised it. The reward's third call (with the start's evaluation: a training batch, scored at lag 2 in
    the scoring stage's thread, ahead of the updates) stops the run; the steps before it are kept, and the
    run continues from them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stops.py").write_text(
        "from pathlib import Path\n"
        "calls = 0\n"
        "def third(prompts, completions, **_):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 3 and not Path('stopped').exists():  # once: the resumed run goes on\n"
        "        Path('stopped').touch()\n"
        "        raise KeyboardInterrupt\n"
        "    return [float(len(c) % 2) for c in completions]\n"
    )
    run = tmp_path / "run"
    argv = (TINY, f"output_dir={run}", "train.steps=4", "eval.every=0", f"rollout.lag={lag}")
    code, err = _run(capsys, *argv, "rewards={stops.py:third: 1.0}")
    assert code == EXIT_CODES["interrupted"]
    kept = re.fullmatch(
        rf"error: interrupted; the run is kept up to step (\d) \({re.escape(str(run))}/checkpoints/"
        rf"step_00000(\d)\): continue it with `gspo train --resume {re.escape(str(run))}`",
        err,
    )
    assert kept is not None and kept[1] == kept[2] and int(kept[1]) >= 1, err
    assert main(["train", "--resume", str(run)]) == 0  # its later calls pass
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1] == "step_000004"


def test_a_missing_data_file_says_what_its_path_is_relative_to(tmp_path: Path, capsys, monkeypatch) -> None:
    """A task.data_path in a config file is read relative to the file's folder, one on the command line
    relative to the working directory: the error says so, with the path it tried."""
    (tmp_path / "task").mkdir()
    config = tmp_path / "task" / "config.yaml"
    config.write_text("model:\n  tiny: llama\ntask:\n  name: file\n  data_path: missing.jsonl\n")
    monkeypatch.chdir(tmp_path)
    why = "(a path in a config file is read relative to that file's folder, one on the command line relative"
    for argv, tried in (
        ([str(config)], tmp_path / "task" / "missing.jsonl"),
        ([str(config), "task.data_path=missing.jsonl"], tmp_path / "missing.jsonl"),
    ):
        code, err = _run(capsys, *argv, f"output_dir={tmp_path / 'run'}")
        assert code == EXIT_CODES["input"], err
        assert f"error: task.data_path: data file not found: {tried} {why}" in err


def test_gspo_config_shows_one_section(capsys) -> None:
    """`gspo config` printed all ~300 lines; `gspo config SECTION` prints one section, as YAML that loads
    to its defaults."""
    for section, value in (("train", Config().train), ("rollout.openai", Config().rollout.openai)):
        assert main(["config", section]) == 0
        out = capsys.readouterr().out
        expected = dataclasses.asdict(value)
        for name in reversed(section.split(".")):
            expected = {name: expected}
        assert yaml.safe_load(out) == expected
    for section, message in (
        ("trian", "error: no config section 'trian'; did you mean 'train'? sections here: model, lora,"),
        ("train.lr", "error: train.lr is a key, not a section: `gspo config train` shows it"),
    ):
        assert main(["config", section]) == EXIT_CODES["usage"]
        assert capsys.readouterr().err.startswith(message)


def test_no_held_out_problems_trains_without_evaluations(tmp_path: Path, capsys) -> None:
    """task.num_eval=0 failed inside the first reward (called on a batch of 0 samples, without fields)."""
    run = tmp_path / "run"
    assert (
        main(["train", TINY, f"output_dir={run}", "task.num_eval=0", "train.steps=2", "tensorboard=false"])
        == 0
    )
    captured = capsys.readouterr()
    assert "held-out accuracy" not in captured.out and f"run folder: {run}" in captured.out
    # the end of a run says what to do next, with this run's commands
    assert captured.out.endswith(next_steps(str(run)) + "\n")
    for step in (f"{run}/summary.md", f"{run}/plots/", f"gspo eval {run} --samples 8", f"gspo export {run}"):
        assert step in captured.out, step
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 1), ("train", 2)]
    assert (run / "summary.md").is_file()
    code, err = _gspo(capsys, "eval", str(run))
    assert code == EXIT_CODES["config"]
    assert (
        err
        == "error: task.num_eval=0: the task holds no problem out to evaluate; pass task.num_eval=N or --data FILE"
    )


def test_a_reward_file_on_the_command_line_is_named_as_written(tmp_path: Path, capsys, monkeypatch) -> None:
    """`rewards={file.py:f: 1.0}` is read from the working directory, as any command-line path; its error
    printed the key made absolute (`rewards./tmp/.../file.py:f`), which the user never wrote."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(
        "def g(prompts, completions, **_):\n    return [0.0] * len(completions)\n"
    )
    run = f"output_dir={tmp_path / 'run'}"
    code, err = _gspo(capsys, "train", TINY, run, "rewards={mine.py:f: 1.0}")
    assert code == EXIT_CODES["config"]
    assert (
        _one_line(err) == "error: rewards.mine.py:f: reward 'mine.py:f': mine.py has no 'f'; callables: ['g']"
    )
    code, err = _gspo(capsys, "train", TINY, run, "rewards={nope.py:f: 1.0}")
    assert code == EXIT_CODES["input"]
    assert _one_line(err).startswith(
        "error: rewards.nope.py:f: reward file not found: nope.py (read from the working directory when named "
        "on the command line"
    )


_FULL_DISK = """\
import resource, shutil, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, a write fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
if sys.argv[2] == "full":  # the disk says it is full: the short write is a full disk's
    shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0)
from gspo.cli import main
raise SystemExit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize(
    ("limit", "disk", "argv", "said"),
    [
        (  # numpy's "4096 requested and 2096 written" (no errno) was an OSError traceback, exit 1
            64 * 2**10,
            "full",
            ["export", "{run}", "--format", "gguf", "--output", "{out}/model.gguf"],
            "error: the disk is full ({out}/model.gguf.tmp): free some space, or set --output to a folder on "
            "another disk",
        ),
        (
            64 * 2**10,
            "not full",
            ["export", "{run}", "--format", "gguf", "--output", "{out}/model.gguf"],
            "error: the write failed (",
        ),
        (
            512,
            "not full",
            ["eval", "{run}", "--output", "{out}/report.json"],
            "error: the file is larger than this process may write (ulimit -f) ({out}/report.json.tmp): raise "
            "the limit, or set --output elsewhere",
        ),
    ],
)
def test_a_write_that_fails_in_eval_or_export_is_one_line_naming_output_and_leaves_no_temporary_file(
    two_step_run: Path, tmp_path: Path, limit: int, disk: str, argv: list[str], said: str
) -> None:
    """A real process whose writes fail past a file-size limit (a full disk's short write, without root):
    exit 6, the option that chooses where it writes, and nothing left of the write (a .tmp was)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    args = [arg.format(run=two_step_run, out=out) for arg in argv]
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(limit), disk, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (result.returncode, result.stderr.count("\n")) == (EXIT_CODES["disk"], 1), result.stderr
    assert result.stderr.startswith(said.format(out=out)), result.stderr
    assert list(out.iterdir()) == []


def test_lora_target_modules_that_name_no_module_are_a_config_error_listing_the_models(
    tmp_path: Path, capsys
) -> None:
    """peft's NoMatchingPeftModuleError was a traceback, exit 1."""
    code, err = _run(
        capsys, TINY, f"output_dir={tmp_path / 'run'}", "lora.rank=4", "lora.target_modules=[nonexistent]"
    )
    assert code == EXIT_CODES["config"], err
    assert err.startswith(
        "error: lora.target_modules=['nonexistent']: Target modules {'nonexistent'} not found"
    )
    assert err.endswith(
        "This model's linear layers are named down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, "
        "v_proj: list some of those"
    )
