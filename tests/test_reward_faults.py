"""Every reward result and exception gets the reward's one line and exit 7, a Ctrl-C inside a reward exit 130
with the steps kept, and nothing hangs (gspo.rewards.calling, gspo.workers): a reward that blocks the event
loop, hangs in its thread or raises SystemExit is cut off by reward_timeout, and the process can exit (no
thread it must join is left behind).

Each case is a `gspo train` of the tiny config whose reward (a file of the test's) misbehaves at its
`AT`-th call; the run then must stop within a bound, with its code and line."""

from __future__ import annotations

import concurrent.futures.thread
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gspo.cli import EXIT_CODES, main

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")

HEAD = """
import asyncio, time
import gspo
calls = 0
def due():
    global calls
    calls += 1
    return calls >= AT
"""

CASES = {
    # name: (the function's source, exit code, what the line says)
    "async-blocks-the-loop": (
        "async def r(completion, **_):\n    if due():\n        time.sleep(60)\n    return 1.0",
        "reward",
        r"did not return within .* blocked the run's event loop: an async def reward must not make blocking",
    ),
    "async-system-exit": (
        "async def r(completion, **_):\n    if due():\n        raise SystemExit(3)\n    return 1.0",
        "reward",
        r"reward function 'r' called sys\.exit\(3\)|reward function 'r' raised SystemExit",
    ),
    "thread-hangs": (
        "@gspo.reward(threads=True)\ndef r(completion, **_):\n    if due():\n        time.sleep(60)\n    return 1.0",
        "reward",
        r"reward function 'r' did not return within 1 s \(reward_timeout\)",
    ),
    "plain-hangs": (
        "def r(prompts, completions, **_):\n    if due():\n        time.sleep(60)\n    return [1.0] * len(completions)",
        "reward",
        r"reward function 'r' did not return within 1 s \(reward_timeout\)",
    ),
    "base-exception-subclass": (
        "class Mine(BaseException):\n    pass\n"
        "def r(prompts, completions, **_):\n    if due():\n        raise Mine('no')\n    return [1.0] * len(completions)",
        "reward",
        r"reward function 'r' raised Mine: no",
    ),
    "generator-exit": (
        "def r(completion, **_):\n    if due():\n        raise GeneratorExit\n    return 1.0",
        "reward",
        r"reward function 'r' raised GeneratorExit",
    ),
    "int-too-large": (
        "def r(prompts, completions, **_):\n    return [10**400 if due() else 1] * len(completions)",
        "reward",
        r"reward function 'r' returned an int of 401 digits at sample 0 .*beyond float32's range",
    ),
    "async-keyboard-interrupt": (
        "async def r(completion, **_):\n    if due():\n        raise KeyboardInterrupt\n    return 1.0",
        "interrupted",
        r"interrupted; the run is kept up to step 1",
    ),
    "thread-keyboard-interrupt": (
        "@gspo.reward(threads=True)\ndef r(completion, **_):\n    if due():\n        raise KeyboardInterrupt\n    return 1.0",
        "interrupted",
        r"interrupted; the run is kept up to step 1",
    ),
}


def _write(tmp_path: Path, name: str, at: int) -> Path:
    source, _, _ = CASES[name]
    path = tmp_path / "rw.py"
    path.write_text(HEAD.replace("AT", str(at)) + textwrap.dedent(source) + "\n")
    return path


