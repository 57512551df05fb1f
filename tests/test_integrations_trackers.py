"""report_to: each tracker's offline output read back through the tracker's own API (W&B's record protobufs,
MLflow's client, trackio's Api and storage): the metrics at gspo's steps, the config, the completions table,
the summary, and a resume that continues the same tracker run. Skipped where a tracker is not installed
(pip install 'gspo[integrations]')."""

from __future__ import annotations

import glob
import json
import struct
import sys
import time
import warnings
from pathlib import Path

import pytest

from conftest import TINY, tiny_config
from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.config.loading import DeprecatedKey
from gspo.run.metrics import MetricsLogger
from gspo.run.trackers import TRACKERS_FILE
from gspo.training.launch import train

CONFIG = {"seed": 3, "train": {"lr": 0.001, "objective": "gspo"}}
ROWS = [{"step": 2, "prompt": "1+1=", "completion": "2", "reward": 1.0}]


def _log_run(
    run_dir: Path,
    tracker: str,
    *,
    resume_step: int | None = None,
    steps=(1, 2, 3),
    project: str = "gspo-tests",
) -> None:
    """Steps 1.. with loss = step (x10 after a resume), an eval at step 2, a completions table, a summary."""
    scale = 1.0 if resume_step is None else 10.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the trackers' own dependencies
        logger = MetricsLogger(
            run_dir, report_to=[tracker], config=CONFIG, project=project, resume_step=resume_step
        )
        for step in steps:
            logger.log(step, {"loss": scale * step, "kl": None})
            if step == 2:
                logger.log(step, {"accuracy": 0.5}, kind="eval")
                logger.log_samples(step, ROWS)
        logger.close({"steps": steps[-1], "eval_accuracy_last": 0.5, "summary_md": "# summary\n"})


# ---- W&B: offline runs under run_dir/wandb, read with wandb's own record protobufs ------------------------


def _wandb_records(run_file: str) -> list:
    """The records of a .wandb file: W&B's LevelDB-style log (32 KiB blocks, 7-byte chunk headers) of its
    own `Record` protobufs; wandb ships no reader for offline runs (`wandb sync` needs a server)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _wandb_run(run_dir: Path) -> dict:
    """{"ids", "history": [{key: value}], "config": {key: value}, "summary": {key: value}} of all the
    offline sessions of run_dir's W&B run, in order."""
    import wandb

    wandb.teardown()  # waits for W&B's service process to write out the finished runs (finish() may return first)
    out: dict = {"ids": set(), "history": [], "config": {}, "summary": {}}
    for run_file in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        for record in _wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["ids"].add(record.run.run_id)
            elif kind == "history":
                out["history"].append(
                    {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                )
            elif kind == "config":
                out["config"] |= {u.key: json.loads(u.value_json) for u in record.config.update}
            elif kind == "summary":
                out["summary"] |= {
                    "/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in record.summary.update
                }
    return out


@pytest.fixture
def wandb_offline(monkeypatch):
    pytest.importorskip("wandb", reason="report_to=[wandb] needs pip install 'gspo[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_offline_run_holds_metrics_config_table_and_summary_and_resume_continues_it(
    tmp_path, wandb_offline
):
    run_dir = tmp_path / "run"
    _log_run(run_dir, "wandb")
    # W&B names an offline session's folder by the second it started: a resume in the same second would
    # write into the first session's folder (a real resume comes minutes later)
    time.sleep(1.05 - time.time() % 1)
    _log_run(run_dir, "wandb", resume_step=2, steps=(3, 4))
    run = _wandb_run(run_dir)
    stored = json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]
    assert run["ids"] == {stored}  # the resume continued the same run
    losses = [(h["step"], h["train/loss"]) for h in run["history"] if "train/loss" in h]
    assert losses == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (3, 30.0),
        (4, 40.0),
    ]  # gspo's steps, the redone one again
    assert [(h["step"], h["eval/accuracy"]) for h in run["history"] if "eval/accuracy" in h] == [(2, 0.5)]
    assert not any("train/kl" in h for h in run["history"])  # None is not a value
    table = [h for h in run["history"] if "samples/completions/nrows" in h]
    assert [(h["step"], h["samples/completions/nrows"]) for h in table] == [(2, 1)]
    assert run["config"]["seed"] == 3 and run["config"]["train"] == {"lr": 0.001, "objective": "gspo"}
    assert run["summary"]["eval_accuracy_last"] == 0.5 and run["summary"]["steps"] == 4


