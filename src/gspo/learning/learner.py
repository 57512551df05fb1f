"""The learner: old-policy log-probs, then K minibatch updates on a batch, with exact gradient accumulation.

`learn(policy, spec, batch, seed=...)` takes everything it uses as arguments and returns its metrics. The
batch is shuffled (seeded) and split into ``spec.minibatches`` minibatches, each laid out in micro-batches
of at most ``spec.micro_batch_tokens`` tokens (`minibatches`); `old_policy` scores exactly that layout and
returns one `UpdateBatch` record per update (its old, sampler's and reference log-probs and MoE expert
choices), so the first minibatch is exactly on-policy. `update` is one optimizer update whose micro-batches
share the minibatch's loss normaliser, so accumulation reproduces the full-minibatch gradient exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from gspo.core.corrections import mismatch_metrics, sampler_log_ratios
from gspo.core.layout import MicroBatch, TokenSequence, make_micro_batches
from gspo.core.objectives import LossInputs, compute_loss, loss_normalizer
from gspo.core.row_slices import split_micro_batch
from gspo.core.surrogates import LOSSES
from gspo.learning.batch import Batch
from gspo.learning.policy import Policy, UpdateSpec, score, score_with_entropy
from gspo.learning.reduction import reduce_metrics
from gspo.models import moe
from gspo.parallel.clipping import clip_grad_norm, release_grad_scale
from gspo.parallel.collectives import (
    all_gather_metrics,
    all_gather_objects,
    all_gather_varlen,
    all_reduce_sum,
    all_reduce_sums,
)
from gspo.parallel.group import rank
from gspo.parallel.sequence import SequenceGroup, sequence_group
from gspo.parallel.wrap import full_parameters, pad_micro_batches, set_gradient_sync

Advantages = torch.Tensor | list[list[float]]


def place(values: list[list[float]], mb: MicroBatch) -> torch.Tensor:
    """Scatter per-sequence completion-token values into a micro-batch's flattened layout (its device)."""
    device = mb.logprob_mask.device
    flat = torch.zeros(mb.logprob_mask.numel(), device=device)
    flat[mb.logprob_mask.reshape(-1)] = torch.tensor(
        [v for i in mb.indices for v in values[i]], dtype=torch.float32, device=device
    )
    return flat


class Split(NamedTuple):
    """One minibatch of a step's split: the sequences its update computes (``ids``, indices into the batch)
    laid out in ``micro``-batches, and the counts of the whole minibatch, skipped sequences included, that
    its loss normaliser takes (``sequences``, and ``tokens`` trained)."""

    ids: list[int]
    micro: list[MicroBatch]
    sequences: int
    tokens: int


