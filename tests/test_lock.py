"""One writer per run folder (gspo.run.lock): a second process is refused naming the holder, a lock
left by a SIGKILL is taken over with a note, readers need no lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gspo.cli import EXIT_CODES, main

LOCK_FILE = ".gspo_lock"  # the protocol: any process holding flock on this file owns the folder
ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
FAST = ["train.steps=1", "eval.every=0", "report_to=[]", "task.num_eval=4"]


def _holder(run: Path) -> subprocess.Popen:
    """Another process that takes `run`'s lock as gspo does (flock, a JSON record) and keeps it until killed."""
    code = (
        "import fcntl, json, os, socket, time\n"
        f"fd = os.open({str(run / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "record = {'pid': os.getpid(), 'host': socket.gethostname(), 'command': 'gspo train (the other one)', "
        "'since': 'now'}\n"
        "os.pwrite(fd, json.dumps(record).encode(), 0)\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def _gspo(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(
    tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    other = _holder(run)
    try:
        code, err = _gspo(capsys, "train", TINY, f"output_dir={run}", *FAST)
        assert code == EXIT_CODES["run folder"], err
        assert f"is in use by pid {other.pid} on " in err and "gspo train (the other one)" in err
        assert "Traceback" not in err and len(err.splitlines()) == 1
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # nothing written beside the lock
    finally:
        other.send_signal(signal.SIGKILL)  # no chance to release: the kernel drops the flock
        other.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == other.pid  # its record stays behind
    code, err = _gspo(capsys, "train", TINY, f"output_dir={run}", *FAST)
    assert code == 0, err
    assert f"the previous holder of its lock, pid {other.pid} on " in err and "ended without releasing" in err
    assert (run / LOCK_FILE).read_text() == ""  # released at the end of the run


def test_resume_plot_and_readers_while_another_process_trains_the_run(
    two_step_run: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    other = _holder(run)
    try:
        code, err = _gspo(capsys, "train", "--resume", str(run), "train.steps=3")
        assert code == EXIT_CODES["run folder"] and f"pid {other.pid}" in err
        code, err = _gspo(capsys, "plot", str(run))  # the run writes its plots itself when it ends
        assert code == EXIT_CODES["run folder"] and f"is being trained by pid {other.pid}" in err
        # readers take no lock: a checkpoint never changes once written, their files are their own
        code, err = _gspo(capsys, "export", str(run), "--format", "hf", "--output", str(tmp_path / "hf"))
        assert code == 0, err
        code, err = _gspo(capsys, "eval", str(run), "--output", str(tmp_path / "report.json"))
        assert code == 0, err
    finally:
        other.kill()
        other.wait()


def test_the_lock_is_reentrant_in_one_process_and_released_by_it(tmp_path: Path) -> None:
    from gspo.run import lock

    lock.acquire(tmp_path, "first")
    lock.acquire(tmp_path, "again")  # a Python session that trains, then resumes, the same run
    assert json.loads((tmp_path / LOCK_FILE).read_text())["command"] == "first"
    assert lock.holder_if_locked(tmp_path) is None  # it is ours
    lock.release(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == ""
    lock.release(tmp_path)  # no-op


@pytest.mark.slow  # two fresh processes of gspo train: about 40 s on 2 busy cores
def test_two_runs_started_at_once_on_one_folder_leave_one_consistent_run(tmp_path: Path) -> None:
    """The finding itself: both at once used to leave one run's config beside the other's checkpoint, or die
    on the other's temporary folder. Now one trains; the other is refused (in use, or a run already there)."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "gspo", "train", TINY, f"output_dir={run}", *FAST, "progress=false"]
    processes = [
        subprocess.Popen(argv, env=ENV, stderr=subprocess.PIPE, text=True, cwd=tmp_path) for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in processes]
    codes = sorted(code for code, _ in results)
    assert codes == [0, EXIT_CODES["run folder"]], results
    refused = next(err for code, err in results if code)
    assert "is in use by " in refused or "already holds a run" in refused
    assert "Traceback" not in refused
    from gspo.run.metrics import read_metrics

    evals = [r["step"] for r in read_metrics(run) if r["kind"] == "eval"]
    assert evals == [0, 1]


def test_a_lock_record_cut_short_is_not_a_crash(tmp_path: Path) -> None:
    from gspo.run import lock
    from gspo.run.lock import RunInUse

    (tmp_path / LOCK_FILE).write_text('{"pid": 12')  # a holder killed while writing its record
    lock.acquire(tmp_path, "me")
    lock.release(tmp_path)
    other = _holder(tmp_path)
    try:
        with pytest.raises(RunInUse, match=rf"in use by pid {other.pid}"):
            lock.acquire(tmp_path, "me")
    finally:
        other.kill()
        other.wait()


def test_a_holder_that_has_just_locked_is_named_once_it_writes_its_record(tmp_path: Path) -> None:
    """The race CI met: two runs at once, the second refused between the first's flock and its record."""
    from gspo.run import lock
    from gspo.run.lock import RunInUse

    code = (
        "import fcntl, json, os, time\n"
        f"fd = os.open({str(tmp_path / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('locked', flush=True)\n"
        "time.sleep(0.15)\n"
        "os.pwrite(fd, json.dumps({'pid': os.getpid(), 'host': 'h', 'command': 'late', 'since': 'now'}).encode(), 0)\n"
        "time.sleep(600)\n"
    )
    other = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        with pytest.raises(RunInUse, match=rf"in use by pid {other.pid} on h \(`late`"):
            lock.acquire(tmp_path, "me")
    finally:
        other.kill()
        other.wait()


def test_a_process_that_ends_on_an_exception_releases_its_lock_with_no_note_for_the_next(
    tmp_path: Path, capsys
) -> None:
    """A Python session whose Trainer raised still held its lock; at its exit the record is cleared, so the
    next run takes the folder without saying its holder was killed."""
    run = tmp_path / "run"
    code = (
        "from gspo.run import lock\n"
        f"lock.acquire({str(run)!r}, 'python my_script.py')\n"
        "raise RuntimeError('the reward function failed')\n"
    )
    run.mkdir()
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True)
    assert done.returncode == 1 and "the reward function failed" in done.stderr
    assert (run / LOCK_FILE).read_text() == ""  # released at exit
    code, err = _gspo(capsys, "train", TINY, f"output_dir={run}", *FAST)
    assert code == 0, err
    assert "ended without releasing" not in err
