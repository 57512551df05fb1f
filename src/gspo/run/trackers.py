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

import importlib.util
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from gspo.run.paths import run_path, run_tree

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
) -> list[Tracker]:
    """Open each tracker of ``report_to`` for ``run_dir``, continuing the runs ``trackers.json`` names, and
    store the ids of the runs opened."""
    check_installed(report_to)
    ids_path = run_path(run_dir, TRACKERS_FILE)
    ids = json.loads(ids_path.read_text(encoding="utf-8")) if ids_path.is_file() else {}
    opened: list[Tracker] = []
    for name in report_to:
        if name == "tensorboard":
            tracker = TensorBoardTracker.open(run_dir, resume_step)
            if tracker is not None:
                opened.append(tracker)
            continue
        tracker_class = {"wandb": WandbTracker, "mlflow": MlflowTracker, "trackio": TrackioTracker}[name]
        tracker = tracker_class(run_dir, project, dict(config or {}), ids.get(name))
        ids[name] = tracker.run_id
        opened.append(tracker)
    if set(ids) & set(report_to) - {"tensorboard"}:
        tmp = ids_path.with_name(ids_path.name + ".tmp")
        tmp.write_text(json.dumps(ids, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, ids_path)
    return opened


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train.lr": 1e-05, ...}: the nested config as dotted keys (MLflow's params are flat)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


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
        return cls(SummaryWriter(log_dir=str(run_tree(run_dir, TENSORBOARD_DIR)), purge_step=purge_step))

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
