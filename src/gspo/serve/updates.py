"""POST /v1/train: trajectory groups of recorded completions -> samples -> the configured objective's updates.

A trajectory names the completions of its turns, in order. Each turn's record holds the exact prompt and
completion tokens the engine saw and drew, so a trajectory is rebuilt from records alone, never from text:
where turn k+1's prompt starts with turn k's prompt and completion (the server splices its own tokens into
chat prompts, so an agent that appends the assistant message gets this), the turns form one sequence, whose
sampled tokens get loss and whose tokens in between (tool results, user turns, template glue) are context.
Where a prompt does not extend the previous turn's tokens (the agent rewrote the history, or the template
renders old turns differently), the trajectory is trained as separate exact segments, one per run of
consistent turns, each with the trajectory's advantage; the answer lists those trajectories and the
metrics count them. Nothing is re-tokenised.

Everything is checked before the first update (ids known, finished, fresh enough, rewards finite, lengths
right); the updates themselves run on a snapshot's promise: if they fail, the weights, optimizer and
schedule are put back as they were. gspo.learning.step.learn_from_samples computes the advantages and runs
the updates, as for `gspo train`.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo.config import Config
from gspo.core.layout import TokenSequence
from gspo.core.samples import Sample
from gspo.core.seeds import step_seed
from gspo.learning.batch import Batch
from gspo.learning.policy import Policy, UpdateSpec, update_choices, with_correction
from gspo.learning.step import learn_from_samples
from gspo.learning.weights import copy_weights
from gspo.serve.protocol import FLOAT32_MAX, ServeError, TrainRequest, TrajectoryIn
from gspo.serve.records import Record, RecordStore


@dataclass
class Segment:
    """A run of a trajectory's turns in which each prompt starts with the previous turn's prompt and
    completion: one exact sequence. turns / logprobs: per completion token, the turn it was drawn in
    (-1: context) and the sampler's log-prob (NaN for context)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    turns: list[int]
    logprobs: list[float]


@dataclass
class Rebuilt:
    """A trajectory rebuilt from its records: its segments and, when there are several, why."""

    group: int
    index: int
    records: list[Record]
    segments: list[Segment]
    breaks: list[str] = field(default_factory=list)


def split_segments(records: list[Record]) -> tuple[list[Segment], list[str]]:
    """A trajectory's turns as exact segments (module docstring), and a note for each break."""
    segments: list[Segment] = []
    breaks: list[str] = []
    for k, record in enumerate(records):
        prompt, completion = list(record.prompt_ids), list(record.completion_ids)
        if segments:
            last = segments[-1]
            history = last.prompt_ids + last.completion_ids
            if prompt[: len(history)] == history:
                context = prompt[len(history) :]
                last.completion_ids += context + completion
                last.turns += [-1] * len(context) + [k] * len(completion)
                last.logprobs += [math.nan] * len(context) + list(record.logprobs)
                continue
            at = next(
                (j for j, (a, b) in enumerate(zip(prompt, history, strict=False)) if a != b), len(prompt)
            )
            breaks.append(
                f"turn {k}'s prompt does not start with turn {k - 1}'s prompt and completion (they differ "
                f"from token {at} of {len(history)})"
            )
        segments.append(Segment(prompt, completion, [k] * len(completion), list(record.logprobs)))
    return segments, breaks


