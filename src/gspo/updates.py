"""The learning half of a step: old-policy log-probs, then K minibatch updates on scored sequences.

`learn` takes sequences (prompt + completion ids with a train mask), their advantages and the sampler's
log-probs, from the trainer's own rollouts (`Trainer.train_step`) or the user's trajectories
(`gspo.trajectories`). Old-policy log-probs are computed once, without grad, on exactly the micro-batch
layout the updates will use (so the first minibatch's ratios are exactly 1). The batch is then split
into `minibatches_per_rollout` minibatches, one optimizer update each (`update`): only the first is
on-policy, which is where GSPO and GRPO differ. Within a minibatch, micro-batches accumulate gradients
with the minibatch's normaliser passed to the loss, so accumulation reproduces the full-minibatch
gradient exactly. The functions take the `Trainer` that holds the model, optimizer and config.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gspo import distributed, moe
from gspo.batching import MicroBatch, Sequence, make_micro_batches
from gspo.config import Config
from gspo.logprobs import causal_lm_logprobs
from gspo.losses import PACKED_OBJECTIVES
from gspo.metrics import mean_metrics, tensors_to_floats
from gspo.mismatch import mismatch_metrics, sampler_log_ratios, truncated_is_weights

if TYPE_CHECKING:
    from gspo.trainer import Trainer


def _as_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    values = dict(zip(tensors, tensors_to_floats(list(tensors.values())), strict=True))
    return {k: values.get(k, v) for k, v in metrics.items()}


def _reduce_metrics(items: list[Mapping[str, Any]]) -> dict[str, float]:
    """Mean over minibatches, except extremes (min of *_min, max of *_max) and counts (sum of num_*)."""
    items = [_as_floats(m) for m in items]  # one sync per item, not one per key
    means = mean_metrics(items)
    for key in means:
        values = [m[key] for m in items if key in m]
        if key.endswith("_min"):
            means[key] = min(values)
        elif key.endswith("_max"):
            means[key] = max(values)
        elif key.startswith("num_"):
            means[key] = sum(values)
    return means


def score(model: torch.nn.Module, mb: MicroBatch, config: Config) -> torch.Tensor:
    """log pi(token) of every completion token of a micro-batch, flattened to (R*L,); 0 elsewhere.

    `model`: a causal LM, or the data-parallel scorer wrapping it (gspo.distributed.wrap_model).
    """
    score = model if distributed.is_scorer(model) else functools.partial(causal_lm_logprobs, model)
    logp = score(
        mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
        logprob_mask=mb.logprob_mask, temperature=config.rollout.temperature,
        chunk_size=config.train.logprob_chunk_size,
    )  # fmt: skip
    return logp.reshape(-1)


def place(values: list[list[float]], mb: MicroBatch) -> torch.Tensor:
    """Scatter per-sequence completion-token values into a micro-batch's flattened layout (its device)."""
    device = mb.logprob_mask.device
    flat = torch.zeros(mb.logprob_mask.numel(), device=device)
    flat[mb.logprob_mask.reshape(-1)] = torch.tensor(
        [v for i in mb.indices for v in values[i]], dtype=torch.float32, device=device
    )
    return flat


def minibatches(trainer: Trainer, sequences: list[Sequence]) -> list[tuple[list[int], list[MicroBatch]]]:
    """Shuffle (seeded by step) and split into minibatches, each laid out in micro-batches."""
    generator = torch.Generator().manual_seed(trainer.config.seed * 1_000_003 + trainer.step)
    # one permutation of the whole batch (every rank's sequences, in rank order): minibatch k holds
    # the same sequences however many ranks share the batch, each rank its own of them
    counts = distributed.all_gather_objects(len(sequences))
    offset = sum(counts[: distributed.rank()])
    order = torch.randperm(sum(counts), generator=generator).tolist()
    k = trainer.config.train.minibatches_per_rollout
    out = []
    for chunk in np.array_split(np.array(order), k):
        ids = [g - offset for g in chunk.tolist() if offset <= g < offset + len(sequences)]
        micro = make_micro_batches(
            [sequences[i] for i in ids], packed=trainer.packed, pack_length=trainer.config.train.pack_length,
            micro_batch_tokens=trainer.config.train.micro_batch_tokens, pad_id=trainer.pad_id,
        )  # fmt: skip
        out.append((ids, micro))
    # every rank runs as many micro-batches per minibatch (under FSDP2 each pass is a collective)
    padded = distributed.pad_micro_batches([micro for _, micro in out], trainer.pad_id)
    return [
        (ids, [mb.to(trainer.device) for mb in micro]) for (ids, _), micro in zip(out, padded, strict=True)
    ]