# ---- MLflow: a local SQLite store ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_folder(tmp_path_factory):
    """One store for the module: a new SQLite store runs MLflow's schema migrations (~15 s here)."""
    pytest.importorskip("mlflow", reason="report_to=[mlflow] needs pip install 'gspo[mlflow]'")
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture
def mlflow_store(mlflow_folder, monkeypatch):
    uri = f"sqlite:///{mlflow_folder / 'mlflow.db'}"  # MLflow's local store (its ./mlruns files are retired)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(mlflow_folder)  # where MLflow puts a local store's artifacts (./mlartifacts)
    return uri


def test_mlflow_local_store_holds_metrics_params_table_and_summary_and_resume_continues_it(
    tmp_path, mlflow_store
):
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    _log_run(run_dir, "mlflow")
    _log_run(run_dir, "mlflow", resume_step=2, steps=(3, 4))
    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name("gspo-tests")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resume continued the run
    run = runs[0]
    assert run.info.run_id == json.loads((run_dir / TRACKERS_FILE).read_text())["mlflow"]
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 40.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [
        (2, 0.5)
    ]
    assert run.data.params["seed"] == "3" and run.data.params["train.lr"] == "0.001"
    assert run.data.tags["summary.eval_accuracy_last"] == "0.5"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "summary.md", "completions"} <= artifacts
    table = json.loads(
        Path(client.download_artifacts(run.info.run_id, "completions/step_000002.json")).read_text()
    )
    assert table["columns"] == ["step", "prompt", "completion", "reward"] and table["data"] == [
        [2, "1+1=", "2", 1.0]
    ]


# ---- trackio: its local store (TRACKIO_DIR, read when trackio is first imported) -------------------------


@pytest.fixture
def trackio_local(tmp_path_factory):
    """trackio and a project of this test's own. trackio reads TRACKIO_DIR once, on import: set here when
    this test imports it first; when an earlier test did, its store (by default under ~/.cache) gets
    this project, removed after the test."""
    import os
    import uuid

    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(tmp_path_factory.mktemp("trackio"))
    trackio = pytest.importorskip("trackio", reason="report_to=[trackio] needs pip install 'gspo[trackio]'")
    from trackio.sqlite_storage import SQLiteStorage

    project = f"gspo-tests-{uuid.uuid4().hex[:8]}"
    yield trackio, project
    database = SQLiteStorage.get_project_db_path(project)
    for path in database.parent.glob(f"{database.stem}.*"):
        path.unlink()


def test_trackio_local_store_holds_metrics_config_and_table_and_resume_continues_it(tmp_path, trackio_local):
    from trackio.sqlite_storage import SQLiteStorage

    trackio, project = trackio_local
    run_dir = tmp_path / "run"
    _log_run(run_dir, "trackio", project=project)
    _log_run(run_dir, "trackio", resume_step=2, steps=(3, 4), project=project)
    runs = list(trackio.Api().runs(project))
    assert [r.name for r in runs] == ["run"]  # one run: the resume continued it
    assert json.loads((run_dir / TRACKERS_FILE).read_text())["trackio"] == "run"
    assert runs[0].config["seed"] == 3 and runs[0].config["train"]["lr"] == 0.001
    logs = SQLiteStorage.get_logs(project, "run")
    assert sorted((r["step"], r["train/loss"]) for r in logs if "train/loss" in r) == [
        (1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 40.0)
    ]  # fmt: skip
    assert [(r["step"], r["eval/accuracy"]) for r in logs if "eval/accuracy" in r] == [(2, 0.5)]
    assert [r["step"] for r in logs if "samples/completions" in r] == [2]
    assert [
        (r["step"], r["summary/eval_accuracy_last"]) for r in logs if "summary/eval_accuracy_last" in r
    ] == [(3, 0.5), (4, 0.5)]  # each session's end