def resolve(request: TrainRequest, records: RecordStore, version: int, max_staleness: int) -> list[Rebuilt]:
    """Each trajectory's records, checked: known, not cancelled, at most max_staleness versions old, used
    once (in this call and across calls); groups of two or more (unless advantages are given); turn
    rewards and advantages of the right lengths. Errors name the field."""
    seen: dict[str, str] = {}
    out = []
    given = [t.advantages is not None for g in request.groups for t in g.trajectories]
    if any(given) and not all(given):
        raise ServeError(400, "groups: give advantages for every trajectory or for none", param="groups")
    for g, group in enumerate(request.groups):
        for i, trajectory in enumerate(group.trajectories):
            where = f"groups[{g}].trajectories[{i}]"
            turns = []
            for k, completion_id in enumerate(trajectory.completion_ids):
                name = f"{where}.completion_ids[{k}]"
                turns.append(_record(records, completion_id, name, version, max_staleness))
                if completion_id in seen:
                    raise ServeError(
                        400, f"{name}: completion {completion_id!r} is also {seen[completion_id]}", param=name
                    )
                seen[completion_id] = name
            _check_lengths(trajectory, turns, where)
            segments, breaks = split_segments(turns)
            out.append(Rebuilt(g, i, turns, segments, breaks))
        if len(group.trajectories) < 2 and not any(given):
            raise ServeError(
                400,
                f"groups[{g}].trajectories: a group of 1 trajectory trains nothing: advantages compare the "
                "trajectories of a group with each other (as gspo train's rollout.group_size, at least 2); "
                "send the attempts at one task as one group, or give each trajectory's advantages",
                param=f"groups[{g}].trajectories",
                code="group_of_one",
            )
    return out


def _record(records: RecordStore, completion_id: str, name: str, version: int, max_staleness: int) -> Record:
    record = records.get(completion_id)
    if record is None:
        raise ServeError(
            400,
            f"{name}: unknown or expired completion id {completion_id!r} (records live serve.record_ttl seconds, "
            "at most serve.max_records of them, and not across a restart)",
            param=name,
            code="unknown_completion",
        )
    if record.trained_in is not None:
        raise ServeError(
            400,
            f"{name}: completion {completion_id!r} was trained already (the update to policy version "
            f"{record.trained_in}); a completion is trained once: sample again",
            param=name,
            code="trained_completion",
        )
    if record.finish_reason == "cancelled":
        raise ServeError(
            400, f"{name}: completion {completion_id!r} was cancelled before it ended", param=name
        )
    if version - record.version > max_staleness:
        raise ServeError(
            400,
            f"{name}: completion {completion_id!r} was sampled at policy version {record.version}, "
            f"{version - record.version} versions before the current {version}, beyond serve.max_staleness="
            f"{max_staleness}: sample it again",
            param=name,
            code="stale_completion",
        )
    return record


def _check_lengths(trajectory: TrajectoryIn, turns: list[Record], where: str) -> None:
    if trajectory.turn_rewards is not None and len(trajectory.turn_rewards) != len(turns):
        raise ServeError(
            400,
            f"{where}.turn_rewards: {len(trajectory.turn_rewards)} rewards for {len(turns)} turns (one per completion)",
            param=f"{where}.turn_rewards",
        )
    if abs(sum(trajectory.turn_rewards or []) + trajectory.reward) > FLOAT32_MAX:  # the return, in float32
        raise ServeError(
            400,
            f"{where}.turn_rewards: the return (turn rewards plus reward) is beyond float32's range (about "
            "3.4e38), in which the trainer computes: send smaller values",
            param=f"{where}.turn_rewards",
        )
    if trajectory.advantages is None:
        return
    if len(trajectory.advantages) != len(turns):
        raise ServeError(
            400,
            f"{where}.advantages: {len(trajectory.advantages)} lists for {len(turns)} turns",
            param=f"{where}.advantages",
        )
    for k, (values, record) in enumerate(zip(trajectory.advantages, turns, strict=True)):
        if len(values) != len(record.completion_ids):
            raise ServeError(
                400,
                f"{where}.advantages[{k}]: {len(values)} values for the {len(record.completion_ids)} tokens of "
                "that completion (its token_ids, stop token included)",
                param=f"{where}.advantages[{k}]",
            )