def minibatches(
    spec: UpdateSpec,
    sequences: list[TokenSequence],
    *,
    seed: int,
    device: torch.device,
    groups: list[int] | None = None,
    computed: list[bool] | None = None,
    sequence: SequenceGroup | None = None,
) -> list[Split]:
    """Shuffle (seeded) and split into minibatches, each laid out in micro-batches on ``device``.

    One permutation of the whole batch (every rank's sequences, in rank order; with
    ``spec.minibatch_split == "group"`` of its groups, ``groups`` giving each sequence's global group):
    minibatch k holds the same sequences however many ranks share the batch, each rank its own of them.
    ``computed``: which sequences the updates compute (None: all); the split is the same either way.
    ``sequence``: this rank's sequence-parallel group, whose ranks all hold the group's sequences: each
    micro-batch is cut to this rank's slice of its rows (gspo.core.row_slices), and the group's
    first rank alone counts the minibatch's sequences and tokens for the normaliser.
    """
    generator = torch.Generator().manual_seed(seed)
    if spec.minibatch_split == "group" and groups is not None:
        mine = sorted(set(groups))
        units = sorted({g for part in all_gather_objects(mine) for g in part})  # every rank's groups
        members = {g: [i for i, own in enumerate(groups) if own == g] for g in mine}
        order = [units[k] for k in torch.randperm(len(units), generator=generator).tolist()]
        chunks = [
            [i for g in chunk.tolist() for i in members.get(g, [])]
            for chunk in _split(order, spec.minibatches)
        ]
    else:
        # one count per data-parallel group: the ranks of a sequence-parallel group hold the same ones
        data_rank, stride = (rank(), 1) if sequence is None else (sequence.data_rank, sequence.size)
        counts = all_gather_objects(len(sequences))[::stride]
        offset = sum(counts[:data_rank])
        order = torch.randperm(sum(counts), generator=generator).tolist()
        chunks = [
            [g - offset for g in c.tolist() if offset <= g < offset + len(sequences)]
            for c in _split(order, spec.minibatches)
        ]
    out = []
    for chunk in chunks:
        ids = [i for i in chunk if computed is None or computed[i]]
        micro = make_micro_batches(
            [sequences[i] for i in ids],
            layout=spec.layout,
            pack_length=spec.pack_length,
            micro_batch_tokens=spec.micro_batch_tokens,
            pad_id=spec.pad_id,
        )
        counted = chunk if sequence is None or sequence.leads else []
        out.append(Split(ids, micro, len(counted), sum(sum(sequences[i].train_mask) for i in counted)))
    # every rank runs as many micro-batches per minibatch (under FSDP2 each pass is a collective)
    padded = pad_micro_batches([split.micro for split in out], spec.pad_id)
    if sequence is not None:
        padded = [[split_micro_batch(mb, sequence.split, spec.pad_id) for mb in micro] for micro in padded]
    return [
        split._replace(micro=[mb.to(device) for mb in micro])
        for split, micro in zip(out, padded, strict=True)
    ]


def _split(order: list[int], parts: int) -> list[np.ndarray]:
    """``order`` in ``parts`` consecutive chunks of near-equal size (fewer when there are fewer items)."""
    return np.array_split(np.array(order, dtype=np.int64), max(1, min(parts, len(order))))


@dataclass
class UpdateBatch:
    """One optimizer update's share of the batch and what the old policy said about it, per micro-batch:
    log-probs laid out like the micro-batch's flattened tokens (R*L,), expert choices of MoE models."""

    index: int
    """Updates of this step before this one (0: the policy has not moved yet)."""
    ids: list[int]
    """The sequences it computes: indices into the batch."""
    micro: list[MicroBatch]
    """Their micro-batches on the policy's device: one forward and backward each."""
    normalizer: float
    """Its loss normaliser, over the whole minibatch on every rank (skipped sequences included)."""
    tokens: float
    """Its trained tokens on every rank: the entropy bonus's denominator."""
    old: list[torch.Tensor] | None
    """The old policy's log-probs; None: its update's own forward, detached (`first_forward_is_old`)."""
    sampled: list[torch.Tensor]
    """The sampler's log-probs (NaN where unknown), which the mismatch correction weighs by."""
    ref: list[torch.Tensor] | None = None
    """The reference policy's log-probs (train.beta > 0)."""
    routes: list[moe.Routing] | None = None
    """MoE models: the old policy's expert choices, replayed or compared with during the update."""
    old_is_sampled: bool = False
    """``old`` is ``sampled``: the sampler's log-probs serve as the old policy's (not recomputed)."""
    mismatch: MismatchMeter | None = None
    """Where its update's forward adds the sampler/trainer mismatch (None: measured elsewhere, or not)."""

    @property
    def measures_mismatch(self) -> bool:
        """Its update's forward is the old policy's (the policy has not moved yet): the sampler/trainer
        mismatch comes at no extra cost there."""
        return self.mismatch is not None