def _argv(tmp_path: Path, rewards: Path, lag: int, steps: int = 3, function: str = "r") -> list[str]:
    return [
        "train",
        TINY,
        f"output_dir={tmp_path / 'run'}",
        "report_to=[]",
        "progress=false",
        f"train.steps={steps}",
        "task.num_eval=0",
        "eval.every=0",
        "checkpoint.every=1",
        "reward_timeout=1",
        "rollout.dynamic_sampling=false",  # every batch's calls counted in advance
        f"rollout.lag={lag}",
        f"rewards={{{rewards}:{function}: 1.0}}",
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_misbehaving_reward_stops_the_run_with_its_line_and_code(tmp_path: Path, capsys, name: str) -> None:
    """Its first call of the second rollout batch misbehaves (per completion: the 17th call; per batch: the
    2nd), so step 1 is trained and kept. Bounded: each case returns within 30 s, and leaves no thread the
    interpreter would join at exit."""
    source, kind, said = CASES[name]
    per_completion = "completion, **_" in source
    rewards = _write(tmp_path, name, at=17 if per_completion else 2)
    start = time.monotonic()
    code = main(_argv(tmp_path, rewards, lag=0))
    err = capsys.readouterr().err
    assert time.monotonic() - start < 30
    assert code == EXIT_CODES[kind], err
    assert re.search(said, err), err
    assert err.count("\n") <= 1 and "Traceback" not in err
    # what would keep the process from exiting: a thread the interpreter joins (non-daemon, or an executor's)
    joined = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    joined += [t for t in concurrent.futures.thread._threads_queues if t.is_alive()]
    assert joined == [], joined
    if kind == "interrupted" or name in ("plain-hangs", "thread-hangs"):
        assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()  # step 1 kept


@pytest.mark.parametrize("lag", [1, 2])
def test_a_reward_that_hangs_beside_the_updates_stops_the_run(tmp_path: Path, capsys, lag: int) -> None:
    rewards = _write(tmp_path, "thread-hangs", at=17)
    code = main(_argv(tmp_path, rewards, lag=lag))
    err = capsys.readouterr().err
    assert code == EXIT_CODES["reward"] and "did not return within 1 s" in err, err


def test_a_busy_loop_past_the_batch_deadline_is_waited_for_and_a_blocked_one_is_not() -> None:
    """On a loaded machine the loop can reach its calls' own deadlines after the whole batch's (a hung
    thread reward then read as a blocked loop: seen with two test processes on 2 cores). Past the batch's
    deadline the loop is asked to run a callback: one that answers is waited for; one that does not, whose
    coroutine never yields, is blocked."""
    import asyncio
    from types import SimpleNamespace

    from gspo.rewards.calling import RewardError, _on_the_loop
    from gspo.workers import Workers

    reward = SimpleNamespace(name="r", timeout=0.2, per_completion=False, concurrency=1, is_async=True)
    # one call of 0.2 s: the batch's deadline is 1.2 s

    async def busy() -> dict:
        await asyncio.sleep(2.0)  # past the deadline, the loop free all along
        return {"r": [1.0]}

    async def blocked() -> dict:
        time.sleep(4.0)  # never yields
        return {"r": [1.0]}

    workers = Workers("test")
    try:
        assert _on_the_loop(workers.run(busy()), [reward], 1, workers) == {"r": [1.0]}
        start = time.monotonic()
        with pytest.raises(
            RewardError, match=r"did not return within 1\.2 s and blocked the run.s event loop"
        ):
            _on_the_loop(workers.run(blocked()), [reward], 1, workers)
        assert time.monotonic() - start < 3.5  # the deadline and one second's question, not the 4 s
    finally:
        workers.close(timeout=1.0)


def test_the_process_of_a_run_whose_reward_hangs_exits(tmp_path: Path) -> None:
    """The whole process, as the user runs it: a threads=True reward that hangs printed its line but the
    process did not exit (the interpreter joined the executor's stuck thread)."""
    rewards = _write(tmp_path, "thread-hangs", at=17)
    done = subprocess.run(
        [sys.executable, "-m", "gspo", *_argv(tmp_path, rewards, lag=0)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(TINY).parents[1] / "src")},
    )
    assert done.returncode == EXIT_CODES["reward"] and "did not return within 1 s" in done.stderr, done.stderr


@pytest.mark.parametrize("lag", [1, 2])
def test_one_ctrl_c_stops_a_run_at_every_lag_while_it_waits_for_the_batches_ahead(
    tmp_path: Path, lag: int
) -> None:
    """One SIGINT after the first checkpoint, with a slow reward: at lag 1 and 2 it was ignored (the run
    trained to its end and exited 0): the checkpoint's wait for the batches ahead swallowed it. It stops the
    run, exit 130, the steps it finished kept."""
    import signal

    (tmp_path / "slow.py").write_text(
        "import time\ndef slow(prompts, completions, **_):\n    time.sleep(0.5)\n    return [1.0] * len(completions)\n"
    )
    argv = _argv(tmp_path, tmp_path / "slow.py", lag=lag, steps=40, function="slow")
    process = subprocess.Popen(
        [sys.executable, "-m", "gspo", *argv],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(TINY).parents[1] / "src")},
    )
    first = tmp_path / "run" / "checkpoints" / "step_000001"
    deadline = time.monotonic() + 120
    while not first.is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == EXIT_CODES["interrupted"], err
    kept = re.search(r"interrupted; the run is kept up to step (\d+)", err)
    assert kept is not None and 1 <= int(kept[1]) < 40, err


def test_a_reward_error_at_the_first_batch_saves_no_step_0(tmp_path: Path, capsys) -> None:
    """It wrote checkpoints/step_000000 (the initial model), where the docs promise no step 0: a resume
    without a checkpoint starts the run again, to the same results."""
    (tmp_path / "bad.py").write_text("def r(prompts, completions, **_):\n    raise ValueError('no')\n")
    code = main(_argv(tmp_path, tmp_path / "bad.py", lag=0))
    err = capsys.readouterr().err
    assert code == EXIT_CODES["reward"] and "holds no checkpoint yet" in err, err
    assert not (tmp_path / "run" / "checkpoints" / "step_000000").exists()