def to_samples(request: TrainRequest, rebuilt: list[Rebuilt]) -> list[Sample]:
    """One `Sample` per trajectory for make_batch (advantages, reward metrics): its segments' completions
    end to end (a split trajectory's sequences are laid out per segment afterwards by `per_segment`)."""
    per_turn = any(t.turn_rewards is not None for g in request.groups for t in g.trajectories)
    samples = []
    for item in rebuilt:
        trajectory = request.groups[item.group].trajectories[item.index]
        first = item.segments[0]
        turns = [t for s in item.segments for t in s.turns]
        rewards = None
        if per_turn:
            rewards = list(trajectory.turn_rewards or [0.0] * len(item.records))
        samples.append(
            Sample(
                first.prompt_ids,
                [t for s in item.segments for t in s.completion_ids],
                [lp for s in item.segments for lp in s.logprobs],
                trajectory.reward,
                group=item.group,
                truncated=any(r.finish_reason == "length" for r in item.records),
                train_mask=[t >= 0 for t in turns],
                turns=turns,
                turn_rewards=rewards,
            )
        )
    return samples


def per_segment(
    batch: Batch, *, samples: list[Sample], rebuilt: list[Rebuilt], request: TrainRequest
) -> Batch:
    """The batch with each trajectory laid out as its segments (each its trajectory's advantage, or the
    client's own per-token advantages), in make_batch's order (groups it filtered out stay out)."""
    kept_groups = set(batch.groups)
    kept = [i for i, s in enumerate(samples) if s.group in kept_groups]
    given = request.groups[0].trajectories[0].advantages is not None
    sequences, advantages, logprobs, groups = [], [], [], []
    for j, i in enumerate(kept):
        item, start = rebuilt[i], 0
        mask = batch.sequences[j].train_mask  # make_batch's: truncated samples masked if configured
        trajectory = request.groups[item.group].trajectories[item.index]
        for segment in item.segments:
            end = start + len(segment.completion_ids)
            sequences.append(TokenSequence(segment.prompt_ids, segment.completion_ids, mask[start:end]))
            if given:
                advantages.append(_given_advantages(trajectory, item.records, segment))
            elif isinstance(batch.advantages, list):
                advantages.append(batch.advantages[j][start:end])
            else:
                advantages.append(float(batch.advantages[j]))
            logprobs.append(segment.logprobs)
            groups.append(batch.groups[j])
            start = end
    per_token = given or isinstance(batch.advantages, list)
    return Batch(sequences, advantages if per_token else torch.tensor(advantages), logprobs, groups)


def _given_advantages(trajectory: TrajectoryIn, records: list[Record], segment: Segment) -> list[float]:
    """The client's advantage of each completion token of a segment (0 on context)."""
    position = collections.Counter()
    out = []
    for k in segment.turns:
        if k < 0:
            out.append(0.0)
        else:
            out.append(float(trajectory.advantages[k][position[k]]))
            position[k] += 1
    return out


def drawn_whole_now(config: Config, records: list[Record], version: int) -> bool:
    """Every record drawn whole at the current version, sampled at the temperature the trainer scores: its
    log-probs are the current weights' own (the `exact` of gspo.learning.policy.update_choices)."""
    return all(
        r.versions == (version, version) and not r.greedy and r.temperature == config.rollout.temperature
        for r in records
    )