class MismatchMeter:
    """The sampler/trainer mismatch (gspo.core.corrections) of the micro-batches it is shown, over all ranks:
    the trainer's old-policy log-probs against the sampler's, measured in the old-policy pass or, when the
    sampler's serve as the old ones, in the first update's forward."""

    def __init__(self) -> None:
        self.deltas: list[torch.Tensor] = []  # (M,) token log-ratios per micro-batch
        self.seq_log_ratios: list[torch.Tensor] = []  # (S',) of the sequences with a known token

    def add(self, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mb: MicroBatch) -> None:
        """trainer_logp, sampler_logp: (R*L,) laid out like ``mb``; sampler_logp NaN where unknown."""
        if not mb.indices:  # an idle micro-batch (distributed padding) scores nothing
            return
        delta, seq, counts = sampler_log_ratios(trainer_logp, sampler_logp, mb.segment_ids, len(mb.indices))
        self.deltas.append(delta)
        self.seq_log_ratios.append(seq[counts > 0])

    def metrics(self) -> dict[str, float]:
        """The mismatch metrics of everything added on every rank (a collective); {} when nothing was."""
        return mismatch_metrics(*(all_gather_varlen(_cat(x)) for x in (self.deltas, self.seq_log_ratios)))


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors).cpu() if tensors else torch.zeros(0)


def old_policy(
    policy: Policy, spec: UpdateSpec, batch: Batch, layout: list[Split]
) -> tuple[list[UpdateBatch], dict[str, float]]:
    """The minibatches of ``layout`` with the old policy's log-probs (and reference ones, expert choices),
    before any update; and the metrics of the old-policy pass. Only the sequences the updates compute are
    scored.

    With ``spec.old_logprobs == "recompute"`` the trainer's own forward pass, which also measures the
    sampler/trainer mismatch; with "sampler" the sampler's log-probs, a token it did not report (NaN)
    recomputed.
    """
    computed = [i for split in layout for i in split.ids]
    # a trained token the sampler gave no log-prob for (NaN, e.g. llama.cpp's EOS) needs the trainer's
    unknown = sum(
        t and not math.isfinite(lp)
        for i in computed
        for t, lp in zip(batch.sequences[i].train_mask, batch.sampler_logprobs[i], strict=True)
    )
    recompute = spec.old_logprobs == "recompute" or all_reduce_sum(float(unknown)) > 0
    mismatch, parts = MismatchMeter(), []
    # old policy = the current weights, before any update of this step; FSDP2 gathers them once
    with torch.no_grad(), full_parameters(policy.scorer):
        for index, (ids, micro, *_) in enumerate(layout):
            sampled = [place([batch.sampler_logprobs[i] for i in ids], mb) for mb in micro]
            own = index == 0 and first_forward_is_old(policy, spec)
            if own:  # the first update's forward is the old policy's: no pass of its own
                old, routes = None, None
            elif recompute:
                old, routes = _recompute(policy, spec, micro, sampled, mismatch)
            else:  # the sampler's log-probs are the old ones
                old, routes = sampled, _expert_choices(policy, spec, micro)
            ref = [policy.reference_logprobs(mb, spec) for mb in micro] if spec.loss.beta > 0 else None
            parts.append(
                UpdateBatch(
                    index,
                    ids,
                    micro,
                    _normalizer(spec, layout[index]),
                    max(all_reduce_sum(float(layout[index].tokens)), 1.0),
                    old,
                    sampled,
                    ref,
                    routes,
                    old_is_sampled=not recompute,
                    mismatch=mismatch if own or (index == 0 and not recompute) else None,
                )
            )
    if spec.old_logprobs == "recompute":  # both known: how far apart (the first update measures its own)
        metrics = {} if parts and parts[0].measures_mismatch else mismatch.metrics()
    else:
        trained = sum(sum(batch.sequences[i].train_mask) for i in computed)
        metrics = {"sampler_logprob_missing_frac": unknown / max(trained, 1)}  # recomputed by the trainer
    metrics["old_logprobs_recomputed"] = float(recompute)
    return parts, metrics


def first_forward_is_old(policy: Policy, spec: UpdateSpec) -> bool:
    """Whether the first update's own forward gives the old policy's log-probs (recomputed, detached): the
    weights have not moved yet, so a pass of their own would compute the same values again. Not for MoE
    models (the old pass records the expert choices the updates replay or compare with) nor a row split
    across ranks (sequence parallelism)."""
    return spec.old_logprobs == "recompute" and not policy.moe and spec.sequence_parallel == 1