# ---- the trainer: every metric, the config, each step's completions, the summary --------------------------


def test_gspo_train_reports_every_metric_config_samples_and_summary(tmp_path, mlflow_store, wandb_offline):
    run_dir = tmp_path / "run"
    config = tiny_config(
        run_dir, "report_to=[mlflow,wandb]", "train.steps=2", "eval.every=1", "task.num_eval=4"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        train(config)
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_store)
    run_id = json.loads((run_dir / TRACKERS_FILE).read_text())["mlflow"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run = client.get_run(run_id)
    for kind in ("train", "eval"):  # every number of metrics.jsonl, at its step
        expected = sorted(
            (f"{kind}/{k}", r["step"], v)
            for r in lines
            if r["kind"] == kind
            for k, v in r.items()
            if k not in ("step", "kind") and v is not None
        )
        got = sorted(
            (key, m.step, m.value)
            for key in run.data.metrics
            if key.startswith(f"{kind}/")
            for m in client.get_metric_history(run_id, key)
        )
        assert [g[:2] for g in got] == [e[:2] for e in expected] and len(expected) > 8
        assert [g[2] for g in got] == pytest.approx([e[2] for e in expected])
    assert run.data.params["train.steps"] == "2" and run.data.params["model.tiny"] == "llama"
    assert run.data.tags["summary.steps"] == "2"
    tables = sorted(a.path for a in client.list_artifacts(run_id, "completions"))
    assert tables == ["completions/step_000001.json", "completions/step_000002.json"]
    table = json.loads(Path(client.download_artifacts(run_id, tables[0])).read_text())
    assert len(table["data"]) == 16  # prompts_per_step x group_size
    first_train = next(r for r in lines if r["kind"] == "train")
    rewards = [row[3] for row in table["data"]]
    assert sum(rewards) / len(rewards) == pytest.approx(first_train["reward_mean"])
    assert "summary.md" in {a.path for a in client.list_artifacts(run_id)}
    wandb_run = _wandb_run(run_dir)
    assert wandb_run["ids"] == {json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]}
    assert [h["step"] for h in wandb_run["history"] if "train/reward_mean" in h] == [1, 2]
    assert wandb_run["config"]["rollout"]["group_size"] == 4


def test_a_tracker_that_is_not_installed_is_exit_9_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec finds nothing
    code = main(["train", str(TINY), f"output_dir={tmp_path / 'run'}", "report_to=[tensorboard,wandb]"])
    err = capsys.readouterr().err
    assert code == 9
    assert "report_to names wandb" in err and "pip install 'gspo[wandb]'" in err
    assert not (tmp_path / "run").exists()


def test_the_old_tensorboard_key_loads_as_report_to(tmp_path):
    with pytest.warns(DeprecatedKey, match="tensorboard is now report_to"):
        assert load_config(TINY, ["tensorboard=false"]).report_to == []
    with pytest.warns(DeprecatedKey):
        assert load_config(None, ["tensorboard=true"]).report_to == ["tensorboard"]
    both = tmp_path / "both.yaml"
    both.write_text("tensorboard: false\nreport_to: [wandb]\n")
    with pytest.raises(ConfigError, match="both tensorboard and report_to are set; keep only report_to"):
        load_config(both)
    with pytest.raises(ConfigError, match=r"report_to\[0\]: 'neptune' is not one of 'tensorboard', 'wandb'"):
        load_config(None, ["report_to=[neptune]"])