class Snapshot:
    """The trainable weights, optimizer state and schedule, copied before a train call's updates so a
    failure puts them back (the weights' buffers are allocated once and reused)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.params = [
            p for p in policy.model.parameters() if p.requires_grad
        ]  # gradients cleared on restore
        self.weights: list[torch.Tensor] | None = None
        self.state: dict[Any, dict[str, Any]] = {}
        self.groups: list[dict[str, Any]] = []
        self.scheduler: dict[str, Any] = {}

    @torch.no_grad()
    def take(self) -> None:
        self.weights = copy_weights(self.policy.model, into=self.weights)
        optimizer = self.policy.optimizer
        self.state = {
            p: {k: v.clone() if torch.is_tensor(v) else copy.copy(v) for k, v in s.items()}
            for p, s in optimizer.state.items()
        }
        self.groups = [
            {k: copy.copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        self.scheduler = copy.deepcopy(self.policy.scheduler.state_dict())

    @torch.no_grad()
    def restore(self) -> None:
        assert self.weights is not None, "restore() before take()"
        copy_weights(self.weights, into=self.policy.model)
        optimizer = self.policy.optimizer
        optimizer.state = collections.defaultdict(dict, {p: dict(s) for p, s in self.state.items()})
        for group, saved in zip(optimizer.param_groups, self.groups, strict=True):
            group.update(saved)
        self.policy.scheduler.load_state_dict(self.scheduler)
        for p in self.params:
            p.grad = None


@dataclass
class Update:
    """What one train call computes with: its samples and how its batch is laid out, its spec, the step's
    seed; and what it reports."""

    samples: list[Sample]
    completions: list[Record]
    """The records it trains (marked trained once its step is taken)."""
    relayout: Callable[[Batch], Batch] | None
    spec: UpdateSpec
    seed: int
    metrics: dict[str, float]
    split: list[dict[str, Any]]


def prepare_update(
    request: TrainRequest,
    rebuilt: list[Rebuilt],
    config: Config,
    policy: Policy,
    spec: UpdateSpec,
    version: int,
) -> Update:
    """The samples of a train call, the layout of its batch, the old-policy mode and the report."""
    samples = to_samples(request, rebuilt)
    given = request.groups[0].trajectories[0].advantages is not None
    split = [r for r in rebuilt if len(r.segments) > 1]
    relayout = None
    if split or given:
        relayout = functools.partial(per_segment, samples=samples, rebuilt=rebuilt, request=request)
    records = [r for item in rebuilt for r in item.records]
    staleness = [version - r.version for r in records]
    metrics = {
        "trajectories": float(len(rebuilt)),
        "turns": float(len(records)),
        "split_trajectories": float(len(split)),
        "segments": float(sum(len(r.segments) for r in rebuilt)),
        "staleness_max": float(max(staleness)),
        "staleness_mean": sum(staleness) / len(staleness),
        "mixed_version_completions": float(sum(r.versions[0] != r.versions[1] for r in records)),
    }
    stale = any(r.versions[0] < version for r in records)  # drawn (partly) by an older version
    exact = drawn_whole_now(config, records, version)
    mode, correction = update_choices(config, policy.compute_dtype, exact=exact, stale=stale)
    spec = with_correction(config, spec, mode, correction)
    report = [
        {"group": r.group, "trajectory": r.index, "segments": len(r.segments), "breaks": r.breaks}
        for r in split
    ]
    seed = step_seed(config.seed, version)  # as gspo train's: the version is the step
    return Update(samples, records, relayout, spec, seed, metrics, report)


def completion_rows(
    request: TrainRequest, rebuilt: list[Rebuilt], tokenizer: Any, limit: int
) -> list[dict[str, Any]]:
    """The first `limit` completions a train call trains, one row per turn as `gspo train` logs its
    samples (gspo.run.metrics.MetricsLogger.log_samples): the prompt the engine continued, the text it
    answered, the trajectory's reward."""
    rows: list[dict[str, Any]] = []
    for item in rebuilt:
        reward = request.groups[item.group].trajectories[item.index].reward
        for record in item.records:
            if len(rows) == limit:
                return rows
            prompt = tokenizer.decode(list(record.prompt_ids))
            rows.append({"prompt": prompt, "completion": record.content, "reward": reward})
    return rows


def run_update(policy: Policy, update: Update, snapshot: Snapshot) -> dict[str, float]:
    """The updates of a train call (gspo.learning.step, as `gspo train`'s); on any failure (or a
    non-finite loss or gradient) the policy is put back as it was and the error raised."""
    t0 = time.perf_counter()
    snapshot.take()
    t1 = time.perf_counter()
    try:
        metrics = learn_from_samples(
            policy, update.spec, update.samples, seed=update.seed, relayout=update.relayout
        )
        bad = [k for k in ("loss", "grad_norm") if k in metrics and not math.isfinite(metrics[k])]
        if bad:
            raise FloatingPointError(f"the update's {bad[0]} is {metrics[bad[0]]}")
    except BaseException:
        snapshot.restore()
        raise
    return metrics | update.metrics | {"time_snapshot": t1 - t0}
