"""Metrics logging (JSONL, TensorBoard), plots and summary of gspo.run.metrics / gspo.training.plots."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

import gspo.run.trackers as trackers_module
from gspo.run.metrics import MetricsLogger, read_metrics
from gspo.training.plots import plot_run, write_summary


def _lines(run_dir) -> list[str]:
    return (run_dir / "metrics.jsonl").read_text().splitlines()


def test_log_writes_exact_jsonl_lines(tmp_path):
    with MetricsLogger(tmp_path, report_to=()) as logger:
        logger.log(1, {"loss": torch.tensor(0.5), "lr": 1e-5, "zero_std_groups": 2})
        logger.log(1, {"accuracy": 0.25, "reward_mean": torch.tensor(float("nan"))}, kind="eval")
        logger.log(
            2,
            {
                "reward/numeric": torch.tensor(0.75, dtype=torch.float64),
                "kl": float("inf"),
                "grad_norm": torch.tensor([3.0]),
                "truncated_frac": torch.tensor(1, dtype=torch.int64),
            },
        )
    assert _lines(tmp_path) == [
        '{"step": 1, "kind": "train", "loss": 0.5, "lr": 1e-05, "zero_std_groups": 2}',
        '{"step": 1, "kind": "eval", "accuracy": 0.25, "reward_mean": null}',
        '{"step": 2, "kind": "train", "reward/numeric": 0.75, "kl": null, "grad_norm": 3.0, '
        '"truncated_frac": 1.0}',
    ]
    assert read_metrics(tmp_path)[1] == {"step": 1, "kind": "eval", "accuracy": 0.25, "reward_mean": None}


def test_log_flushes_each_line_before_close(tmp_path):
    logger = MetricsLogger(tmp_path, report_to=())
    logger.log(3, {"loss": 1.0})
    assert _lines(tmp_path) == ['{"step": 3, "kind": "train", "loss": 1.0}']
    logger.close()
    logger.close()  # idempotent


def test_log_rejects_bad_input(tmp_path):
    with MetricsLogger(tmp_path, report_to=()) as logger:
        with pytest.raises(ValueError, match="kind"):
            logger.log(1, {"loss": 1.0}, kind="rollout")
        with pytest.raises(ValueError, match="loss"):
            logger.log(1, {"loss": torch.ones(2)})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 1.0})
    assert _lines(tmp_path) == []


def test_resume_step_keeps_exactly_lines_up_to_the_checkpoint(tmp_path):
    def log_step(logger, step):
        logger.log(step, {"loss": float(step)})
        if step % 2 == 0:
            logger.log(step, {"accuracy": step / 10}, kind="eval")

    with MetricsLogger(tmp_path / "full", report_to=()) as logger:
        for step in range(1, 7):
            log_step(logger, step)

    # Killed after step 5 (mid-write of a line), resumed from the checkpoint of step 4.
    with MetricsLogger(tmp_path / "killed", report_to=()) as logger:
        for step in range(1, 6):
            log_step(logger, step)
    with open(tmp_path / "killed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "kind": "tr')
    with MetricsLogger(tmp_path / "killed", report_to=(), resume_step=4) as logger:
        assert [(r["step"], r["kind"]) for r in read_metrics(tmp_path / "killed")] == [
            (1, "train"),
            (2, "train"),
            (2, "eval"),
            (3, "train"),
            (4, "train"),
            (4, "eval"),
        ]
        for step in range(5, 7):
            log_step(logger, step)
    assert _lines(tmp_path / "killed") == _lines(tmp_path / "full")


def _rows(step: int, count: int) -> list[dict]:
    return [
        {"step": step, "prompt": f"p{i // 2}", "completion": f"c{i}", "reward": i / 2} for i in range(count)
    ]


def test_completions_are_kept_per_step_up_to_the_bound_and_roll_back_with_a_resume(tmp_path):
    """RUN/completions.jsonl holds the first `completions_per_step` completions of each step (gspo train's
    rollouts and gspo serve's train calls both log them here); a resume drops the later steps' lines into
    completions.rolled_back.jsonl, as metrics.jsonl's; 0 writes no file."""
    with MetricsLogger(tmp_path, report_to=(), completions_per_step=3) as logger:
        for step in (1, 2, 3):
            logger.log_samples(step, _rows(step, 4 + step))
        logger.log_samples(
            4, [*_rows(4, 2), {"step": 4, "prompt": "p", "completion": "c", "reward": float("nan")}]
        )
    lines = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert json.loads(lines[1]) == {"step": 1, "prompt": "p0", "completion": "c1", "reward": 0.5}
    assert json.loads(lines[-1])["reward"] is None  # NaN is not JSON: null, as in metrics.jsonl
    with MetricsLogger(tmp_path, report_to=(), resume_step=2, completions_per_step=3):
        pass
    assert (tmp_path / "completions.jsonl").read_text().splitlines() == lines[:6]
    assert (tmp_path / "completions.rolled_back.jsonl").read_text().splitlines() == lines[6:]
    with MetricsLogger(tmp_path / "off", report_to=(), completions_per_step=0) as logger:
        logger.log_samples(1, _rows(1, 4))
    assert not (tmp_path / "off" / "completions.jsonl").exists()


def test_truncated_last_line_is_skipped_and_repaired_on_append(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "loss": 1.0}\n{"step": 2, "kind": "train", "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "kind": "train", "loss": 1.0}]
    with MetricsLogger(tmp_path, report_to=()) as logger:
        logger.log(2, {"loss": 2.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_corrupt_middle_line_raises(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "kind": "train"}\nnot json\n{"step": 2, "kind": "train"}\n'
    )
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2 is not a metrics line"):
        read_metrics(tmp_path)


def test_a_step_past_64_bits_is_not_a_metrics_line(tmp_path, capsys):
    """`gspo plot` keeps steps in 64-bit arrays: a step of 2**64 was an OverflowError traceback."""
    from gspo.cli import EXIT_CODES, main

    (tmp_path / "metrics.jsonl").write_text(
        f'{{"step": 1, "kind": "train", "loss": 1}}\n{{"step": {2**64}, "kind": "train", "loss": 1}}\n'
        '{"step": 3, "kind": "train", "loss": 1}\n'
    )
    assert main(["plot", str(tmp_path)]) == EXIT_CODES["run folder"]
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "line 2 is not a metrics line (not an object with an integer 'step')" in err
    )


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"loss": torch.tensor(0.5), "reward/numeric": 0.25})
        logger.log(2, {"loss": 0.125, "kl": None})
        logger.log(2, {"accuracy": 0.75}, kind="eval")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert sorted(scalars) == ["eval/accuracy", "train/loss", "train/reward/numeric"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.125)]
    assert [(e.step, e.value) for e in events.Scalars("train/reward/numeric")] == [(1, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(2, 0.75)]


def test_resume_purges_tensorboard_events_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 7):
            logger.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path, resume_step=4) as logger:
        for step in range(5, 7):
            logger.log(step, {"loss": 10.0 * step})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    expected = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == expected