def _recompute(
    policy: Policy,
    spec: UpdateSpec,
    micro: list[MicroBatch],
    sampled: list[torch.Tensor],
    mismatch: MismatchMeter,
) -> tuple[list[torch.Tensor], list[moe.Routing] | None]:
    """The trainer's old-policy log-probs of a minibatch (the sampler's where ``spec.old_logprobs`` is
    "sampler" and it gave one) and the expert choices of those passes (MoE models)."""
    # a sliced row's expert choices are not compared with the whole row's (sequence parallelism)
    with moe.record_passes(policy.model, enabled=policy.moe and spec.sequence_parallel == 1) as passes:
        recomputed = [score(policy.scorer, mb, spec) for mb in micro]
    for mb, r, s in zip(micro, recomputed, sampled, strict=True):
        mismatch.add(r, s, mb)
    if spec.old_logprobs == "recompute":
        return recomputed, passes or None
    # the sampler's log-probs; the trainer's only where the sampler gave none
    return [
        torch.where(torch.isnan(s), r, s) for r, s in zip(recomputed, sampled, strict=True)
    ], passes or None


def _expert_choices(policy: Policy, spec: UpdateSpec, micro: list[MicroBatch]) -> list[moe.Routing] | None:
    """The old policy's expert choices of each micro-batch (MoE models, whole rows) without log-probs."""
    if not policy.moe or spec.sequence_parallel > 1:
        return None
    with policy.autocast():
        return [moe.expert_choices(policy.model, mb) for mb in micro]


def update(
    policy: Policy, spec: UpdateSpec, minibatch: UpdateBatch, advantages: Advantages
) -> dict[str, Any]:
    """One optimizer update on a minibatch: gradient accumulation over its micro-batches, then one step.

    advantages: the batch's, (n,) one per sequence or one list per sequence with a value per completion
    token. MoE models replay the old policy's expert choices (``spec.routing_replay``) or measure how far
    the routers moved from them (gspo.models.moe.UpdateRouting).
    """
    loss_spec = spec.loss
    if not isinstance(advantages, torch.Tensor):  # per token (per-turn rewards)
        loss_spec = spec.loss.for_token_advantages()
        if loss_spec.objective != spec.loss.objective:
            warnings.warn(  # shown once: one line of code
                f"train.objective={spec.loss.objective} with per-token advantages (per-turn rewards): trained "
                f"as {loss_spec.objective}, its form for them (the same value and gradient for per-sequence "
                "advantages)",
                stacklevel=2,
            )
    with_entropy = policy.entropy.active
    if with_entropy:  # the coefficient of this update: fixed, or as the last update's entropy left it
        loss_spec = dataclasses.replace(loss_spec, entropy_coef=policy.entropy.applied())
    routing = moe.UpdateRouting(policy.model, minibatch.routes, replay=spec.routing_replay)
    sequence = sequence_group(spec.sequence_parallel)
    reduce = sequence.segment_sum_reduce if sequence is not None else None
    policy.optimizer.zero_grad(set_to_none=True)
    metrics, losses, entropy_sums = [], [], []
    for j, mb in enumerate(minibatch.micro):
        set_gradient_sync(policy.scorer, j == len(minibatch.micro) - 1)  # DDP: sum once, at the end
        with routing.forward(j, mb.logprob_mask), policy.tied_rows.recording():
            logp, entropy = (
                score_with_entropy(policy.scorer, mb, spec)
                if with_entropy
                else (score(policy.scorer, mb, spec), None)
            )
        old = minibatch.old[j] if minibatch.old is not None else logp.detach()  # the first forward's own
        inputs = _loss_inputs(spec, minibatch, j, logp, old, advantages)
        if entropy is not None:
            inputs = dataclasses.replace(inputs, entropy=entropy, entropy_normalizer=minibatch.tokens)
            entropy_sums.append(torch.where(mb.segment_ids >= 0, entropy.detach(), 0.0).sum())
        loss, m = compute_loss(loss_spec, inputs, segment_sum_reduce=reduce)
        loss.backward()
        policy.tied_rows.add_to_grad()
        losses.append(loss.detach())  # read back once, after the loop
        if mb.indices:  # not an idle micro-batch (distributed padding)
            if sequence is not None and not sequence.leads:  # each sequence counted once in its group
                m |= {key: torch.zeros(()) for key in ("num_sequences", "num_seq_nonzero_adv")}
            metrics.append(m)
            if minibatch.mismatch is not None:
                minibatch.mismatch.add(logp.detach(), minibatch.sampled[j], mb)
    grad_norm = _step(policy, spec)
    out = reduce_metrics(all_gather_metrics(metrics))  # all ranks' micro-batches
    out["loss"] = all_reduce_sum(float(torch.stack(losses).sum()) if losses else 0.0)
    out["grad_norm"] = float(grad_norm)
    if (
        with_entropy
    ):  # the minibatch's mean entropy over every rank's trained tokens, then the next coefficient
        mean = (
            all_reduce_sum(float(torch.stack(entropy_sums).sum()) if entropy_sums else 0.0) / minibatch.tokens
        )
        out |= {"entropy": mean, "entropy_coef": loss_spec.entropy_coef}
        policy.entropy.observe(mean)
    out |= routing.metrics(updates_before=minibatch.index)
    return out | (minibatch.mismatch.metrics() if minibatch.mismatch is not None else {})


