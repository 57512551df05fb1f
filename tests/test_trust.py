"""A run folder is data (gspo.run.trust): the reward code and the server its config names are used
only when the user names them on the command line."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import reseal
from gspo.cli import EXIT_CODES, main
from gspo.config import load_config
from gspo.models import tiny_tokenizer
from gspo.rollout.openai import OpenAIBackend
from gspo.run import own_runs
from gspo.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
REWARD = """\
import os, pathlib
pathlib.Path(os.environ["GSPO_TEST_MARKER"]).touch()  # what a planted file could do: anything


def reward(prompts, completions, **_):
    return [float(len(c) % 2) for c in completions]
"""


@pytest.fixture(scope="module")
def run_with_reward_file(tmp_path_factory) -> Path:
    """A tiny run trained with a reward file of its own (the file imports with a visible effect)."""
    base = tmp_path_factory.mktemp("planted")
    (base / "planted.py").write_text(REWARD)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GSPO_TEST_MARKER", str(base / "imported-at-training"))
        train(
            load_config(
                TINY,
                [
                    f"output_dir={base / 'run'}",
                    f"rewards={{{base / 'planted.py'}:reward: 1.0}}",
                    "train.steps=1",
                    "eval.every=0",
                    "report_to=[]",
                    "task.num_eval=2",
                ],
            )
        )
    return base


def _gspo(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_reward_code_a_run_folder_names_runs_only_when_the_user_names_it(
    run_with_reward_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_with_reward_file / "run", run)
    marker = tmp_path / "imported"
    monkeypatch.setenv("GSPO_TEST_MARKER", str(marker))
    monkeypatch.chdir(tmp_path)
    spec = f"{run_with_reward_file / 'planted.py'}:reward"
    for argv in (["train", "--resume", str(run), "train.steps=2"], ["eval", str(run), "--output", "r.json"]):
        code, err = _gspo(capsys, *argv)
        assert code == EXIT_CODES["config"], err
        assert f"names the reward '{spec}', Python code that gspo would import" in err
        assert f"'rewards={{{spec}: 1}}' on the command line, or --trust-run-code" in err
        assert not marker.exists()  # refused before anything was imported
    code, err = _gspo(capsys, "eval", str(run), "--output", "r.json", "--trust-run-code")
    assert code == 0, err
    assert marker.exists()
    marker.unlink()
    code, err = _gspo(capsys, "train", "--resume", str(run), "train.steps=2", f"rewards={{{spec}: 1.0}}")
    assert code == 0, err
    assert marker.exists()


def test_a_reward_named_by_a_relative_path_or_replaced_from_python_is_the_users(
    run_with_reward_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """config.rewards holds absolute paths (load_config anchors them): a `rewards=` override naming the file
    relative to the working directory is the same reward; reward_functions replace the configured rewards,
    so the run folder's reward file is not imported at all."""
    run = tmp_path / "run"
    shutil.copytree(run_with_reward_file / "run", run)
    marker = tmp_path / "imported"
    monkeypatch.setenv("GSPO_TEST_MARKER", str(marker))
    monkeypatch.chdir(run_with_reward_file)
    code, err = _gspo(
        capsys, "train", "--resume", str(run), "train.steps=2", "rewards={planted.py:reward: 1}"
    )
    assert code == 0, err
    assert marker.exists()
    marker.unlink()
    result = train(
        resume=run,
        overrides=["train.steps=3"],
        reward_functions={"mine": lambda prompts, completions, **_: [0.0] * len(completions)},
    )
    assert result["run_dir"] == str(run)
    assert not marker.exists()
    assert yaml.safe_load((run / "config.yaml").read_text())["rewards"] == {"mine": 1.0}


@contextlib.contextmanager
def _recording_server() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A server that records each request's headers and answers 500."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(500)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()


def _point_at(run: Path, url: str, variable: str) -> None:
    """What a shared folder's author could write: the run's config and its checkpoint's, alike."""
    for path in [run / "config.yaml", *run.glob("checkpoints/step_*/config.yaml")]:
        config = yaml.safe_load(path.read_text())
        config["rollout"]["engine"] = "openai"
        config["rollout"]["openai"] |= {"url": url, "api_key_env": variable, "timeout": 2.0}
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    for checkpoint in run.glob("checkpoints/step_*"):
        reseal(checkpoint)


