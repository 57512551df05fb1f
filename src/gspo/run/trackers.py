"""Experiment trackers: where `report_to` sends a run's metrics, resolved config, completion samples and
final summary, beside ``metrics.jsonl`` (which stays the source of truth).

Each tracker is a small class with the same four methods (`Tracker`); its package is imported only when a
run names it. Every tracker run is named after the run folder, and every value keeps gspo's step.

- ``tensorboard``: event files in ``run_dir/tensorboard``; optional as before (a warning without it);
  a resume purges the events after the checkpoint.
- ``wandb``: ``dir=run_dir``; W&B's own settings apply (``WANDB_MODE=offline`` for an offline run).
- ``mlflow``: the tracking URI from ``MLFLOW_TRACKING_URI`` (``file:./mlruns`` for a local store).
- ``trackio``: trackio's local store (``TRACKIO_DIR``).

The ids of the wandb, mlflow and trackio runs are kept in ``run_dir/trackers.json``: a resumed run continues
the same tracker runs. The steps a resume redoes are sent again: W&B plots against gspo's ``step`` (not its
own monotonic counter), so they land; MLflow and trackio keep both values in the step's history.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import json
import math
import os
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from gspo.config import ConfigError
from gspo.config.values import shown
from gspo.files import replace_file, run_path, run_tree
from gspo.workers import Workers

TENSORBOARD_DIR = "tensorboard"
TRACKERS_FILE = "trackers.json"
"""The ids of the run's tracker runs, by tracker name: a resume continues them."""

PACKAGES = {"tensorboard": ("tensorboard", "train"), "wandb": ("wandb", "wandb")}
PACKAGES |= {"mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio")}
"""Tracker -> (the module it imports, gspo's extra that installs it)."""

SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward")
"""The columns of the completions table (one row per sampled completion)."""

_warned_no_tensorboard = False