def test_a_run_folder_removed_under_the_logger_is_one_disk_line_and_no_thread_traceback(
    tmp_path, monkeypatch
):
    """A line written into a removed folder's metrics.jsonl (open already) was lost without an error, and
    TensorBoard's writer thread printed a traceback of its own before the run's error."""
    import shutil
    import threading

    from gspo.cli import classify
    from gspo.files import RunFolderGone

    thread_failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: thread_failures.append(args.exc_value))
    run = tmp_path / "run"
    for report_to in ((), ("tensorboard",)):  # the file alone: its writes would succeed, and be lost
        logger = MetricsLogger(run, report_to=report_to)
        logger.log(1, {"loss": 0.5})
        shutil.rmtree(run)
        with pytest.raises(RunFolderGone) as stopped:
            logger.log(2, {"loss": 0.4})
        kind, line = classify(stopped.value, "train")
        assert kind == "disk" and line.startswith(f"the run folder {run} was removed, moved or replaced"), (
            line
        )
    # removed between gspo's check and TensorBoard's write: its thread fails, and the run's thread says so
    writer = logger._trackers[0].writer
    with pytest.raises(OSError):
        logger._trackers[0].log(3, {"train/loss": 0.3})
    writer.file_writer.event_writer._async_writer._worker.join(10)
    assert thread_failures == []