def test_a_run_folder_cannot_send_a_credential_to_a_server_of_its_choice(
    two_step_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    monkeypatch.setenv("SOME_TOKEN", "ghp-secret-123")
    with _recording_server() as (url, seen):
        _point_at(run, url, "SOME_TOKEN")
        code, err = _gspo(capsys, "train", "--resume", str(run), "train.steps=3")
        assert code == EXIT_CODES["config"], err
        assert f"sends rollouts to rollout.openai.url='{url}': a run folder does not choose" in err
        assert seen == []  # nothing was sent, so no key
        code, err = _gspo(capsys, "train", "--resume", str(run), "train.steps=3", f"rollout.openai.url={url}")
        assert (
            code == EXIT_CODES["config"]
            and "names the environment variable 'SOME_TOKEN' as the API key" in err
        )
        assert seen == []
        # named by the user: the key goes to the origin the user named (which answers 500 here)
        code, err = _gspo(
            capsys,
            "train",
            "--resume",
            str(run),
            "train.steps=3",
            f"rollout.openai.url={url}",
            "rollout.openai.api_key_env=SOME_TOKEN",
        )
        assert code == EXIT_CODES["server"], err
        assert seen and {h.get("authorization") for h in seen} == {"Bearer ghp-secret-123"}
        assert "ghp-secret-123" not in err


def test_a_config_file_of_the_users_own_is_theirs(
    run_with_reward_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """`gspo eval RUN CONFIG`: the rewards come from CONFIG, which the user named."""
    monkeypatch.setenv("GSPO_TEST_MARKER", str(tmp_path / "imported"))
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        yaml.safe_dump(
            {"model": {"tiny": "llama"}, "rewards": {"digit_fraction": 1.0}, "task": {"num_eval": 2}}
        )
    )
    monkeypatch.chdir(tmp_path)
    code, err = _gspo(capsys, "eval", str(run_with_reward_file / "run"), str(mine), "--output", "r.json")
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["rewards"] == {"digit_fraction": 1.0}
    assert not (tmp_path / "imported").exists()


def _snapshot(path: Path) -> dict[str, bytes]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)): p.read_bytes() for p in files}


@pytest.mark.parametrize(
    ("planted", "argv"),
    [
        ("summary.md", ["plot", "{run}"]),
        ("evals", ["eval", "{run}"]),
        ("metrics.jsonl", ["train", "--resume", "{run}"]),
        ("checkpoints/step_000002", ["export", "{run}", "--format", "hf"]),  # read through a link
        ("checkpoints/step_000002/model/model.safetensors", ["eval", "{run}"]),
        ("checkpoints/.tmp_step_000003", ["train", "--resume", "{run}", "train.steps=3"]),  # a save
    ],
)
def test_a_link_in_a_run_folder_is_refused_and_nothing_outside_it_changes(
    two_step_run: Path, tmp_path: Path, capsys, planted: str, argv: list[str]
) -> None:
    """A run folder from someone else with a symbolic link in it (to a file or folder of the run's, moved
    out, or to an empty folder): gspo writes and reads nothing through it; one error line names the link,
    with the run folder's exit code."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(two_step_run, run)
    link = run / planted
    if link.exists():
        shutil.move(link, outside)
    else:
        outside.mkdir()
    link.symlink_to(outside)
    before = _snapshot(outside)
    code, err = _gspo(capsys, *(arg.format(run=run) for arg in argv))
    assert (code, err.count("\n")) == (EXIT_CODES["run folder"], 0), err
    assert f"{link} is a symbolic link" in err
    assert _snapshot(outside) == before


def test_a_malformed_api_key_is_refused_by_its_variables_name_and_never_shown(tmp_path: Path, capsys) -> None:
    """A key with a carriage return ended in http.client's traceback, whose last line printed the whole
    Authorization header; a real process, as a user runs it, then other malformed keys in-process."""
    secret = "sk-proj-SECRET0123456789"
    argv = ["train", str(TINY), "rollout.engine=openai", "rollout.openai.url=http://127.0.0.1:9/v1"]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT / "src"),
        "OPENAI_API_KEY": secret + "\r",
    }
    result = subprocess.run(
        [sys.executable, "-m", "gspo", *argv, f"output_dir={tmp_path / 'run'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == EXIT_CODES["config"], result.stderr
    assert secret not in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "error: the environment variable OPENAI_API_KEY (rollout.openai.api_key_env) holds whitespace, control "
        "or non-ASCII characters (a bearer token is printable ASCII); it is not shown: set it to the key "
        "alone, without a trailing newline or carriage return"
    )
    for n, key in enumerate([f" {secret}", f"{secret}\n", f"sk {secret}", f"{secret}\x1b[2J", f"{secret}é"]):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MY_KEY", key)
            code = main([*argv, "rollout.openai.api_key_env=MY_KEY", f"output_dir={tmp_path / str(n)}"])
        out, err = capsys.readouterr()
        assert code == EXIT_CODES["config"] and "MY_KEY" in err, err
        assert secret not in out + err
    with pytest.raises(ValueError, match=r"^api_key holds whitespace") as error:  # from Python, too
        OpenAIBackend("http://127.0.0.1:9/v1", tiny_tokenizer(), api_key=secret + "\r")
    assert secret not in str(error.value)


# ---- the record of one's own runs (gspo.run.own_runs) -------------------------------------------------
OWN_TASK = (
    REWARD
    + """

import torch

import gspo


