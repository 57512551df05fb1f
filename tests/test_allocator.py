"""gspo.run.allocator: blocks freed and allocated again cost no new page faults once glibc keeps freed
memory; with glibc's defaults the large one costs one per 4 KB page every time. Each case in a fresh process (mallopt
settings last for the process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

CHILD = """
import resource, sys
import torch
from gspo.run.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(8):  # an update's gradients (SmolLM2's sizes), freed and allocated again: 4 KB pages touched
    before = faults()
    blocks = [torch.ones(576 * 1536) for _ in range(60)] + [torch.ones(49152 * 576)]
    del blocks
    counts.append(faults() - before)
print(kept, max(counts[-3:]))  # glibc settles its heap's layout in the first rounds
"""


def _faults_of_later_rounds(variant: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, variant], env=clean | env, capture_output=True, text=True, check=True
    )
    kept, faults = out.stdout.split()
    return kept, int(faults)


def test_kept_memory_is_reused_without_page_faults():
    kept, faults = _faults_of_later_rounds("keep")
    assert kept == "True"
    assert faults < 1000  # of ~79000 pages a round
    _, default_faults = _faults_of_later_rounds("default")
    assert default_faults > 20000  # glibc's default: the 113 MB block is mmapped afresh each time


def test_a_users_own_malloc_setting_is_left_alone():
    kept, faults = _faults_of_later_rounds("keep", MALLOC_ARENA_MAX="2")
    assert kept == "False" and faults > 20000