def _normalizer(spec: UpdateSpec, split: Split) -> float:
    """A minibatch's loss normaliser over all ranks (gspo.core.objectives.loss_normalizer of its sequence and
    trained-token counts, skipped sequences included): each rank's loss is its share of the one-process
    loss, and the ranks' gradients are summed."""
    local = loss_normalizer(spec.loss.aggregation, split.sequences, split.tokens, spec.max_new_tokens)
    return max(all_reduce_sum(float(local)), 1.0)  # 0 only when no token trains: every term is 0 then


def _loss_inputs(
    spec: UpdateSpec,
    minibatch: UpdateBatch,
    j: int,
    logp: torch.Tensor,
    old: torch.Tensor,
    advantages: Advantages,
) -> LossInputs:
    """The loss's inputs of micro-batch j of a minibatch, with the current policy's log-probs ``logp`` and
    the old policy's ``old``."""
    mb, ids = minibatch.micro[j], minibatch.ids
    if isinstance(advantages, torch.Tensor):
        adv = advantages[[ids[i] for i in mb.indices]].to(logp.device)
    else:  # per completion token, laid out like logp: (R*L,)
        adv = place([advantages[i] for i in ids], mb)
    # the sampler's log-probs weigh the correction (a whole loss's own too); without one, OPSM measures
    # against the old ones
    own = spec.loss.sampler_correction != "none" or spec.loss.objective in LOSSES
    sampled = minibatch.sampled[j] if own else None
    ref = None if minibatch.ref is None else minibatch.ref[j]
    return LossInputs(
        logp,
        old,
        adv,
        mb.segment_ids,
        len(mb.indices),
        ref_logp=ref,
        sampler_logp=sampled,
        normalizer=minibatch.normalizer,
    )


def _step(policy: Policy, spec: UpdateSpec) -> torch.Tensor:
    """Clip the gradient norm, step the optimizer and the schedule; returns the norm before clipping."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    for p in params:
        # a zero gradient, not none: AdamW still moves a weight through its moments and weight decay, as it
        # does when every term is computed and zero (a minibatch whose sequences were all skipped, an MoE
        # expert no token was routed to)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    max_norm = spec.max_grad_norm if spec.max_grad_norm > 0 else float("inf")
    grad_norm = clip_grad_norm(params, max_norm, policy.optimizer)  # fused AdamW: applied inside its step
    policy.optimizer.step()
    release_grad_scale(policy.optimizer)
    policy.scheduler.step()
    return grad_norm


def unique_tokens(batch: Batch) -> int:
    """Tokens with each group's prompt counted once: what a rollout batch holds without repeats."""
    prompts = {(g, tuple(seq.prompt_ids)) for g, seq in zip(batch.groups, batch.sequences, strict=True)}
    return sum(len(p) for _, p in prompts) + sum(len(seq.completion_ids) for seq in batch.sequences)