def test_missing_tensorboard_warns_once_and_logs_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(trackers_module, "_warned_no_tensorboard", False)
    with pytest.warns(UserWarning, match="pip install tensorboard"):
        first = MetricsLogger(tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = MetricsLogger(tmp_path / "b")
    for logger in (first, second):
        logger.log(1, {"loss": 1.0})
        logger.close()
    assert not (tmp_path / "a" / "tensorboard").exists()
    assert read_metrics(tmp_path / "b") == [{"step": 1, "kind": "train", "loss": 1.0}]


def _synthetic_run(run_dir, *, kl: bool, evals: bool = True) -> None:
    with MetricsLogger(run_dir, report_to=()) as logger:
        for step in range(1, 7):
            train = {
                "reward_mean": 0.1 * step,
                "reward_std": 0.2,
                "reward/numeric": 0.1 * step,
                "reward/format": 0.9,
                "loss": -0.01 * step,
                "clip_frac_token": 0.1,
                "clip_frac_token_low": 0.04,
                "clip_frac_token_high": 0.06,
                "clip_frac_seq": 0.2,
                "ratio_seq_mean": 1.0,
                "ratio_seq_min": 0.999,
                "ratio_seq_max": 1.001,
                "ratio_token_mean": 1.0,
                "ratio_token_min": 0.9,
                "ratio_token_max": 1.1,
                "log_ratio_abs_mean": 0.01,
                "grad_norm": 1.5,
                "lr": 1e-5,
                "completion_len_mean": 12.0,
                "truncated_frac": 0.0,
                "time_rollout": 2.0,
                "time_old_logprobs": 0.5,
                "time_update": 1.5,
            }
            if kl:
                train["kl"] = 0.001 * step
            logger.log(step, train)
            if evals and step % 3 == 0:
                logger.log(step, {"accuracy": 0.05 * step, "reward_mean": 0.3}, kind="eval")


def test_plot_run_writes_one_png_per_present_group(tmp_path):
    _synthetic_run(tmp_path / "with_kl", kl=True)
    _synthetic_run(tmp_path / "no_kl", kl=False)
    groups = ["reward", "clip_fractions", "ratios", "kl", "completion_lengths", "loss", "lr"]
    written = plot_run(tmp_path / "with_kl")
    assert written == [tmp_path / "with_kl" / "plots" / f"{g}.png" for g in groups]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.stem for p in plot_run(tmp_path / "no_kl")] == [g for g in groups if g != "kl"]
    assert sorted(p.name for p in (tmp_path / "no_kl" / "plots").iterdir()) == sorted(
        f"{g}.png" for g in groups if g != "kl"
    )


