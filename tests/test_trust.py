"""A run folder is data (gspo.run.trust): the reward code and the server its config names are used
only when the user names them on the command line."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
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
from gspo.training.launch import train

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
        assert f"'rewards={{{spec}: 1}}' on the command line, or --trust-run-folder" in err
        assert not marker.exists()  # refused before anything was imported
    code, err = _gspo(capsys, "eval", str(run), "--output", "r.json", "--trust-run-folder")
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
def _recording_server() -> Iterator[tuple[str, list[dict[str, str]], list[str]]]:
    """A server that records each connection it accepts (its peer), each request's headers (and its path,
    as ":path"), and answers 500."""
    seen: list[dict[str, str]] = []
    connections: list[str] = []

    class Listener(ThreadingHTTPServer):
        def verify_request(self, request, client_address) -> bool:
            connections.append(f"{client_address[0]}:{client_address[1]}")  # before a byte is read
            return True

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append({k.lower(): v for k, v in self.headers.items()} | {":path": self.path})
            self.send_response(500)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST

        def log_message(self, *args) -> None:
            pass

    server = Listener(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen, connections
    finally:
        server.shutdown()
        server.server_close()


def _plant(run: Path, settings: dict[str, object]) -> None:
    """What a shared folder's author could write: dotted keys set in the run's config and its checkpoints'
    alike, their manifests rewritten to match."""
    for path in [run / "config.yaml", *run.glob("checkpoints/step_*/config.yaml")]:
        config = yaml.safe_load(path.read_text())
        for key, value in settings.items():
            *sections, leaf = key.split(".")
            node = config
            for section in sections:
                node = node[section]
            node[leaf] = value
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    for checkpoint in run.glob("checkpoints/step_*"):
        reseal(checkpoint)


def test_a_run_folder_cannot_send_a_credential_to_a_server_of_its_choice(
    two_step_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    monkeypatch.setenv("SOME_TOKEN", "ghp-secret-123")
    with _recording_server() as (url, seen, _):
        openai = {"url": url, "api_key_env": "SOME_TOKEN", "timeout": 2.0}
        _plant(run, {"rollout.engine": "openai", **{f"rollout.openai.{k}": v for k, v in openai.items()}})
        code, err = _gspo(capsys, "train", "--resume", str(run), "train.steps=3")
        assert code == EXIT_CODES["config"], err
        assert f"names rollout.openai.url='{url}', the server gspo sends its prompts" in err
        assert seen == []  # nothing was sent, so no key
        code, err = _gspo(capsys, "train", "--resume", str(run), "train.steps=3", f"rollout.openai.url={url}")
        assert (
            code == EXIT_CODES["config"]
            and "names rollout.openai.api_key_env='SOME_TOKEN', the environment variable whose secret" in err
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


# ---- servers and paths outside the run folder (gspo.run.trust.REACHES) ----------------------------------
def test_a_run_folder_cannot_choose_the_vllm_server_or_its_weights_folder(
    two_step_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """A planted rollout.vllm.url was contacted without a flag (/health, /server_info, a reload_weights
    naming the folder's weights_dir, then the prompts); now a real listener there receives nothing, and
    nothing is written to the planted weights folder, until the user names both."""
    import gspo.sampling.factories

    # vLLM's package is not needed to talk to a server by URL: without this, a venv without it stops
    # before any request, and the listener would see nothing whatever the rule
    monkeypatch.setattr(gspo.sampling.factories, "require_vllm", lambda: None)
    run, weights = tmp_path / "run", tmp_path / "weights"
    shutil.copytree(two_step_run, run)
    with _recording_server() as (url, seen, connections):
        planted = {
            "rollout.vllm.url": url,
            "rollout.vllm.weights_dir": str(weights),
            "rollout.vllm.timeout": 1.0,
        }
        _plant(run, {"rollout.engine": "vllm_server", **planted})
        resume = ["train", "--resume", str(run), "train.steps=3"]
        code, err = _gspo(capsys, *resume)
        assert (code, err.count("\n")) == (EXIT_CODES["config"], 0), err
        assert f"names rollout.vllm.url='{url}', the vLLM server gspo sends its prompts" in err
        assert (
            f"rollout.vllm.weights_dir='{weights}', the folder gspo writes the policy's weights into" in err
        )
        both = f"rollout.vllm.url={url} rollout.vllm.weights_dir={weights}"
        assert f"pass {both} on the command line to confirm them, or --trust-run-folder" in err  # at once
        code, err = _gspo(capsys, *resume, f"rollout.vllm.url={url}")
        assert code == EXIT_CODES["config"] and f"names rollout.vllm.weights_dir='{weights}'" in err, err
        assert "rollout.vllm.url=" not in err.split("names", 1)[1]  # the one confirmed is not asked again
        assert (connections, seen) == ([], []) and not weights.exists()  # not even a connection
        # named, or trusted: the server is asked (the listener answers 500: no vLLM server there)
        for named in (
            [f"rollout.vllm.url={url}", f"rollout.vllm.weights_dir={weights}"],
            ["--trust-run-folder"],
        ):
            code, err = _gspo(capsys, *resume, *named)
            assert code == EXIT_CODES["server"] and f"no vLLM server answers at {url}" in err, err
            assert connections and seen and seen[0][":path"] == "/health"
            seen.clear()
            connections.clear()


def test_a_run_folder_cannot_choose_the_judge_its_completions_go_to(
    two_step_run: Path, tmp_path: Path, capsys
) -> None:
    """A run folder whose rewards name the LLM judge (gspo.rewards.judge) and its judge.url: the judge is
    sent the completions, and the API key, only when the user names the URL again (or trusts the folder)."""
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    (run / "judge.txt").write_text("Judge $prompt: $completions")
    with _recording_server() as (url, seen, connections):
        _plant(run, {"rewards": {"judge": 1.0}, "judge": {"url": url, "template": str(run / "judge.txt")}})
        resume = ["train", "--resume", str(run), "train.steps=3", "reward_timeout=5"]
        code, err = _gspo(capsys, *resume)
        assert (code, err.count("\n")) == (EXIT_CODES["config"], 0), err
        assert f"names judge.url='{url}', the LLM judge gspo sends the completions" in err
        assert (connections, seen) == ([], [])  # not even a connection
        code, err = _gspo(capsys, *resume, f"judge.url={url}")  # named: asked (the listener answers 500)
        assert code == EXIT_CODES["reward"] and f"the judge at {url} failed" in err, err
        # the judge may first ask /v1/models which model it serves (judge.model None); the completions follow
        assert "/v1/chat/completions" in [request[":path"] for request in seen], seen


def test_gspo_eval_of_a_planted_folder_reaches_neither_judge_nor_secret_nor_reward_model(
    two_step_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """`gspo eval RUN` follows --resume's rule: a judge URL, template, key variable or reward-model path the
    folder names is used only when the user names it again (or trusts the folder). Before, eval sent the
    held-out completions to the planted URL, with the planted variable's secret as the Bearer token, and
    loaded the planted reward model."""
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    (run / "judge.txt").write_text("Judge $prompt: $completions")
    monkeypatch.setenv("GSPO_TEST_PLANTED_SECRET", "sk-do-not-send")
    with _recording_server() as (url, seen, connections):
        judge = {"url": url, "template": str(run / "judge.txt"), "api_key_env": "GSPO_TEST_PLANTED_SECRET"}
        _plant(run, {"rewards": {"judge": 1.0}, "judge": judge})
        code, err = _gspo(capsys, "eval", str(run))
        assert (code, err.count("\n")) == (EXIT_CODES["config"], 0), err
        assert f"names judge.url='{url}', the LLM judge gspo sends the completions" in err
        code, err = _gspo(capsys, "eval", str(run), f"judge.url={url}")  # the URL named, not the variable
        assert code == EXIT_CODES["config"] and "judge.api_key_env='GSPO_TEST_PLANTED_SECRET'" in err, err
        assert (connections, seen) == ([], [])  # not even a connection, no secret
    model = tmp_path / "planted_reward_model"
    model.mkdir()
    _plant(run, {"rewards": {"reward_model": 1.0}, "reward_model.path": str(model), "judge.url": None})
    code, err = _gspo(capsys, "eval", str(run))
    assert (code, err.count("\n")) == (EXIT_CODES["config"], 0), err
    assert f"reward_model.path='{model}', the reward model gspo loads and runs" in err


def test_a_server_that_is_not_vllm_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """The listener of the planted-URL finding answers /health, and /server_info without vLLM's config:
    that was `KeyError: 'vllm_config'`."""
    from gspo.rollout.openai import ServerError
    from gspo.rollout.vllm_server import ExternalVLLMServer

    class NotVLLM(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        with pytest.raises(ServerError) as raised:
            ExternalVLLMServer(url, directory=tmp_path, timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert str(raised.value).startswith(
        f"the server at {url} (rollout.vllm.url) does not answer /server_info as vLLM does (no 'vllm_config'"
    )


def test_a_run_folder_cannot_choose_the_data_it_reads(two_step_run: Path, tmp_path: Path, capsys) -> None:
    """A planted task.data_path (any file of the user's, or ../ of the folder) was read and copied into
    RUN/evals/step_N.json by `gspo eval RUN`; now it is read only when the user names it."""
    run, secret = tmp_path / "run", tmp_path / "private.jsonl"
    shutil.copytree(two_step_run, run)
    secret.write_text("".join(json.dumps({"prompt": f"SECRET-{i}", "answer": "1"}) + "\n" for i in range(4)))
    _plant(run, {"task.name": "file", "task.data_path": str(secret), "task.num_eval": 2})
    for argv in (["eval", str(run)], ["train", "--resume", str(run), "train.steps=3"]):
        code, err = _gspo(capsys, *argv)
        assert (code, err.count("\n")) == (EXIT_CODES["config"], 0), err
        assert f"names task.data_path='{secret}', the data gspo reads" in err
    (run / "linked.jsonl").symlink_to(secret)  # inside by its name, outside by its target
    _plant(run, {"task.data_path": str(run / "linked.jsonl")})
    code, err = _gspo(capsys, "eval", str(run))
    assert (code, err.count("\n")) == (EXIT_CODES["config"], 0), err
    assert not (run / "evals").exists()
    code, err = _gspo(capsys, "eval", str(run), f"task.data_path={secret}")
    assert code == 0, err
    assert "SECRET-" in (run / "evals" / "step_000002.json").read_text()  # named: read, as asked
    # a file inside the folder is the folder's own (the rows of train(data=...) are kept in RUN/data.jsonl)
    shutil.copy(secret, run / "data.jsonl")
    _plant(run, {"task.data_path": str(run / "data.jsonl")})
    code, err = _gspo(capsys, "eval", str(run), "--output", str(tmp_path / "inside.json"))
    assert code == 0, err


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A tiny LoRA run whose base model is a folder on disk (model.path): started by the user, so recorded
    as theirs (gspo.run.own_runs)."""
    from gspo.models import save_model, tiny_model

    base = tmp_path_factory.mktemp("lora")
    tokenizer = tiny_tokenizer()
    save_model(tiny_model("llama", len(tokenizer), 0), tokenizer, base / "base")
    overrides = [f"model.path={base / 'base'}", "model.tiny=null", "lora.rank=4", "train.steps=1"]
    train(load_config(TINY, [f"output_dir={base / 'run'}", *overrides, "eval.every=0", "report_to=[]"]))
    return base


def test_a_run_folder_cannot_choose_the_base_model_it_loads(lora_run: Path, tmp_path: Path, capsys) -> None:
    """A LoRA checkpoint loads its base weights from model.path: a folder's value (or an edited one in the
    user's own run) is read only when named; the user's own run needs no flag."""
    from gspo.run.trust import UntrustedRunFolder
    from gspo.serve.server import serve_config

    base, copy = lora_run / "base", tmp_path / "copy"
    shutil.copytree(lora_run / "run", copy)
    code, err = _gspo(capsys, "eval", str(lora_run / "run"), "--output", str(tmp_path / "own.json"))
    assert code == 0, err  # the user's own run, as started
    refusal = f"names model.path='{base}', the model gspo loads"
    for argv in (["eval", str(copy)], ["export", str(copy), "--format", "hf"]):
        code, err = _gspo(capsys, *argv)
        assert (code, err.count("\n")) == (EXIT_CODES["config"], 0), err
        assert refusal in err
    with pytest.raises(UntrustedRunFolder, match=refusal):
        serve_config(None, [], copy)
    assert not (copy / "evals").exists() and not (copy / "export").exists()
    for argv in (["eval", str(copy)], ["export", str(copy), "--format", "hf"]):
        code, err = _gspo(capsys, *argv, f"model.path={base}")
        assert code == 0, err
    _plant(lora_run / "run", {"model.path": str(copy / "export" / "step_000001-hf")})
    code, err = _gspo(capsys, "eval", str(lora_run / "run"), "--output", str(tmp_path / "edited.json"))
    assert code == EXIT_CODES["config"] and f"(you started this run with model.path={base})" in err, err


@pytest.mark.parametrize(
    ("linked", "argv", "exit_code"),
    [
        ("summary.md", ["plot", "{run}"], 0),
        ("plots/reward.png", ["plot", "{run}"], 0),
        ("metrics.jsonl", ["train", "--resume", "{run}", "train.steps=3"], 0),
        ("config.yaml", ["train", "--resume", "{run}", "train.steps=3"], 0),
        ("checkpoints/latest", ["train", "--resume", "{run}", "train.steps=3"], 0),
        ("metrics.rolled_back.jsonl", ["train", "--resume", "{run}", "--from-step", "1"], 0),
        ("completions.jsonl", ["train", "--resume", "{run}", "train.steps=3"], 0),
        ("completions.rolled_back.jsonl", ["train", "--resume", "{run}", "--from-step", "1"], 0),
        ("evals/step_000002.json", ["eval", "{run}"], 0),
        ("export/step_000002-hf/config.json", ["export", "{run}", "--format", "hf", "--force"], 0),
        (".gspo_lock", ["train", "--resume", "{run}", "train.steps=3"], 5),  # the one file written in place
    ],
)
def test_a_hard_link_in_a_run_folder_changes_nothing_outside_it(
    two_step_run: Path, tmp_path: Path, capsys, linked: str, argv: list[str], exit_code: int
) -> None:
    """A hard link is an ordinary file, so `run_path` cannot see it: `gspo plot` rewrote the file outside
    that `summary.md` shared its inode with. Every write under a run folder now goes to a new file renamed
    over the target (gspo.files), so the outside file stays byte for byte as it was."""
    run, outside = tmp_path / "run", tmp_path / "outside.txt"
    shutil.copytree(two_step_run, run)
    if linked.startswith("export/"):  # an earlier export to write over
        assert _gspo(capsys, "export", str(run), "--format", "hf")[0] == 0
    (run / "plots").mkdir(exist_ok=True)
    (run / "evals").mkdir(exist_ok=True)
    # the run's own content where gspo reads it first (config.yaml, latest), so the command gets that far
    before = (run / linked).read_bytes() if (run / linked).is_file() else b"the user's own file\n"
    outside.write_bytes(before)
    (run / linked).unlink(missing_ok=True)
    os.link(outside, run / linked)
    code, err = _gspo(capsys, *(arg.format(run=run) for arg in argv))
    assert code == exit_code, err
    assert outside.read_bytes() == before
    if exit_code:
        assert err.count("\n") == 0 and f"{run / linked} is not a file of gspo's own (2 names" in err
    else:
        assert (run / linked).stat().st_nlink == 1  # gspo's own file now


# ---- chat templates from a folder are data (gspo.models.templates) ---------------------------------------
@pytest.mark.parametrize(
    ("template", "seconds", "why"),
    [
        (  # 10^10 iterations (`gspo eval RUN` ran until killed at 90 s); no output, so that a fast machine
            # cannot reach the memory budget first
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            2.0,
            "did not render within 2 s",
        ),
        (  # a string doubled 40 times: 2^40 bytes, without a byte of output; time enough to reach the
            # memory budget on a loaded machine (copying 2 GiB takes about a second)
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            40.0,
            "needed more than 1 GiB to render",
        ),
        (  # stopped by Jinja's sandbox, as a traceback (jinja2.exceptions.SecurityError)
            "{{ ''.__class__.__mro__[1].__subclasses__() }}",
            2.0,
            "failed: SecurityError: access to attribute '__class__' of 'str' object is unsafe.",
        ),
    ],
)
def test_a_planted_chat_template_renders_under_a_budget_or_is_refused_with_one_line(
    two_step_run: Path, tmp_path: Path, capsys, monkeypatch, template: str, seconds: float, why: str
) -> None:
    import resource

    from gspo.models import templates

    monkeypatch.setattr(templates, "TEMPLATE_SECONDS", seconds)
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    model = run / "checkpoints" / "step_000002" / "model"
    (model / "chat_template.jinja").write_text(template)
    reseal(model.parent)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # guards, so that a render in this process fails the test rather than the machine: 4 GiB more address
    # space at most, and an alarm after 90 s
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + 4 * 2**30, hard))
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(90)
    try:
        code, err = _gspo(capsys, "eval", str(run))
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert (code, err.count("\n")) == (EXIT_CODES["input"], 0), err
    assert err.startswith(f"error: the chat template of {model} {why}"), err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 2**10  # KiB: not here
    assert not (run / "evals").exists()


