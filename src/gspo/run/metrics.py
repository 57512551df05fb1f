"""Training metrics: one JSON object per line in ``run_dir/metrics.jsonl``, mirrored to the trackers of
``report_to`` (TensorBoard by default; gspo.run.trackers).

Each line is ``{"step": int, "kind": "train" | "eval", <key>: float | int | null, ...}``. The file is the
source of truth: plots and the summary (``gspo.training.plots``) are drawn from it, and a resumed run rewrites it
to the lines at or before its checkpoint's step, so that a run killed and resumed ends with exactly the
lines of an uninterrupted one; the lines it drops are appended to ``metrics.rolled_back.jsonl``.
``completions.jsonl`` keeps sampled completions the same way, one line each (``{"step", "prompt",
"completion", "reward"}``), at most ``completions_per_step`` per step.

Deliberate choices:
- Non-finite floats are written as ``null``: ``NaN`` is not valid JSON and breaks other readers (jq, pandas
  with the strict parser). The trackers get the raw value.
- Every line is flushed to the OS when it is written, so a SIGKILL loses at most that line;
  ``read_metrics`` skips a truncated last line.
- TensorBoard is optional: without the ``tensorboard`` package the logger warns once and writes JSONL only;
  a tracker named in ``report_to`` whose package is missing is an error (gspo.run.trackers).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gspo.learning.reduction import tensors_to_floats
from gspo.run.paths import run_path
from gspo.run.trackers import SAMPLE_COLUMNS, Tracker, open_trackers

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
"""Sampled completions, at most `completions_per_step` lines per step (`MetricsLogger.log_samples`)."""
KINDS = ("train", "eval")


class MetricsError(ValueError):
    """A metrics file that gspo did not write as it is (a line that is not a metrics record)."""


def metrics_path(run_dir: str | Path) -> Path:
    """``run_dir/metrics.jsonl``; a path that already names a ``.jsonl`` file is returned as is."""
    path = Path(run_dir)
    return path if path.suffix == ".jsonl" else run_path(path, METRICS_FILE)


def _to_python(values: Mapping[str, Any]) -> dict[str, float | int | None]:
    """Tensors -> float (one sync), bools and integers -> int, other reals -> float, None kept."""
    out: dict[str, float | int | None] = {}
    tensor_keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    try:
        tensor_values = tensors_to_floats([values[k] for k in tensor_keys])
    except ValueError as e:
        bad = [k for k in tensor_keys if values[k].numel() != 1]
        raise ValueError(f"metrics {bad}: {e}") from None
    converted = dict(zip(tensor_keys, tensor_values, strict=True))
    for key, value in values.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be str, got {key!r}")
        if key in converted:
            out[key] = converted[key]
        elif value is None:
            out[key] = None
        elif isinstance(value, numbers.Integral):
            out[key] = int(value)
        elif isinstance(value, numbers.Real):
            out[key] = float(value)
        else:
            raise TypeError(f"metric {key!r} must be a number or a tensor, got {type(value).__name__}")
    return out


def _json_value(value: float | int | None) -> float | int | None:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json_row_value(value: Any) -> Any:
    """A completion row's value for JSON: a non-finite reward as null (metrics' rule), text as it is."""
    return _json_value(float(value)) if isinstance(value, numbers.Real) else value


def _prepare_file(run_dir: Path, name: str, resume_step: int | None) -> None:
    """Drop a truncated last line of ``run_dir/name``, and on resume the lines after ``resume_step``
    (appended to ``name``'s ``.rolled_back.jsonl``), atomically."""
    path = run_path(run_dir, name)
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8")
    if resume_step is None and (not text or text.endswith("\n")):
        return
    records = _parse_lines(text, path)
    kept = [line for line, record in records if resume_step is None or record["step"] <= resume_step]
    dropped = [line for line, record in records if resume_step is not None and record["step"] > resume_step]
    if dropped:  # kept aside, not deleted: they may be all that is left of a run's later steps
        aside = run_path(run_dir, name.replace(".jsonl", ".rolled_back.jsonl"))
        with open(aside, "a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in dropped))
            handle.flush()
            os.fsync(handle.fileno())
        print(
            f"note: {path}: {len(dropped)} line(s) after step {resume_step}, the checkpoint resumed, "
            f"appended to {aside}",
            file=sys.stderr,
        )
    tmp = run_path(run_dir, name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _parse_lines(text: str, path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(raw line, record) for each complete line of a metrics file.

    The last line may be cut short by a kill mid-write: it is dropped if it does not parse. Any other
    line that does not parse is corruption, not an interrupted write, and raises.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    records: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply for json
            if number == len(lines):
                break  # truncated by a kill mid-write
            why = str(e) if isinstance(e, ValueError) else "nested too deeply"
            raise MetricsError(
                f"{path}: line {number} is not a metrics line ({why}): {line[:100]!r}; gspo writes one JSON "
                "object per line: restore the file or remove the line"
            ) from None
        records.append((line, record))
    return records


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``run_dir/metrics.jsonl`` in file order; a truncated last line is skipped.

    >>> read_metrics("runs/demo")  # doctest: +SKIP
    [{'step': 1, 'kind': 'train', 'reward_mean': 0.25, ...}, {'step': 1, 'kind': 'eval', 'accuracy': 0.2}]
    """
    path = metrics_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    return [record for _, record in _parse_lines(path.read_text(encoding="utf-8"), path)]


class MetricsLogger:
    """Appends metric records to ``run_dir/metrics.jsonl`` and sends them to the trackers of ``report_to``.

    ``resume_step``: when resuming from the checkpoint taken at that step, the lines logged after it by the
    killed run are dropped first (train and eval alike), TensorBoard purges its events after it, and the
    other trackers continue their runs (gspo.run.trackers). ``config``: the resolved config, as a
    mapping, for the trackers; ``project``: their project (W&B, trackio) or experiment (MLflow).

    >>> with MetricsLogger("runs/demo") as logger:  # doctest: +SKIP
    ...     logger.log(1, {"loss": torch.tensor(0.5), "lr": 1e-5})
    ...     logger.log(1, {"accuracy": 0.2}, kind="eval")
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        report_to: Sequence[str] = ("tensorboard",),
        config: Mapping[str, Any] | None = None,
        project: str = "gspo",
        resume_step: int | None = None,
        completions_per_step: int = 0,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_path(self.run_dir, METRICS_FILE)
        self.completions_path = run_path(self.run_dir, COMPLETIONS_FILE)
        self.completions_per_step = completions_per_step
        for name in (METRICS_FILE, COMPLETIONS_FILE):  # both end at the step resumed, as if never killed
            _prepare_file(self.run_dir, name, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._completions: Any = None  # opened by the first completions written
        self._trackers: list[Tracker] = open_trackers(
            self.run_dir, report_to, config=config, project=project, resume_step=resume_step
        )

    def log(
        self, step: int, metrics: Mapping[str, float | int | torch.Tensor], *, kind: str = "train"
    ) -> None:
        """Write one line ``{"step", "kind", **metrics}`` and flush it; tensors must have one element."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int, got {step!r}")
        step = int(step)
        reserved = {"step", "kind"} & set(metrics)
        if reserved:
            raise ValueError(f"metric names {sorted(reserved)} are reserved")
        values = _to_python(metrics)
        record = {"step": step, "kind": kind, **{k: _json_value(v) for k, v in values.items()}}
        # One write per line, flushed at once: a kill leaves whole lines plus at most one partial line.
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        named = {f"{kind}/{key}": value for key, value in values.items() if value is not None}
        for tracker in self._trackers:
            tracker.log(step, named)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A step's completions, rows of gspo.run.trackers.SAMPLE_COLUMNS: the first
        ``completions_per_step`` as lines of ``run_dir/completions.jsonl`` (flushed, as metrics), and all
        of them as a table for the trackers that have tables; metrics.jsonl holds numbers only."""
        kept = rows[: self.completions_per_step]
        if kept:
            if self._completions is None:
                self._completions = open(self.completions_path, "a", encoding="utf-8")  # noqa: SIM115
            lines = [
                json.dumps(
                    {"step": int(step), **{c: _json_row_value(row[c]) for c in SAMPLE_COLUMNS if c != "step"}}
                )
                for row in kept
            ]
            self._completions.write("".join(line + "\n" for line in lines))
            self._completions.flush()
        for tracker in self._trackers:
            tracker.log_samples(step, rows)

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        """Close the files and end the tracker runs; ``summary``: the finished run's numbers and summary
        text for the trackers (None: the run stopped, e.g. `gspo serve` shutting down)."""
        for handle in (self._file, self._completions):
            if handle is not None and not handle.closed:
                handle.close()
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close(summary)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SilentLogger:
    """The logger of ranks other than 0: every rank computes the (reduced) metrics, one writes them."""

    def log(self, step: int, metrics: Any, kind: str = "train") -> None:
        pass

    def log_samples(self, step: int, rows: Any) -> None:
        pass

    def close(self, summary: Any = None) -> None:
        pass