def test_plot_run_without_matplotlib_names_the_install_command(tmp_path, monkeypatch):
    _synthetic_run(tmp_path, kl=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_run(tmp_path)


def test_write_summary_reports_first_last_best_accuracy_and_totals(tmp_path):
    _synthetic_run(tmp_path, kl=False)
    text = write_summary(tmp_path)
    assert (tmp_path / "summary.md").read_text() == text
    assert "- Rollout batches (or gspo serve train calls) trained: 6, steps 1 to 6" in text
    assert "Eval accuracy: first 0.1500 (step 3), last 0.3000 (step 6), best 0.3000 (step 6)" in text
    assert "Train reward mean: first 0.1000 (step 1), last 0.6000 (step 6)" in text
    assert "clip_frac_seq 0.2000" in text
    assert "clip_frac_token 0.1000" in text
    assert "Total time: 24.0 s (old_logprobs 3.0 s, rollout 12.0 s, update 9.0 s)" in text


def test_write_summary_without_eval_lines(tmp_path):
    _synthetic_run(tmp_path, kl=False, evals=False)
    text = write_summary(tmp_path)
    assert "Eval accuracy: no eval lines" in text
    assert "Train reward mean: first 0.1000 (step 1), last 0.6000 (step 6)" in text


def test_read_metrics_round_trips_json(tmp_path):
    with MetricsLogger(tmp_path, report_to=()) as logger:
        logger.log(7, {"x": 1.5})
    assert json.loads(_lines(tmp_path)[0]) == read_metrics(tmp_path / "metrics.jsonl")[0]


def test_plot_reads_metrics_as_a_stream_in_bounded_memory(tmp_path, capsys):
    """`gspo plot` of 400,000 lines held every record (148 s and 4.5 GB): now one line at a time, each
    plotted line thinned to at most 2 x POINTS_MAX points, the summary kept as sums and extremes."""
    import tracemalloc

    from gspo.cli import main
    from gspo.training.plots import POINTS_MAX, scan_run

    steps = 100_000
    with open(tmp_path / "metrics.jsonl", "w") as out:
        for step in range(1, steps + 1):
            values = {"reward_mean": step / steps, "loss": 1.0, "clip_frac_seq": 0.5, "time_update": 0.01}
            out.write(json.dumps({"step": step, "kind": "train", **values, "padding": "x" * 400}) + "\n")
            if step % 100 == 0:
                out.write(json.dumps({"step": step, "kind": "eval", "accuracy": step / steps}) + "\n")
    tracemalloc.start()
    try:
        scan = scan_run(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # the file is 45 MB; holding its records took hundreds
    assert POINTS_MAX <= len(scan.lines["train", "reward_mean"].steps) < 2 * POINTS_MAX
    assert len(scan.lines["eval", "accuracy"].steps) == steps // 100  # below the ceiling: every point
    assert main(["plot", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "Rollout batches (or gspo serve train calls) trained: 100000, steps 1 to 100000" in summary
    assert "Eval accuracy: first 0.0010 (step 100), last 1.0000 (step 100000), best 1.0000" in summary
    assert "Total time: 1000.0 s (update 1000.0 s)" in summary


def test_a_metrics_line_past_the_ceiling_is_refused_as_it_is_read(tmp_path, capsys):
    """One 300 MB metrics line took 1.6 GB: a line longer than LINE_MAX is not gspo's, refused having
    read LINE_MAX bytes of it."""
    import tracemalloc

    from gspo.cli import EXIT_CODES, main
    from gspo.run.metrics import LINE_MAX, MetricsError
    from gspo.training.plots import scan_run

    with open(tmp_path / "metrics.jsonl", "w") as out:
        out.write(json.dumps({"step": 1, "kind": "train", "loss": 1.0}) + "\n")
        out.write(json.dumps({"step": 2, "kind": "train", "note": "a" * (40 * LINE_MAX)}) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(MetricsError, match=r"line 2 is longer than 1,048,576 bytes"):
            scan_run(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * LINE_MAX, peak
    assert main(["plot", str(tmp_path)]) == EXIT_CODES["run folder"]
    assert capsys.readouterr().err.count("\n") == 1


def test_the_summary_of_an_interrupted_run_names_the_checkpoint_resume_continues_from(two_step_run, tmp_path):
    """Stopped after logging step 3 but before its checkpoint: "trained: 3" alone read as if step 3 were
    kept; the summary says the latest checkpoint is step 2, from which --resume trains step 3 again."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    assert "- Latest checkpoint: step 2\n" in write_summary(run)
    with open(run / "metrics.jsonl", "a") as out:
        out.write(json.dumps({"step": 3, "kind": "train", "reward_mean": 0.5}) + "\n")
    text = write_summary(run)
    assert "trained: 3, steps 1 to 3" in text
    assert text.endswith(
        "- Latest checkpoint: step 2, which --resume continues from: steps 3 to 3 were logged but not kept, "
        "and train again\n"
    )
