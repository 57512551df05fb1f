"""A fork server for the kill tests (tests/test_checkpoint.py): imports gspo once, then runs each job, a JSON
line on stdin, in a forked child, and answers with the child's exit status as a JSON line on stdout.

A job is ``{"argv": [...], "log": path}`` (``gspo`` command-line arguments) or ``{"code": "...", "log":
path}`` (Python source), with an optional ``"kill": {"phase": ..., "name": "step_000001"}``: the child then
SIGKILLs itself at that phase of the save of that checkpoint (`PHASES`), a real kill of the writing
process. Importing torch and transformers once instead of per run keeps each run to the tiny model's
seconds; the fork happens before any thread pool exists in this process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot  # preloaded once for the runs' plots

import gspo.cli
import gspo.files
import gspo.run.checkpoint as checkpoint
import gspo.training.trainer

PHASES = ("mid_write", "before_rename", "after_aside", "after_rename", "after_pointer")
"""mid_write: the model is in the temporary folder, the training state is not; before_rename: the
temporary folder is complete; after_aside: a re-save moved the old complete copy aside; after_rename: the
new copy is in place, `latest` not yet updated; after_pointer: `latest` names it, old ones not pruned."""


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(phase: str, name: str) -> None:
    assert phase in PHASES, phase
    real_replace, real_save_model = os.replace, checkpoint.save_model

    class KillingOs:
        def __getattr__(self, attribute: str):
            return getattr(os, attribute)

        @staticmethod
        def replace(src, dst) -> None:
            src, dst = Path(src), Path(dst)
            if phase == "before_rename" and dst.name == name:
                _die()
            real_replace(src, dst)
            if (
                (phase == "after_aside" and src.name == name and dst.name == f".old_{name}")
                or (phase == "after_rename" and dst.name == name)
                or (phase == "after_pointer" and dst.name == "latest" and dst.read_text().strip() == name)
            ):
                _die()

    def save_model(model, tokenizer, directory) -> None:
        real_save_model(model, tokenizer, directory)
        if phase == "mid_write" and Path(directory).parent.name == f".tmp_{name}":
            _die()

    checkpoint.os = gspo.files.os = KillingOs()  # `latest` is written by gspo.files' replacement
    checkpoint.save_model = save_model


def run_child(job: dict) -> int:
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        if job.get("kill"):
            install_kill(**job["kill"])
        if "argv" in job:
            return gspo.cli.main(job["argv"])
        exec(job["code"], {"__name__": "__job__"})
        return 0
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 99


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                code = run_child(job)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
