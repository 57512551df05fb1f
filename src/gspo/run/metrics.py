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

import contextlib
import json
import math
import numbers
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gspo.files import check_still_there, folder_identity, open_for_appending, run_path
from gspo.learning.reduction import tensors_to_floats
from gspo.run.trackers import SAMPLE_COLUMNS, Tracker, open_trackers
from gspo.workers import Workers

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


LINE_MAX = 2**20
"""A metrics line's ceiling in bytes: gspo writes about 2 KB a line. A longer one is not gspo's, and is
refused as it is read, a MiB at most in memory (one line of 300 MB took 1.6 GB)."""
COMPLETIONS_LINE_MAX = 2**28
"""A completions line's ceiling in bytes: a prompt and a completion of up to TOKENS_MAX (2**20) tokens
each, JSON-escaped, fit in it."""


def _kept_lines(run_dir: Path, name: str, resume_step: int | None, line_max: int) -> Iterator[str]:
    """The lines of ``run_dir/name``, read as a stream, without a truncated last one, and on resume without
    the lines after ``resume_step``: those are appended to ``name``'s ``.rolled_back.jsonl`` first (a kill in
    between leaves them in both files, never in neither)."""
    path = run_path(run_dir, name)
    if not path.is_file():
        return iter(())
    if resume_step is not None:
        dropped = [line + "\n" for line, record in _records(path, line_max) if record["step"] > resume_step]
        if dropped:  # kept aside, not deleted: they may be all that is left of a run's later steps
            aside = run_path(run_dir, name.replace(".jsonl", ".rolled_back.jsonl"))
            with open_for_appending(aside, _lines_of(aside)) as handle:  # by replacement, as every write
                handle.writelines(dropped)
                handle.flush()
                os.fsync(handle.fileno())
            print(
                f"note: {path}: {len(dropped)} line(s) after step {resume_step}, the checkpoint resumed, "
                f"appended to {aside}",
                file=sys.stderr,
            )
    kept = (
        line
        for line, record in _records(path, line_max)
        if resume_step is None or record["step"] <= resume_step
    )
    return (line + "\n" for line in kept)


def _lines_of(path: Path) -> Iterator[str]:
    """The lines of a file of gspo's (the rolled-back lines), one at a time; none when it is absent."""
    if path.is_file():
        with open(path, encoding="utf-8", errors="replace") as handle:
            yield from handle


def _records(path: Path, line_max: int = LINE_MAX) -> Iterator[tuple[str, dict[str, Any]]]:
    """(raw line, record) for each complete line of a metrics (or completions) file, read as a stream.

    The last line may be cut short by a kill mid-write: it is dropped if it does not parse. Any other
    line that does not parse, or is longer than `line_max`, is corruption, not an interrupted write, and
    raises.
    """
    with open(path, "rb") as handle:
        for number, raw in enumerate(iter(lambda: handle.readline(line_max + 1), b""), start=1):
            if len(raw) > line_max:
                raise MetricsError(
                    f"{path}: line {number} is longer than {line_max:,} bytes, not a line gspo writes (about "
                    "2 KB a metrics line): restore the file or remove the line"
                )
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = record.get("step") if isinstance(record, dict) else None
                # 64 bits: the plots keep steps in arrays of them
                if not isinstance(step, int) or isinstance(step, bool) or not -(2**63) <= step < 2**63:
                    raise ValueError("not an object with an integer 'step'")
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply for json
                if not handle.peek(1):
                    return  # the last line, truncated by a kill mid-write
                why = str(e) if isinstance(e, ValueError) else "nested too deeply"
                raise MetricsError(
                    f"{path}: line {number} is not a metrics line ({why}): {line[:100]!r}; gspo writes one JSON "
                    "object per line: restore the file or remove the line"
                ) from None
            yield line, record


def iter_metrics(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` in file order, one at a time (memory: one line); a truncated
    last line is skipped."""
    path = metrics_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    return (record for _, record in _records(path))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``run_dir/metrics.jsonl`` in file order; a truncated last line is skipped.

    >>> read_metrics("runs/demo")  # doctest: +SKIP
    [{'step': 1, 'kind': 'train', 'reward_mean': 0.25, ...}, {'step': 1, 'kind': 'eval', 'accuracy': 0.2}]
    """
    return list(iter_metrics(run_dir))


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
        workers: Workers | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._identity = folder_identity(self.run_dir)  # a removed folder stops the run (`_checked`)
        self.path = run_path(self.run_dir, METRICS_FILE)
        self.completions_path = run_path(self.run_dir, COMPLETIONS_FILE)
        self.completions_per_step = completions_per_step
        # files of this process's own, renamed over the old ones (both end at the step resumed, as if never
        # killed): lines never go through a hard link planted there
        self._file = open_for_appending(
            self.path, _kept_lines(self.run_dir, METRICS_FILE, resume_step, LINE_MAX)
        )
        self._completions: Any = None  # opened by the first completions written, or now when there are some
        if self.completions_path.is_file():
            lines = _kept_lines(self.run_dir, COMPLETIONS_FILE, resume_step, COMPLETIONS_LINE_MAX)
            self._completions = open_for_appending(self.completions_path, lines)
        self._trackers: list[Tracker] = open_trackers(
            self.run_dir, report_to, config=config, project=project, resume_step=resume_step, workers=workers
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
        named = {f"{kind}/{key}": value for key, value in values.items() if value is not None}
        with self._checked():
            # One write per line, flushed at once: a kill leaves whole lines plus at most one partial line.
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
            for tracker in self._trackers:
                tracker.log(step, named)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A step's completions, rows of gspo.run.trackers.SAMPLE_COLUMNS: the first
        ``completions_per_step`` as lines of ``run_dir/completions.jsonl`` (flushed, as metrics), and all
        of them as a table for the trackers that have tables; metrics.jsonl holds numbers only."""
        with self._checked():
            self._log_samples(step, rows)

    def _log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        kept = rows[: self.completions_per_step]
        if kept:
            if self._completions is None:
                self._completions = open_for_appending(self.completions_path)
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
        with self._checked(before=False):
            for tracker in trackers:
                tracker.close(summary)

    @contextlib.contextmanager
    def _checked(self, *, before: bool = True) -> Iterator[None]:
        """The block's writes, into the run folder this logger opened: a folder removed meanwhile is a
        RunFolderGone line (checked first with `before`: a line written into a removed metrics.jsonl would
        be lost without an error), also when a write of the block fails because of it."""
        if before:
            check_still_there(self.run_dir, self._identity)
        try:
            yield
        except OSError as error:
            check_still_there(self.run_dir, self._identity, error)
            raise

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