# ---- a tracker that cannot start: one line, a bounded wait, no secret --------------------------------------
def _refused(capsys, tmp_path, tracker: str) -> tuple[int, str, float]:
    started = time.monotonic()
    code = main(
        ["train", str(TINY), f"output_dir={tmp_path / 'run'}", f"report_to=[{tracker}]", "train.steps=1"]
    )
    err = capsys.readouterr().err.strip()
    return code, err, time.monotonic() - started


def test_wandb_without_a_key_is_one_config_line(tmp_path, monkeypatch, capsys):
    """No key and no WANDB_MODE: wandb's UsageError traceback after 10 s."""
    pytest.importorskip("wandb", reason="report_to=[wandb] needs pip install 'gspo[wandb]'")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc of the user's
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))
    code, err, _ = _refused(capsys, tmp_path, "wandb")
    assert (code, err.count("\n")) == (3, 0), err
    assert err.startswith("error: report_to: wandb could not start its run (UsageError: ")
    assert err.endswith(
        "set WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline for a local run, or remove wandb from report_to"
    )


def test_mlflow_with_nothing_listening_waits_a_bounded_time_and_never_shows_the_password(
    tmp_path, monkeypatch, capsys
):
    """258 s of MLflow's retries and 5 tracebacks, the URI's password among them: now TRACKER_TIMEOUT
    seconds (3 here) and one line; a malformed URI or a store that cannot be is one line at once."""
    import socket

    import gspo.run.trackers as trackers

    pytest.importorskip("mlflow", reason="report_to=[mlflow] needs pip install 'gspo[mlflow]'")
    monkeypatch.setattr(trackers, "TRACKER_TIMEOUT", 3.0)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:PASSWORD@127.0.0.1:{port}")
    code, err, took = _refused(capsys, tmp_path, "mlflow")
    assert (code, err.count("\n")) == (3, 0), err
    assert err.startswith(
        "error: report_to: mlflow did not start its run within 3 s: check MLFLOW_TRACKING_URI"
    )
    assert "PASSWORD" not in err and took < 60
    for uri in ("file:///proc/nope", "http//not a uri", "databricks://alice:PASSWORD@nowhere"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        code, err, _ = _refused(capsys, tmp_path, "mlflow")
        assert (code, err.count("\n")) == (3, 0), err
        assert err.startswith("error: report_to: mlflow could not start its run (") and "PASSWORD" not in err


def test_a_tracker_that_hangs_or_fails_is_one_line_within_the_bound_whatever_its_package(
    tmp_path, monkeypatch, capsys
):
    """gspo's side of the two tests above, with a stand-in tracker (no package needed): a start that never
    answers stops the run after TRACKER_TIMEOUT seconds, one that raises with a password in its message is
    one line without it."""
    import threading

    import gspo.run.start
    import gspo.run.trackers as trackers

    release = threading.Event()

    class Hangs:
        def __init__(self, *args) -> None:
            release.wait(120)  # a server that never answers (ended below)

    class Fails:
        def __init__(self, *args) -> None:
            raise ConnectionError("Max retries exceeded: http://alice:PASSWORD@127.0.0.1:9/api (refused)")

    for module in (trackers, gspo.run.start):
        monkeypatch.setattr(module, "check_installed", lambda report_to: None)
    monkeypatch.setattr(trackers, "TRACKER_TIMEOUT", 2.0)
    try:
        monkeypatch.setattr(trackers, "MlflowTracker", Hangs)
        code, err, took = _refused(capsys, tmp_path, "mlflow")
        assert (code, err.count("\n")) == (3, 0), err
        assert err.startswith("error: report_to: mlflow did not start its run within 2 s: check ")
        assert took < 60  # the model and data load first: seconds; the wait is bounded by the 2 s above
    finally:
        release.set()
    monkeypatch.setattr(trackers, "MlflowTracker", Fails)
    code, err, _ = _refused(capsys, tmp_path, "mlflow")
    assert (code, err.count("\n")) == (3, 0), err
    assert err.startswith("error: report_to: mlflow could not start its run (ConnectionError: ")
    assert "http://***@127.0.0.1:9/api" in err and "PASSWORD" not in err
