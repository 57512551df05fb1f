"""Every seed of a run derives from its seed here, by one scheme: a counter-based hash (splitmix64's
finaliser) of the run's seed, the stream's domain and its indices, so that no two streams overlap and none
depends on how many draws another made. One named function per use: a step's minibatch shuffle, a rank's
sampling, an evaluation's sampling, one request to an inference server, one group of an engine's samples.
The draws of one sample's tokens (gspo.rollout.draws) hash a `stream_key` with the token's position."""

from __future__ import annotations

import random

import numpy as np
import torch

_MASK64 = (1 << 64) - 1

STEP, RANK, REQUEST, GROUP, EVALUATION, SAMPLE, RESAMPLE = 1, 2, 3, 4, 5, 6, 7
"""The domains of the derived streams: the same indices in two domains give unrelated seeds."""


def mix64(x: int) -> int:
    """splitmix64's finaliser of x + the golden-ratio increment: a bijection of 64-bit integers whose
    outputs for consecutive inputs look independent (Steele, Lea and Flood 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_key(*parts: int) -> int:
    """A 64-bit stream key from integers (e.g. a seed, a prompt index, a sample index)."""
    key = 0
    for part in parts:
        key = mix64(key ^ (part & _MASK64))
    return key


def derive(seed: int, domain: int, *indices: int, bits: int = 63) -> int:
    """A seed of ``bits`` bits for one stream of ``domain`` (STEP, RANK, ...) at ``indices``."""
    return stream_key(seed, domain, *indices) >> (64 - bits)


def step_seed(seed: int, step: int) -> int:
    """The seed of a step's minibatch shuffle: the run's seed and the step (`gspo serve`: the version the
    train call starts from), so a resumed run shuffles as an uninterrupted one."""
    return derive(seed, STEP, step)


def rank_seed(seed: int, rank: int) -> int:
    """The sampling seed of one data-parallel rank, so that ranks draw different completions."""
    return derive(seed, RANK, rank)


def sample_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of the rollout batch that step ``step`` trains on, on data-parallel rank ``rank``:
    whichever thread draws it, and whenever (rollout.lag), it draws the same completions."""
    return derive(seed, SAMPLE, step, rank)


def resample_seed(seed: int, round_: int) -> int:
    """The seed of a rollout batch's ``round_``-th extra draw (rollout.dynamic_sampling), from the batch's
    own sampling seed: which further prompts it takes and their completions, the same whenever it is drawn."""
    return derive(seed, RESAMPLE, round_)


def evaluation_seed(seed: int, step: int) -> int:
    """The sampling seed of the evaluation at ``step``: its own stream, so that evaluating (or how often)
    changes nothing the training draws."""
    return derive(seed, EVALUATION, step)


def request_seed(seed: int, prompt: int, attempt: int) -> int:
    """The seed sent with one server request: prompt `prompt` of a batch, its `attempt`-th request (a server
    that returns fewer than n choices is asked again), within the 31 bits servers accept."""
    return derive(seed, REQUEST, prompt, attempt, bits=31)


def group_seed(seed: int, prompt: int) -> int:
    """The seed of prompt `prompt`'s group in an engine that gives sample k of a request seed + k (vLLM):
    30 bits, so seed + k stays within the 31 bits it accepts."""
    return derive(seed, GROUP, prompt, bits=30)


def seed_everything(seed: int) -> None:
    """torch's, Python's and numpy's global generators, as a run starts."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
