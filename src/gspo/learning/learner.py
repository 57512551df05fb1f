"""The learner: old-policy log-probs, then K minibatch updates on a batch, with exact gradient accumulation.

`learn(policy, spec, batch, seed=...)` takes everything it uses as arguments and returns its metrics. The
batch is shuffled (seeded) and split into ``spec.minibatches`` minibatches, each laid out in micro-batches
of at most ``spec.micro_batch_tokens`` tokens; the old policy is scored on exactly that layout, so the
first minibatch is exactly on-policy. Each minibatch is one optimizer update whose micro-batches share
the minibatch's loss normaliser, so accumulation reproduces the full-minibatch gradient exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from gspo.core.layout import MicroBatch, Sequence, make_micro_batches
from gspo.core.mismatch import mismatch_metrics, sampler_log_ratios
from gspo.core.objectives import LossInputs, compute_loss
from gspo.learning.batch import Batch
from gspo.learning.policy import Policy, UpdateSpec, score
from gspo.learning.reduction import reduce_metrics
from gspo.models import moe
from gspo.parallel.clipping import clip_grad_norm, release_grad_scale
from gspo.parallel.collectives import (
    all_gather_metrics,
    all_gather_objects,
    all_gather_varlen,
    all_reduce_sum,
)
from gspo.parallel.group import rank
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


def minibatches(
    spec: UpdateSpec,
    sequences: list[Sequence],
    *,
    seed: int,
    device: torch.device,
    groups: list[int] | None = None,
) -> list[tuple[list[int], list[MicroBatch]]]:
    """Shuffle (seeded) and split into minibatches, each laid out in micro-batches on ``device``.

    One permutation of the whole batch (every rank's sequences, in rank order; with
    ``spec.minibatch_split == "group"`` of its groups, ``groups`` giving each sequence's global group):
    minibatch k holds the same sequences however many ranks share the batch, each rank its own of them.
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
        counts = all_gather_objects(len(sequences))
        offset = sum(counts[: rank()])
        order = torch.randperm(sum(counts), generator=generator).tolist()
        chunks = [
            [g - offset for g in c.tolist() if offset <= g < offset + len(sequences)]
            for c in _split(order, spec.minibatches)
        ]
    out = []
    for ids in chunks:
        micro = make_micro_batches(
            [sequences[i] for i in ids],
            layout=spec.layout,
            pack_length=spec.pack_length,
            micro_batch_tokens=spec.micro_batch_tokens,
            pad_id=spec.pad_id,
        )
        out.append((ids, micro))
    # every rank runs as many micro-batches per minibatch (under FSDP2 each pass is a collective)
    padded = pad_micro_batches([micro for _, micro in out], spec.pad_id)
    return [(ids, [mb.to(device) for mb in micro]) for (ids, _), micro in zip(out, padded, strict=True)]


def _split(order: list[int], parts: int) -> list[np.ndarray]:
    """``order`` in ``parts`` consecutive chunks of near-equal size (fewer when there are fewer items)."""
    return np.array_split(np.array(order, dtype=np.int64), max(1, min(parts, len(order))))


def update(
    policy: Policy,
    spec: UpdateSpec,
    ids: list[int],
    micro: list[MicroBatch],
    advantages: Advantages,
    old: list[torch.Tensor],
    ref: list[torch.Tensor] | None,
    routes: list[moe.Routing] | None = None,
    measure_mismatch: bool = False,
    sampled: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One optimizer update on a minibatch (gradient accumulation over its micro-batches).

    ids: the minibatch's sequences (indices into the batch); old, ref, sampled: per micro-batch, the old,
    the reference and the sampler's log-probs (sampled: for ``spec.correction``); routes (MoE models): the old policy's expert choices per micro-batch,
    replayed with ``spec.routing_replay`` and compared with the current routers' own choices otherwise.
    measure_mismatch: ``old`` is the sampler's and the policy has not moved yet (the first minibatch of
    ``old_logprobs="sampler"``): this forward is the old policy's, so the sampler/trainer mismatch
    metrics come at no extra cost.
    """
    per_token = not isinstance(advantages, torch.Tensor)
    # per-token advantages: GSPO as GSPO-token (GSPO's value and gradient for per-sequence ones)
    loss_spec = spec.loss
    if per_token and loss_spec.objective == "gspo":
        loss_spec = dataclasses.replace(loss_spec, objective="gspo_token")
    # the minibatch's normaliser, over all ranks: 1/B per sequence, or 1/tokens for token-mean; each
    # rank's loss is its share of the one-process loss, and the ranks' gradients are summed
    if spec.loss.aggregation == "token-mean":
        normalizer = float(sum(int((mb.segment_ids >= 0).sum()) for mb in micro))
    elif (
        spec.loss.aggregation == "seq-mean-token-sum-norm"
    ):  # Dr. GRPO: a constant number of tokens per sequence
        normalizer = float(len(ids) * spec.max_new_tokens)
    else:
        normalizer = float(len(ids))
    normalizer = all_reduce_sum(normalizer)
    policy.optimizer.zero_grad(set_to_none=True)
    metrics, losses, deltas, seq_ratios = [], [], [], []
    moved = moe.RoutingDifference()  # MoE: the current routers' own choices vs the old policy's
    for j, mb in enumerate(micro):
        set_gradient_sync(policy.scorer, j == len(micro) - 1)  # DDP: sum once, at the end
        if routes is None:
            logp = score(policy.scorer, mb, spec)
        else:
            if spec.routing_replay:
                routing = moe.routing_replay(policy.model, routes[j])
            else:
                routing = moe.record_routing(policy.model)
            with routing as natural:  # what the current routers choose themselves, replayed or not
                logp = score(policy.scorer, mb, spec)
            moved = moved + moe.routing_difference(routes[j], natural, mb.logprob_mask)
        if per_token:  # per completion token, laid out like logp: (R*L,)
            adv = place([advantages[i] for i in ids], mb)
        else:
            adv = advantages[[ids[i] for i in mb.indices]].to(logp.device)
        inputs = LossInputs(
            logp,
            old[j],
            adv,
            mb.segment_ids,
            len(mb.indices),
            ref_logp=None if ref is None else ref[j],
            sampler_logp=None if sampled is None else sampled[j],
            normalizer=normalizer,
        )
        loss, m = compute_loss(loss_spec, inputs)
        loss.backward()
        losses.append(loss.detach())  # read back once, after the loop
        if mb.indices:  # not an idle micro-batch (distributed padding)
            metrics.append(m)
            if measure_mismatch:
                delta, seq, counts = sampler_log_ratios(
                    logp.detach(), old[j], mb.segment_ids, len(mb.indices)
                )
                deltas.append(delta)
                seq_ratios.append(seq[counts > 0])
    params = [p for p in policy.model.parameters() if p.requires_grad]
    max_norm = spec.max_grad_norm if spec.max_grad_norm > 0 else float("inf")
    grad_norm = clip_grad_norm(params, max_norm, policy.optimizer)  # fused AdamW: applied inside its step
    policy.optimizer.step()
    release_grad_scale(policy.optimizer)
    policy.scheduler.step()
    out = reduce_metrics(all_gather_metrics(metrics))  # all ranks' micro-batches
    out["loss"] = all_reduce_sum(float(torch.stack(losses).sum()))
    out["grad_norm"] = float(grad_norm)
    if routes is not None:  # learn() renames them by the number of updates before this one
        out.update(moved.metrics("live_"))
    if measure_mismatch:
        out.update(mismatch_metrics(*(all_gather_varlen(_cat(x)) for x in (deltas, seq_ratios))))
    return out


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors).cpu() if tensors else torch.zeros(0)


def _old_policy(
    policy: Policy, spec: UpdateSpec, batch: Batch, layout: list[tuple[list[int], list[MicroBatch]]]
) -> tuple[
    list[list[torch.Tensor]],
    list[list[torch.Tensor] | None],
    list[list[moe.Routing] | None],
    list[list[torch.Tensor]],
    dict[str, float],
]:
    """Old-policy log-probs (and reference ones, expert choices) per micro-batch, before any update.

    With ``spec.old_logprobs == "recompute"`` the trainer's own forward pass, which also gives the
    sampler/trainer mismatch metrics (gspo.core.mismatch); with "sampler" the sampler's log-probs, a token
    it did not report (NaN) recomputed. Returns (old, ref, routes, sampled, metrics); sampled: the sampler's
    log-probs per micro-batch (NaN where unknown), which the mismatch corrections weigh by.
    """
    sequences, sampler_logprobs = batch.sequences, batch.sampler_logprobs
    # a trained token the sampler gave no log-prob for (NaN, e.g. llama.cpp's EOS) needs the trainer's
    unknown = sum(
        t and not math.isfinite(lp)
        for seq, lps in zip(sequences, sampler_logprobs, strict=True)
        for t, lp in zip(seq.train_mask, lps, strict=True)
    )
    recompute = spec.old_logprobs == "recompute" or all_reduce_sum(float(unknown)) > 0
    old, ref, routes, deltas, sampled_all = [], [], [], [], []
    seq_log_ratio, seq_counted = torch.zeros(len(sequences)), torch.zeros(len(sequences))
    # old policy = the current weights, before any update of this step; FSDP2 gathers them once
    with torch.no_grad(), full_parameters(policy.scorer):
        for ids, micro in layout:
            sampled = [place([sampler_logprobs[i] for i in ids], mb) for mb in micro]
            sampled_all.append(sampled)
            if recompute:
                with moe.record_passes(policy.model, enabled=policy.moe) as passes:  # MoE: expert choices
                    recomputed = [score(policy.scorer, mb, spec) for mb in micro]
                routes.append(passes or None)
                for mb, r, s in zip(micro, recomputed, sampled, strict=True):
                    if not mb.indices:  # an idle micro-batch scores nothing
                        continue
                    delta, seq, counts = sampler_log_ratios(r, s, mb.segment_ids, len(mb.indices))
                    deltas.append(delta)
                    seq_log_ratio[[ids[i] for i in mb.indices]] = seq.cpu()
                    seq_counted[[ids[i] for i in mb.indices]] = counts.cpu()
                if spec.old_logprobs == "recompute":
                    old.append(recomputed)
                else:  # the sampler's log-probs; the trainer's only where the sampler gave none
                    old.append(
                        [torch.where(torch.isnan(s), r, s) for r, s in zip(recomputed, sampled, strict=True)]
                    )
            else:
                old.append(sampled)
                with policy.autocast():
                    routes.append(
                        [moe.expert_choices(policy.model, mb) for mb in micro] if policy.moe else None
                    )
            ref.append([policy.reference_logprobs(mb, spec) for mb in micro] if spec.loss.beta > 0 else None)
    metrics: dict[str, float] = {}
    if spec.old_logprobs == "recompute":  # both log-probs known: how far apart (gspo.core.mismatch)
        delta = all_gather_varlen(torch.cat(deltas) if deltas else torch.zeros(0))
        metrics.update(mismatch_metrics(delta, all_gather_varlen(seq_log_ratio[seq_counted > 0])))
    else:
        trained = sum(sum(seq.train_mask) for seq in sequences)
        metrics["sampler_logprob_missing_frac"] = unknown / max(trained, 1)  # recomputed by the trainer
    metrics["old_logprobs_recomputed"] = float(recompute)
    return old, ref, routes, sampled_all, metrics


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
    """
    layout = minibatches(spec, batch.sequences, seed=seed, device=policy.device, groups=batch.groups)
    t0 = time.perf_counter()
    old, ref, routes, sampled, out = _old_policy(policy, spec, batch, layout)
    out["time_old_logprobs"] = time.perf_counter() - t0
    # what the updates compute vs what is there: real tokens (each sequence whole), unique tokens (a
    # group's prompt once); the layout's padding and prompt repeats make the difference
    computed = sum(mb.num_tokens for _, micro in layout for mb in micro if mb.indices)
    out["update_tokens"] = all_reduce_sum(float(computed))
    out["real_tokens"] = all_reduce_sum(float(sum(len(seq) for seq in batch.sequences)))
    out["unique_tokens"] = all_reduce_sum(float(unique_tokens(batch)))
    t0 = time.perf_counter()
    updates = []
    for j, ((ids, micro), o, r, rt, sa) in enumerate(zip(layout, old, ref, routes, sampled, strict=True)):
        # the sampler's log-probs are the old ones: the first minibatch's forward is the old policy's
        mismatch = j == 0 and not out["old_logprobs_recomputed"]
        with around_update() if around_update is not None else contextlib.nullcontext():
            sa = (
                sa if spec.loss.sampler_correction != "none" else None
            )  # the sampler's log-probs, for the correction
            updates.append(
                update(
                    policy,
                    spec,
                    ids,
                    micro,
                    batch.advantages,
                    o,
                    r,
                    rt,
                    measure_mismatch=mismatch,
                    sampled=sa,
                )
            )
    out["time_update"] = time.perf_counter() - t0
    if policy.moe:
        t0 = time.perf_counter()
        # minibatch j was scored after j updates of this step (j = 0: no change, not logged)
        for j, metrics in enumerate(updates):
            for key in [k for k in metrics if k.startswith("live_")]:
                live = metrics.pop(key)
                if j:
                    out[f"{key.removeprefix('live_')}_after_{j}_updates"] = live
        # this rank's batch routed again by the policy after all this step's updates (FSDP2: gathered once)
        with full_parameters(policy.scorer), policy.autocast():
            out.update(
                moe.routing_volatility(
                    policy.model,
                    [mb for _, micro in layout for mb in micro],
                    [r for rs in routes for r in rs],
                )
            )
        out["time_routing"] = time.perf_counter() - t0
    return {**reduce_metrics(updates), **out}