@gspo.objective(level="sequence")
def plain_ratio(s, knobs):
    ratio = torch.exp(s.seq_log_ratio.clamp(-20, 20))
    return gspo.Terms(-ratio * s.adv_seq, ratio < 0, ratio < 0)
"""
)


@pytest.fixture
def own_run(tmp_path: Path, monkeypatch, capsys) -> Path:
    """A run the user started with `gspo train` and a config file of their own that names a reward and an
    objective in their file (relative paths, anchored to the config's folder): returns the run folder."""
    task = tmp_path / "mytask"
    task.mkdir()
    (task / "mytask.py").write_text(OWN_TASK)
    (task / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"tiny": "llama"},
                "task": {"num_train": 16, "num_eval": 2},
                "rewards": {"mytask.py:reward": 1.0},
                "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
                "train": {"objective": "mytask.py:plain_ratio", "steps": 1},
                "eval": {"every": 0, "max_new_tokens": 4},
                "tensorboard": False,
            }
        )
    )
    monkeypatch.setenv("GSPO_TEST_MARKER", str(tmp_path / "imported"))
    monkeypatch.chdir(tmp_path)
    code, err = _gspo(capsys, "train", str(task / "config.yaml"), "output_dir=run")
    assert code == 0, err
    (tmp_path / "imported").unlink()
    return tmp_path / "run"


def test_own_run_resumes_and_evaluates_with_no_flag(own_run: Path, own_runs_store: Path, capsys) -> None:
    marker = own_run.parent / "imported"
    code, err = _gspo(capsys, "train", "--resume", "run", "train.steps=2")
    assert code == 0, err
    assert marker.exists()
    marker.unlink()
    code, err = _gspo(capsys, "eval", "run", "--output", "r.json")
    assert code == 0, err
    assert marker.exists()
    code, err = _gspo(capsys, "eval", str(own_run / ".." / "run"), "--output", "r2.json")  # the same folder
    assert code == 0, err
    store = own_runs_store / "own_runs.json"
    assert (own_runs_store.stat().st_mode & 0o777, store.stat().st_mode & 0o777) == (0o700, 0o600)
    file = own_run.parent / "mytask" / "mytask.py"
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    assert json.loads(store.read_text())[str(own_run.resolve())] == {str(file.resolve()): digest}
    assert not list(own_runs_store.glob("*.tmp"))


def test_a_copied_own_run_or_a_changed_file_asks_again(own_run: Path, tmp_path: Path, capsys) -> None:
    marker = tmp_path / "imported"
    shutil.copytree(own_run, tmp_path / "copy")
    for argv in (["train", "--resume", "copy", "train.steps=2"], ["eval", "copy", "--output", "r.json"]):
        code, err = _gspo(capsys, *argv)
        assert code == EXIT_CODES["config"], err
        assert "mytask.py:plain_ratio', Python code that gspo would import" in err  # checked first
        assert not marker.exists()
    code, err = _gspo(
        capsys, "train", "--resume", "copy", "train.steps=2", "train.objective=mytask/mytask.py:plain_ratio"
    )
    assert code == EXIT_CODES["config"] and "names the reward" in err, err
    file = tmp_path / "mytask" / "mytask.py"
    file.write_text(file.read_text() + "\n# changed\n")
    for argv in (["train", "--resume", "run", "train.steps=2"], ["eval", "run", "--output", "r.json"]):
        code, err = _gspo(capsys, *argv)
        assert code == EXIT_CODES["config"], err
        assert f"({file.resolve()} has changed since you started this run with it)" in err
        assert not marker.exists()


def test_a_store_of_another_user_or_writable_by_others_is_ignored(
    own_run: Path, own_runs_store: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    marker = tmp_path / "imported"
    store = own_runs_store / "own_runs.json"
    before = store.read_text()
    for path, mode, why in (
        (store, 0o622, "is writable by others (mode 622)"),
        (own_runs_store, 0o777, "is writable by others (mode 777)"),
    ):
        path.chmod(mode)
        code, err = _gspo(capsys, "eval", "run", "--output", "r.json")
        assert code == EXIT_CODES["config"], err
        assert f"(gspo's record of your runs is ignored: {path} {why})" in err
        assert not marker.exists()
        code, err = _gspo(capsys, "train", "--resume", "run", "train.steps=2", "--trust-run-code")
        assert code == 0 and store.read_text() == before, err  # nor written
        marker.unlink()
        path.chmod(0o700 if path.is_dir() else 0o600)
    uid = os.getuid()
    monkeypatch.setattr(own_runs.os, "getuid", lambda: uid + 1)  # the store is now another user's
    code, err = _gspo(capsys, "eval", "run", "--output", "r.json")
    assert code == EXIT_CODES["config"], err
    assert f"is ignored: {own_runs_store} belongs to another user (uid {uid})" in err
    code, err = _gspo(capsys, "train", "mytask/config.yaml", "output_dir=run2")
    assert code == 0, err
    assert "note: this run is not recorded as yours" in err
    assert store.read_text() == before