class Tracker(Protocol):
    run_id: str | None
    """What `open_trackers` stores to continue this tracker run on resume (None: nothing to store)."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """``values``: "train/<name>" or "eval/<name>" -> a number (None already left out)."""

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """One table of completions, rows with `SAMPLE_COLUMNS`; trackers without tables ignore it."""

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """End the tracker run; ``summary``: the run's final numbers and ``summary.md``'s text, if it ended."""


def check_installed(report_to: Sequence[str]) -> None:
    """Raise ImportError (gspo's exit code 9) naming the extra to install for each tracker that is missing;
    tensorboard, the default, only warns when the logger opens."""
    for name in report_to:
        module, extra = PACKAGES[name]
        if name != "tensorboard" and importlib.util.find_spec(module) is None:
            raise ImportError(
                f"report_to names {name}, but the {module} package is not installed: "
                f"pip install 'gspo[{extra}]' (or remove {name} from report_to)"
            )


def open_trackers(
    run_dir: Path,
    report_to: Sequence[str],
    *,
    config: Mapping[str, Any] | None,
    project: str,
    resume_step: int | None,
    workers: Workers | None = None,
) -> list[Tracker]:
    """Open each tracker of ``report_to`` for ``run_dir``, continuing the runs ``trackers.json`` names, and
    store the ids of the runs opened. ``workers``: the run's threads (gspo.workers), in which each tracker
    starts (None: threads of this call's own)."""
    check_installed(report_to)
    ids_path = run_path(run_dir, TRACKERS_FILE)
    ids = read_ids(ids_path)
    opened: list[Tracker] = []
    for name in report_to:
        if name == "tensorboard":
            tracker = TensorBoardTracker.open(run_dir, resume_step)
            if tracker is not None:
                opened.append(tracker)
            continue
        tracker_class = {"wandb": WandbTracker, "mlflow": MlflowTracker, "trackio": TrackioTracker}[name]
        start = functools.partial(tracker_class, run_dir, project, dict(config or {}), ids.get(name))
        tracker = started(name, start, workers)
        ids[name] = tracker.run_id
        opened.append(tracker)
    if set(ids) & set(report_to) - {"tensorboard"}:
        replace_file(ids_path, json.dumps(ids, indent=1) + "\n")
    return opened


class TrackerError(ConfigError):
    """A tracker of report_to could not start its run (no key, no server, a bad URI), or did not answer in
    time; the message says which and the fix, with any credentials in a URL left out."""


class TrackersFileError(RuntimeError):
    """RUN/trackers.json is not the file gspo writes (tampered or damaged): a run folder's error."""


TRACKER_TIMEOUT = 60.0
"""Seconds a tracker may take to start its run. W&B waited 109 s for a server it could not reach, MLflow
retried for 258 s: a tracker that does not answer by then stops the run with one line instead."""

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

FIXES = {
    "wandb": "set WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline for a local run",
    "mlflow": "check MLFLOW_TRACKING_URI (sqlite:///mlflow.db for a local store)",
    "trackio": "check TRACKIO_DIR",
}
"""What to check when a tracker cannot start, besides removing it from report_to."""


def read_ids(path: Path) -> dict[str, str]:
    """The tracker run ids trackers.json holds ({} without one); a file gspo did not write so (JSON that is
    not a mapping of tracker names to run ids) is a TrackersFileError naming it."""
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:
        raise TrackersFileError(_damaged(path, f"not JSON: {str(error)[:100]}")) from None
    if not isinstance(ids, dict):
        raise TrackersFileError(_damaged(path, f"a {type(ids).__name__}, not a mapping"))
    for name, run_id in ids.items():
        if name not in PACKAGES or name == "tensorboard":
            raise TrackersFileError(_damaged(path, f"{shown(name)} is no tracker of report_to"))
        if not (isinstance(run_id, str) and _RUN_ID.fullmatch(run_id)):
            raise TrackersFileError(_damaged(path, f"{name}'s run id {shown(run_id)} is not a run id"))
    return ids


def _damaged(path: Path, why: str) -> str:
    return (
        f"{path} is not the trackers file gspo writes ({why}): restore it, or delete it to continue in new "
        "tracker runs"
    )


def started(name: str, start: Callable[[], Tracker], workers: Workers | None = None) -> Tracker:
    """``start()`` (a tracker's run, opened), within `TRACKER_TIMEOUT` seconds; its failure, or its silence,
    as one TrackerError line with any URL's credentials left out (`redact`). The call runs in a thread of
    ``workers`` (the run's; None: one of this call's own) and is left behind at the deadline (a tracker's
    retries cannot be stopped from outside): a daemon, it ends with the process, which stops with the
    error."""
    own = workers is None
    workers = workers or Workers("tracker start")
    stage = workers.stage(f"{name}-start")
    future = stage.submit(start)
    try:
        done, _ = concurrent.futures.wait([future], TRACKER_TIMEOUT)  # a Ctrl-C while waiting: raised here
    finally:
        if not future.done():
            stage.replace()  # the stuck start is left behind
        if own:
            workers.close(timeout=0)
    outcome: list[Any] = [future.exception() or future.result()] if done else []
    fix = f"{FIXES[name]}, or remove {name} from report_to"
    if not outcome:
        raise TrackerError(f"report_to: {name} did not start its run within {TRACKER_TIMEOUT:g} s: {fix}")
    if isinstance(outcome[0], BaseException):
        error = outcome[0]
        message = " ".join(str(error).split())[:300]
        raise TrackerError(
            redact(f"report_to: {name} could not start its run ({type(error).__name__}: {message}): {fix}")
        )
    return outcome[0]


_CREDENTIALS = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/\s@:]*)(:(?P<password>[^/\s@]*))?@"
)
_SECRET_VARIABLE = re.compile(r"(KEY|TOKEN|PASSWORD|SECRET)$")


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it left out ("http://alice:PASSWORD@host" becomes
    "http://***@host"), and every secret of the environment: the password of a URL a variable holds and the
    value of a variable named *KEY, *TOKEN, *PASSWORD or *SECRET, wherever a library's message puts them
    (MLflow split a databricks:// URI's password into its advice)."""
    text = _CREDENTIALS.sub(r"\g<scheme>***@", text)
    for secret in sorted(_environment_secrets(), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _environment_secrets() -> set[str]:
    found = set()
    for name, value in os.environ.items():
        if _SECRET_VARIABLE.search(name.upper()) and len(value) >= 8:  # shorter: "none", "1", placeholders
            found.add(value)
        found |= {
            m["password"] for m in _CREDENTIALS.finditer(value) if m["password"] and len(m["password"]) >= 3
        }
    return found


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train.lr": 1e-05, ...}: the nested config as dotted keys (MLflow's params are flat)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _drop_writer_thread_tracebacks() -> None:
    """TensorBoard's writer thread keeps what failed it (a run folder removed or turned read-only) for the
    writer's next call, which raises it in the run's own thread (and the run stops with one line), then
    raises it again itself, which Python prints as a second, thread's traceback: that one is dropped. Every
    other thread's failure is shown as before. Installed over whatever hook is there (a test's own)."""
    previous = threading.excepthook
    if getattr(previous, "drops_writer_threads", False):
        return

    def hook(args: Any) -> None:
        kept = getattr(args.thread, "exception", None) is args.exc_value  # kept for the writer's next call
        if not (kept and type(args.thread).__module__.startswith("tensorboard.")):
            previous(args)

    hook.drops_writer_threads = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorBoardTracker:
    run_id = None

    def __init__(self, writer: Any):
        self.writer = writer

    @classmethod
    def open(cls, run_dir: Path, resume_step: int | None) -> TensorBoardTracker | None:
        global _warned_no_tensorboard
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            if not _warned_no_tensorboard:
                warnings.warn(
                    "tensorboard is not installed, so metrics go to metrics.jsonl only; "
                    "`pip install tensorboard` to get TensorBoard event files",
                    stacklevel=4,
                )
                _warned_no_tensorboard = True
            return None
        # purge_step makes TensorBoard discard the killed run's events after the checkpoint.
        purge_step = None if resume_step is None else resume_step + 1
        writer = SummaryWriter(log_dir=str(run_tree(run_dir, TENSORBOARD_DIR)), purge_step=purge_step)
        _drop_writer_thread_tracebacks()
        return cls(writer)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        pass  # TensorBoard has no tables

    def close(self, summary: Mapping[str, Any] | None) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any], run_id: str | None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            name=run_dir.name,
            dir=str(run_path(run_dir, "wandb").parent),  # W&B writes into run_dir/wandb
            id=run_id,
            resume="must" if run_id else None,
            reinit="create_new",  # several runs in one process (tests, notebooks) stay apart
        )
        self.run_id = self.run.id
        self.run.config.update(config, allow_val_change=True)  # a resume may change RESUMABLE keys
        # gspo's step is the x axis: a resume re-logs the steps after its checkpoint, which W&B's own
        # monotonic step would drop
        self.run.define_metric("step")
        for kind in ("train", "eval", "samples"):
            self.run.define_metric(f"{kind}/*", step_metric="step")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({**values, "step": step})

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = self.wandb.Table(
            columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows]
        )
        self.run.log({"samples/completions": table, "step": step})

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if summary:
            self.run.summary.update(dict(summary))
        self.run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any], run_id: str | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient()  # MLFLOW_TRACKING_URI, else MLflow's default store
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            # params cannot change once logged: the first config goes there, every resume's into config.json
            params = [Param(k, str(v)[:6000]) for k, v in flat_config(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a call
                self.client.log_batch(run_id, params=params[start : start + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.client.log_dict(run_id, config, "config.json")
        self.run_id = run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = _millis()
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns = {c: [r[c] for r in rows] for c in SAMPLE_COLUMNS}
        self.client.log_table(self.run_id, columns, f"completions/step_{step:06d}.json")

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if summary:
            text = summary.get("summary_md")
            if text:
                self.client.log_text(self.run_id, text, "summary.md")
            for key, value in summary.items():
                if key != "summary_md":
                    self.client.set_tag(self.run_id, f"summary.{key}", str(value))
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any], run_id: str | None):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=project,
            name=run_id or run_dir.name,
            config=config,
            resume="must" if run_id else "never",
            embed=False,  # no dashboard opened in a notebook: `trackio show` opens it
            auto_log_cpu=False,  # gspo logs its own timings; no sampling thread beside training
            auto_log_gpu=False,
        )
        self.run_id = self.run.name

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = self.trackio.Table(
            columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows]
        )
        self.run.log({"samples/completions": table}, step=step)

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if summary:
            numbers = {f"summary/{k}": v for k, v in summary.items() if isinstance(v, (int, float))}
            numbers = {k: v for k, v in numbers.items() if math.isfinite(v)}
            if numbers:
                self.run.log(numbers, step=summary.get("steps"))
        self.run.finish()


def _millis() -> int:
    import time

    return int(time.time() * 1000)