def _alarm(signum, frame) -> None:
    raise TimeoutError("the chat template rendered for 90 s in the test's own process")


# ---- trackers.json and secrets in messages -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{not json", "not JSON: Expecting property name"),
        ('["wandb"]', "a list, not a mapping"),
        ('{"wandb": {"id": 1}}', "wandb's run id {'id': 1} is not a run id"),
        ('{"mlflow": "../../elsewhere"}', "mlflow's run id '../../elsewhere' is not a run id"),
    ],
)
def test_a_tampered_trackers_json_is_a_run_folder_error(
    two_step_run: Path, tmp_path: Path, capsys, content: str, why: str
) -> None:
    """pydantic's ValidationError or a JSONDecodeError traceback: now one line, the run folder's code."""
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    (run / "trackers.json").write_text(content)
    code, err = _gspo(capsys, "train", "--resume", str(run), "train.steps=3")
    assert (code, err.count("\n")) == (EXIT_CODES["run folder"], 0), err
    assert f"trackers.json is not the trackers file gspo writes ({why}" in err


def test_credentials_in_a_url_are_left_out_of_every_message(tmp_path: Path, capsys, monkeypatch) -> None:
    """A URL's password reached stderr (a tracker's traceback; gspo's own refusal of a URL with credentials
    quoted it); so could a secret a library copies into its advice."""
    from gspo.cli import redact

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "databricks://alice:hunter2x@workspace")
    monkeypatch.setenv("SOME_API_TOKEN", "tok-0123456789abcdef")
    said = "put-secret alice hunter2x@x-host, http://bob:s3cret@10.0.0.1/v1, token tok-0123456789abcdef"
    assert redact(said) == "put-secret alice ***@x-host, http://***@10.0.0.1/v1, token ***"
    code, err = _gspo(
        capsys,
        "train",
        str(TINY),
        f"output_dir={tmp_path / 'run'}",
        "rollout.engine=openai",
        "rollout.openai.url=http://alice:PASSWORD123@127.0.0.1:9/v1",
    )
    assert code == EXIT_CODES["config"] and "http://***@127.0.0.1:9/v1" in err, err
    assert "PASSWORD123" not in err