def learn(
    policy: Policy,
    spec: UpdateSpec,
    batch: Batch,
    *,
    seed: int,
    around_update: Callable[[], AbstractContextManager[Any]] | None = None,
) -> dict[str, float]:
    """Old-policy log-probs, then ``spec.minibatches`` optimizer updates on ``batch``; returns the metrics.

    seed: the minibatch shuffle's (the trainer passes one per step). around_update: a context manager
    factory entered around each optimizer update, e.g. to count its FLOPs (benchmarks/train_step.py).
    With ``spec.skip_zero_advantage`` the passes leave out the sequences that move nothing (`Batch.moving`);
    the split, each minibatch's normaliser and its optimizer step are those of the whole batch.
    """
    sequence = sequence_group(spec.sequence_parallel)
    if sequence is not None:  # the group trains on all its ranks' samples, each rank a slice of every row
        batch = _pooled(batch, sequence)
    computed = batch.moving() if spec.skip_zero_advantage else None
    layout = minibatches(
        spec,
        batch.sequences,
        seed=seed,
        device=policy.device,
        groups=batch.groups,
        computed=computed,
        sequence=sequence,
    )
    t0 = time.perf_counter()
    parts, out = old_policy(policy, spec, batch, layout)
    out["time_old_logprobs"] = time.perf_counter() - t0
    out |= _token_counts(batch, parts, counts=sequence is None or sequence.leads)
    t0 = time.perf_counter()
    updates = []
    for minibatch in parts:
        with around_update() if around_update is not None else contextlib.nullcontext():
            updates.append(update(policy, spec, minibatch, batch.advantages))
    out["time_update"] = time.perf_counter() - t0
    # this rank's batch routed again after all this step's updates (FSDP2: gathered once)
    if policy.moe and sequence is None:
        t0 = time.perf_counter()
        micro, routes = [mb for m in parts for mb in m.micro], [r for m in parts for r in m.routes]
        with full_parameters(policy.scorer), policy.autocast():
            out |= moe.routing_volatility(policy.model, micro, routes)
        out["time_routing"] = time.perf_counter() - t0
    return {**reduce_metrics(updates), **out}


def _token_counts(batch: Batch, parts: list[UpdateBatch], *, counts: bool = True) -> dict[str, float]:
    """What the updates compute vs what is there, over all ranks: real tokens (each sequence whole), unique
    tokens (a group's prompt once); the layout's padding and prompt repeats make the difference; and the
    share of the samples, and of their real tokens, left out as moving nothing. ``counts``: whether this
    rank's batch counts (False on the ranks of a sequence-parallel group but its first)."""
    computed = [i for m in parts for i in m.ids]
    laid_out = sum(mb.num_tokens for m in parts for mb in m.micro if mb.indices)
    real = sum(len(seq) for seq in batch.sequences)
    skipped_real = real - sum(len(batch.sequences[i]) for i in computed)
    mine = [laid_out, real, unique_tokens(batch), len(batch.sequences), len(computed), skipped_real]
    totals = all_reduce_sums([x if counts else 0 for x in mine])
    return {
        "update_tokens": totals[0],
        "real_tokens": totals[1],
        "unique_tokens": totals[2],
        "skipped_samples_frac": 1.0 - totals[4] / max(totals[3], 1.0),
        "skipped_tokens_frac": totals[5] / max(totals[1], 1.0),
    }


def _pooled(batch: Batch, sequence: SequenceGroup) -> Batch:
    """The samples of every rank of a sequence-parallel group, in group order (the same on each)."""
    parts = sequence.all_gather_objects(batch)
    advantages: Advantages
    if isinstance(batch.advantages, torch.Tensor):
        advantages = torch.cat([part.advantages for part in parts])
    else:
        advantages = [a for part in parts for a in part.advantages]
    return Batch(
        [s for part in parts for s in part.sequences],
        advantages,
        [lp for part in parts for lp in part.sampler_logprobs],
        [g for part in parts for g in part.groups],
    )