def update(
    trainer: Trainer, ids: list[int], micro: list[MicroBatch], advantages: torch.Tensor | list[list[float]],
    old: list[torch.Tensor],
    ref: list[torch.Tensor] | None, routes: list[moe.Routing] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One optimizer update on a minibatch (gradient accumulation over its micro-batches).

    routes (MoE models): the old policy's expert choices per micro-batch, replayed with
    `train.routing_replay` and compared with the current router's own choices otherwise.
    """
    cfg = trainer.config.train
    # per-token advantages: GSPO as GSPO-token (GSPO's value and gradient for per-sequence ones)
    per_token = not isinstance(advantages, torch.Tensor)
    objective = PACKED_OBJECTIVES["gspo_token" if per_token and cfg.objective == "gspo" else cfg.objective]
    # the minibatch's normaliser: 1/B per sequence, or 1/tokens for token-mean
    if cfg.aggregation == "token-mean":
        normalizer = float(sum(int((mb.segment_ids >= 0).sum()) for mb in micro))
    else:
        normalizer = float(len(ids))
    # the whole minibatch's count, over all ranks: each rank's loss is its share of the one-process
    # loss, and the ranks' gradients are summed (not averaged: see distributed.wrap_model)
    normalizer = distributed.all_reduce_sum(normalizer)
    trainer.optimizer.zero_grad(set_to_none=True)
    metrics, losses = [], []
    moved = moe.RoutingDifference()  # MoE: the current routers' own choices vs the old policy's
    for j, mb in enumerate(micro):
        distributed.set_gradient_sync(trainer.scorer, j == len(micro) - 1)  # DDP: sum once, at the end
        if routes is None:
            logp = score(trainer.scorer, mb, trainer.config)
        else:
            if cfg.routing_replay:
                routing = moe.routing_replay(trainer.model, routes[j])
            else:
                routing = moe.record_routing(trainer.model)
            with routing as natural:  # what the current routers choose themselves, replayed or not
                logp = score(trainer.scorer, mb, trainer.config)
            moved = moved + moe.routing_difference(routes[j], natural, mb.logprob_mask)
        if isinstance(advantages, torch.Tensor):
            adv = advantages[[ids[i] for i in mb.indices]].to(trainer.device)
        else:  # per completion token, laid out like logp: (R*L,)
            adv = place([advantages[i] for i in ids], mb)
        loss, m = objective(
            logp, old[j], adv, mb.segment_ids, len(mb.indices), eps_low=trainer.eps_low, eps_high=trainer.eps_high,
            aggregation=cfg.aggregation, normalizer=normalizer, ref_logp=None if ref is None else ref[j],
            beta=cfg.beta,
        )  # fmt: skip
        loss.backward()
        losses.append(loss.detach())  # read back once, after the loop
        if mb.indices:  # not an idle micro-batch (distributed padding)
            metrics.append(m)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grad_norm = distributed.clip_grad_norm(  # fused AdamW: applied inside its step
        params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"), trainer.optimizer
    )
    trainer.optimizer.step()
    distributed.release_grad_scale(trainer.optimizer)
    trainer.scheduler.step()
    out = _reduce_metrics(distributed.all_gather_metrics(metrics))  # all ranks' micro-batches
    out["loss"] = distributed.all_reduce_sum(float(torch.stack(losses).sum()))
    out["grad_norm"] = float(grad_norm)
    if routes is not None:  # learn() renames them by the number of updates before this one
        out.update(moved.metrics("live_"))
    return out


def learn(
    trainer: Trainer,
    sequences: list[Sequence],
    advantages: torch.Tensor | list[list[float]],
    sampler_logprobs: list[list[float]],
) -> dict[str, float]:
    """Old-policy log-probs, then `minibatches_per_rollout` updates on scored sequences.

    sequences: prompt + completion token ids with a per-token train mask; advantages: (n,) one per
    sequence, or one list per sequence with a value per completion token (trained with GSPO-token when
    the objective is gspo); sampler_logprobs: the sampler's log-prob of each completion token, NaN where
    unknown (the old policy with `train.old_logprobs=sampler`, recomputed where unknown; with
    `recompute`, the sampler/trainer mismatch metrics and `train.sampler_is_cap`, see gspo.mismatch).
    """
    cfg = trainer.config
    batches = trainer.minibatches(sequences)
    t0 = time.perf_counter()
    # a trained token the sampler gave no log-prob for (NaN, e.g. llama.cpp's EOS) needs the trainer's
    unknown = sum(
        t and not math.isfinite(lp)
        for seq, lps in zip(sequences, sampler_logprobs, strict=True)
        for t, lp in zip(seq.train_mask, lps, strict=True)
    )
    recompute = cfg.train.old_logprobs == "recompute" or distributed.all_reduce_sum(float(unknown)) > 0
    old, ref, deltas = [], [], []
    seq_log_ratio, seq_counted = torch.zeros(len(sequences)), torch.zeros(len(sequences))
    routes: list[list[moe.Routing] | None] = []  # MoE: the old policy's expert choices per micro-batch
    # old policy = the current weights, before any update of this step; FSDP2 gathers them once
    with torch.no_grad(), distributed.full_parameters(trainer.scorer):
        for ids, micro in batches:
            sampled = [place([sampler_logprobs[i] for i in ids], mb) for mb in micro]
            if recompute:
                with moe.record_passes(
                    trainer.model, enabled=trainer.is_moe
                ) as passes:  # MoE: expert choices
                    recomputed = [score(trainer.scorer, mb, cfg) for mb in micro]
                routes.append(passes or None)
                for mb, r, s in zip(micro, recomputed, sampled, strict=True):
                    if not mb.indices:  # an idle micro-batch scores nothing
                        continue
                    delta, seq, counts = sampler_log_ratios(r, s, mb.segment_ids, len(mb.indices))
                    deltas.append(delta)
                    seq_log_ratio[[ids[i] for i in mb.indices]] = seq.cpu()
                    seq_counted[[ids[i] for i in mb.indices]] = counts.cpu()
                if cfg.train.old_logprobs == "recompute":
                    old.append(recomputed)
                else:  # the sampler's log-probs; the trainer's only where the sampler gave none
                    old.append(
                        [torch.where(torch.isnan(s), r, s) for r, s in zip(recomputed, sampled, strict=True)]
                    )
            else:
                old.append(sampled)
                with trainer.autocast():
                    choices = (
                        [moe.expert_choices(trainer.model, mb) for mb in micro] if trainer.is_moe else None
                    )
                routes.append(choices)
            ref.append([trainer.reference_score(mb) for mb in micro] if cfg.train.beta > 0 else None)
    out: dict[str, float] = {"time_old_logprobs": time.perf_counter() - t0}
    # what the updates compute vs what is real: padding overhead of the layout
    out["update_tokens"] = distributed.all_reduce_sum(
        float(sum(mb.num_tokens for _, micro in batches for mb in micro if mb.indices))
    )
    out["real_tokens"] = distributed.all_reduce_sum(float(sum(len(seq) for seq in sequences)))
    if cfg.train.old_logprobs == "recompute":  # both log-probs known: how far apart (gspo.mismatch)
        delta = distributed.all_gather_varlen(torch.cat(deltas) if deltas else torch.zeros(0))
        out.update(mismatch_metrics(delta, distributed.all_gather_varlen(seq_log_ratio[seq_counted > 0])))
        if cfg.train.sampler_is_cap > 0:  # truncated IS: scaling A_i by w_i scales sequence i's loss
            weights = truncated_is_weights(seq_log_ratio, cfg.train.sampler_is_cap)  # (n,), 1 if unknown
            if isinstance(advantages, torch.Tensor):
                advantages = advantages * weights
            else:
                advantages = [
                    [a * float(w) for a in adv] for adv, w in zip(advantages, weights.tolist(), strict=True)
                ]
            counted = weights[seq_counted > 0]
            if counted.numel():
                out["sampler_is_weight_mean"] = float(counted.mean())
                out["sampler_is_truncated_frac"] = float((counted >= cfg.train.sampler_is_cap).float().mean())
    else:
        trained = sum(sum(seq.train_mask) for seq in sequences)
        out["sampler_logprob_missing_frac"] = unknown / max(trained, 1)  # recomputed by the trainer
    t0 = time.perf_counter()
    updates = [
        trainer.update(ids, micro, advantages, o, r, rt)
        for (ids, micro), o, r, rt in zip(batches, old, ref, routes, strict=True)
    ]
    out["time_update"] = time.perf_counter() - t0
    if trainer.is_moe:
        t0 = time.perf_counter()
        # minibatch j was scored after j updates of this step (j = 0: no change, not logged)
        for j, update in enumerate(updates):
            for key in [k for k in update if k.startswith("live_")]:
                live = update.pop(key)
                if j:
                    out[f"{key.removeprefix('live_')}_after_{j}_updates"] = live
        # the whole rollout batch, routed again by the policy after all this step's updates
        # this rank's batch; FSDP2: gathered once
        with distributed.full_parameters(trainer.scorer), trainer.autocast():
            out.update(
                moe.routing_volatility(
                    trainer.model,
                    [mb for _, micro in batches for mb in micro],
                    [r for rs in routes for r in rs],
                )
            )
        out["time_routing"] = time.perf_counter() - t0
    return {**_reduce_metrics(updates), **out}
