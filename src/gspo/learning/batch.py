"""The one road from scored samples to the learner's batch: advantages, zero-spread groups, reward metrics.

`gspo train`'s rollouts and the user's own trajectories (gspo.rollout.trajectories) both become a list of
`Sample`s and go through `make_batch`, so they share one definition of group advantages (gspo.core
.advantages), of zero-std filtering and of every reward metric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gspo.core.advantages import group_advantages
from gspo.core.layout import TokenSequence
from gspo.core.samples import Sample
from gspo.parallel.collectives import all_gather_objects
from gspo.parallel.group import rank


@dataclass
class Batch:
    """What the learner trains on: sequences, their advantages and the sampler's log-probs.

    advantages: (n,) one per sequence, or one list per sequence with a value per completion token
    (per-turn rewards); groups: the (global) group of each sequence.
    """

    sequences: list[TokenSequence]
    advantages: Tensor | list[list[float]]
    sampler_logprobs: list[list[float]]
    groups: list[int]

    def moving(self) -> list[bool]:
        """Whether each sequence has a trained token with a nonzero advantage. One without adds exactly zero
        to every objective's loss and gradient (each term is a multiple of the advantage), so an update may
        skip it when nothing else in the loss (a KL term) depends on it."""
        masks = [seq.train_mask for seq in self.sequences]
        if isinstance(self.advantages, Tensor):
            return [bool(a != 0) and any(m) for a, m in zip(self.advantages.tolist(), masks, strict=True)]
        return [
            any(t and a != 0 for t, a in zip(m, adv, strict=True))
            for m, adv in zip(masks, self.advantages, strict=True)
        ]


def make_batch(
    samples: list[Sample],
    *,
    advantage_scale: str = "group",
    filter_zero_std_groups: bool = False,
    mask_truncated: bool = False,
) -> tuple[Batch, dict[str, float]]:
    """The learner's batch from this process's samples, and the reward metrics of all processes' samples.

    Advantages compare each sample with its group (`group_advantages`; with turn rewards, per turn and so
    per token); every process sees all processes' rewards, so the metrics and a batch-wide scale are one
    process's. The options are the config's keys: advantage_scale (group_advantages' ``scale``),
    filter_zero_std_groups (drop the groups whose returns are all equal: they carry no signal) and
    rollout.mask_truncated (truncated samples get no gradient; they still count in the 1/G normaliser).
    """
    per_turn = any(s.turn_rewards is not None for s in samples)
    # every process's samples in process order; group ids made global
    mine = [
        (s.group, s.returns() if per_turn else [s.reward], len(s.completion_ids), s.truncated)
        for s in samples
    ]
    parts = all_gather_objects(mine)
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + (max((g for g, *_ in part), default=-1) + 1))
    rows = [(offsets[r] + g, *rest) for r, part in enumerate(parts) for g, *rest in part]
    first = sum(len(part) for part in parts[: rank()])  # this process's first sample among all
    groups = torch.tensor([g for g, *_ in rows], dtype=torch.long)
    width = max((len(ret) for _, ret, *_ in rows), default=1)
    returns = torch.full((len(rows), width), float("nan"))
    for i, (_, ret, *_) in enumerate(rows):
        returns[i, : len(ret)] = torch.tensor(ret)
    returns = returns if per_turn else returns[:, 0]
    advantages, zero_std = group_advantages(returns, groups, scale=advantage_scale)

    totals = returns[:, 0] if per_turn else returns
    lengths = [n for *_, n, _ in rows]
    metrics = {
        "reward_mean": float(totals.mean()),
        "reward_std": float(totals.std(unbiased=False)),
        "zero_std_groups": float(zero_std.sum()),
        "completion_len_mean": sum(lengths) / len(lengths),
        "truncated_frac": sum(t for *_, t in rows) / len(rows),
    }
    keep = [i for i, s in enumerate(samples) if not (filter_zero_std_groups and zero_std[groups[first + i]])]
    sequences, kept_advantages = [], []
    for i in keep:
        s = samples[i]
        mask = list(s.train_mask) if s.train_mask is not None else [True] * len(s.completion_ids)
        if mask_truncated and s.truncated:
            mask = [False] * len(mask)
        sequences.append(TokenSequence(s.prompt_ids, s.completion_ids, mask))
        if per_turn:  # each token takes its turn's advantage; 0 on context tokens
            turn_adv = advantages[first + i].tolist()
            turns = s.turns if s.turns is not None else [0] * len(s.completion_ids)
            kept_advantages.append([turn_adv[k] if k >= 0 else 0.0 for k in turns])
    batch = Batch(
        sequences,
        kept_advantages if per_turn else advantages[[first + i for i in keep]],
        [list(samples[i].sampler_logprobs) for i in keep],
        [int(groups[first + i]) for i in keep],
    )
    counts = all_gather_objects((len(sequences), sum(sum(seq.train_mask) for seq in sequences)))
    metrics["num_trained"] = float(sum(n for n, _ in counts))
    metrics["trained_tokens_mean"] = sum(t for _, t in counts) / max(metrics["num_trained"], 1.0)
    return batch, metrics
