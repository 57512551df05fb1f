"""Seeds derived from the run's seed, one named function per use, so that no two streams overlap: a step's
minibatch shuffle, a rank's sampling, one request to an inference server. STRIDE is a prime larger than any
step, rank or request count a run reaches in one stream."""

from __future__ import annotations

STRIDE = 1_000_003


def step_seed(seed: int, step: int) -> int:
    """The seed of a step's minibatch shuffle: the run's seed and the step (`gspo serve`: the version the
    train call starts from), so a resumed run shuffles as an uninterrupted one."""
    return seed * STRIDE + step


def rank_seed(seed: int, rank: int) -> int:
    """The sampling seed of one data-parallel rank, so that ranks draw different completions."""
    return seed + rank * STRIDE


def request_seed(seed: int, prompt: int, attempt: int) -> int:
    """The seed sent with one server request: prompt `prompt` of a batch, its `attempt`-th request (a server
    that returns fewer than n choices is asked again), within the 31 bits servers accept."""
    return (seed + prompt * STRIDE + attempt) % 2**31
