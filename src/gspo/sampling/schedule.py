"""The rollout batches of `gspo train`'s steps, drawn by the sampling side ahead of the updates by rollout.lag
= k batches (docs/async.md); the trainer asks for each step's batch (`next`) and says when it has made a
version (`updated`), and never branches on how far ahead the sampling side runs.

Batch b (the one step b trains on) is drawn, and rewarded, from the weights of version v(b) = max(0, b - 1 -
k): after the update that makes version s, batch s + k + 1 is handed to the sampling side, in its turn after
those weights (gspo.sampling.side.SamplingSide.updated), and the trainer goes on with batch s + 1, drawn
earlier. With k = 0 that is the synchronous loop: batch s + 1 is drawn, in the trainer's thread, when step s
+ 1 asks for it. With k > 0 the side's thread draws from its own copy of the model, so slow sampling and
rewards overlap the updates.

The schedule alone decides which version draws which batch, and every batch's sampling seed is
`gspo.core.seeds.sample_seed` of its step (and rank): a run is reproducible from its seed at any k, whatever
the threads' timing. `state` gives what a checkpoint keeps: the batches drawn ahead (those of steps up to
s + k, waited for) and the prompt stream's position before the first batch it does not keep, which a
resumed run draws again from the same weights and seed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo.config import Config, ConfigError
from gspo.core.seeds import sample_seed
from gspo.parallel.collectives import (
    all_gather_cat,
    all_gather_list,
    all_reduce_sum,
    all_reduce_sums,
    raise_together,
)
from gspo.parallel.group import rank, rank_slice, world_size
from gspo.rewards.calling import RewardError
from gspo.rewards.scoring import Rewards
from gspo.rollout.data import Example, PromptStream, format_prompt
from gspo.rollout.samplers import Sampler
from gspo.run.start import Run
from gspo.sampling.batches import Drawn, Request, Resampling
from gspo.sampling.side import SamplingSide
from gspo.sampling.stages import Stages
from gspo.workers import Workers


def training_side(run: Run, sampler: Sampler | None = None) -> SamplingSide:
    """`gspo train`'s sampling side: in line with the updates at rollout.lag 0; beside them, on a copy of
    the model and in a thread of its own, at lag > 0 (FSDP2 shards the model, which a copy per rank cannot
    sample from: refused by the config's launch checks)."""
    ahead = run.config.rollout.lag > 0
    return SamplingSide.open(run, beside=ahead, threaded=ahead, sampler=sampler)


@dataclass
class Schedule:
    """The batches of the steps ahead (module docstring), drawn by the ``stages`` (gspo.sampling.stages).
    Requests take this rank's share of each batch's prompts from ``stream``, templated by ``prompt`` (in the
    trainer's thread, with its tokenizer); every step ahead is a future of its batch, whatever the lag."""

    stages: Stages
    lag: int
    stream: PromptStream
    prompt: Callable[[Example], str]
    seed: int
    groups: int
    """Groups in a rollout batch, over every rank (rollout.prompts_per_step)."""
    best_seen: float | None = None
    """The highest reward a sample of the run has scored so far: what a flat group is compared with when
    the rewards declare no best."""
    agreed_answer: str | None = None
    """The completion that the most stuck groups of the last batch agreed on."""
    last_step: int | None = None
    """No batch beyond it is drawn (train.steps)."""
    kept: list[Drawn] = field(default_factory=list)
    """Batches a checkpoint kept, trained before any is drawn."""
    ahead: dict[int, concurrent.futures.Future[Drawn]] = field(default_factory=dict)
    """Each step ahead: the future of its batch (in place at lag 0: drawn when the step asks for it)."""
    stream_before: dict[int, dict[str, Any]] = field(default_factory=dict)
    _started: bool = False

    @classmethod
    def resume(
        cls,
        config: Config,
        side: SamplingSide,
        examples: list[Example],
        rewards: Rewards,
        tokenizer: Any,
        restored: dict[str, Any],
        workers: Workers,
    ) -> Schedule:
        """The schedule of a run over its training ``examples``, from where a checkpoint left it
        (``restored``: the prompt stream's position and the batches drawn ahead; {} for a new run), its
        stages on ``side`` and the run's ``workers``."""
        stream = PromptStream(examples, config.rollout.prompts_per_step, seed=config.seed)
        if "stream" in restored:
            try:
                stream.load_state_dict(restored["stream"])
            except ValueError as error:
                raise ConfigError(f"the checkpoint's prompt stream: {error}") from None
        system = config.task.system_prompt
        # further prompts of dynamic sampling are templated on the sampling side, with its own tokenizer
        resampling = dynamic_sampling(config, examples, side.tokenizer)
        return cls(
            Stages.open(side, rewards, config.rollout, resampling, workers),
            config.rollout.lag,
            stream,
            lambda ex: format_prompt(tokenizer, ex.prompt, system_prompt=system),
            config.seed,
            config.rollout.prompts_per_step,
            best_seen=restored.get("best_seen"),
            last_step=config.train.steps,
            kept=[Drawn.from_state(state) for state in restored.get("ahead", [])],
        )

    @property
    def side(self) -> SamplingSide:
        return self.stages.side

    @property
    def stale(self) -> bool:
        """Whether batches may be drawn by an older version than the one they train."""
        return self.lag > 0

    def prompts(self, examples: list[Example]) -> list[str]:
        """``examples``' prompts as the sampler is given them: with the chat template and task.system_prompt."""
        return [self.prompt(ex) for ex in examples]

    def request(self, step: int, version: int) -> Request:
        """What drawing the batch of ``step`` from ``version`` needs: this rank's prompts (whole groups) and
        the batch's own sampling seed."""
        examples = rank_slice(self.stream.next_batch())
        seed = sample_seed(self.seed, step, rank())
        return Request(step, version, examples, self.prompts(examples), seed)

    def _start(self, step: int) -> None:
        """Begin at ``step`` (updates done) with the batches a checkpoint kept: the rest of steps step + 1 ..
        step + lag + 1 is drawn from the current weights (version ``step``), as the schedule says."""
        self._started = True
        for drawn in self.kept:
            self.ahead[drawn.step] = concurrent.futures.Future()
            self.ahead[drawn.step].set_result(drawn)
        for b in range(step + 1, step + self.lag + 2):
            if b not in self.ahead:
                self._submit(b, step)

    def _submit(self, step: int, version: int) -> None:
        """Hand batch ``step`` to the sampling side, drawn from version ``version`` (the side's weights, as the
        calls before this one leave them)."""
        if self.last_step is not None and step > self.last_step:
            return
        self.stream_before[step] = self.stream.state_dict()
        self.ahead[step] = self.stages.draw(self.request(step, version))

    def updated(self, model: Any, version: int) -> None:
        """The trainer made ``version``: the sampling side takes its weights, then draws batch version + lag
        + 1 from them."""
        self.side.updated(model, version)
        if not self._started:  # a step trained outside the schedule (the user's trajectories)
            return
        for done in [b for b in self.stream_before if b <= version]:
            del self.stream_before[done]
        self._submit(version + self.lag + 1, version)

    def take(self, step: int) -> tuple[Drawn, dict[str, float]]:
        """Batch ``step`` (`next`), checked against the schedule's staleness guarantee, and its metrics over
        every rank; a reward function's error is raised on every rank together, so they can checkpoint
        together."""
        t0 = time.perf_counter()
        drawn = self.next(step)
        raise_together(RewardError(drawn.failure) if drawn.failure is not None else None)
        trained_by = step - 1  # the version that trains it
        staleness = [trained_by - s.version for s in drawn.samples]
        if staleness and not 0 <= max(staleness) <= self.lag:
            raise RuntimeError(f"step {step}: a sample of version {min(s.version for s in drawn.samples)}")
        metrics = {
            "time_rollout": time.perf_counter() - t0,  # what the loop waited (the drawing, in line)
            "generation_tokens": all_reduce_sum(drawn.generation_tokens),  # through the model
            "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "staleness_max": float(max(staleness, default=0)),
        }
        if self.side.threaded:  # the sampling and scoring stages' own time, overlapping the updates
            metrics["time_sampling_overlapped"] = drawn.seconds - drawn.scoring_seconds
            metrics["time_scoring_overlapped"] = drawn.scoring_seconds
        metrics |= self._flat_groups(drawn)
        if self.stages.resampling is not None:
            groups, kept = metrics["groups_drawn"], all_reduce_sum(float(drawn.groups_kept))
            metrics |= {"groups_kept": kept, "extra_groups": groups - self.groups}
        per_reward = {
            f"reward/{name}": float(all_gather_cat(torch.tensor(values)).nanmean())  # None: left out
            for name, values in drawn.per_function.items()
        }
        metrics = per_reward | metrics
        for name in sorted(all_gather_names(drawn.logged)):  # what the rewards logged, by its own name
            values = all_gather_cat(torch.tensor(drawn.logged.get(name, []), dtype=torch.float32))
            metrics.setdefault(name if name not in metrics else f"logged/{name}", float(values.mean()))
        return drawn, metrics

    def _flat_groups(self, drawn: Drawn) -> dict[str, float]:
        """The groups drawn for the batch, over every rank, and of those whose completions all scored the
        same: the solved, at the rewards' best (learned), and the stuck, below it; of the stuck, those whose
        completions agree (most of them alike: one wrong answer, the collapse). Rewards that declare no best
        are compared with the highest reward the run has seen so far. Keeps the answer the most stuck groups
        agreed on (`agreed_answer`)."""
        seen = [s.reward for s in drawn.samples] + [group.reward for group in drawn.flat]
        highest = float(
            all_gather_cat(torch.tensor([max(seen, default=-math.inf)], dtype=torch.float64)).max()
        )
        if math.isfinite(highest) and (self.best_seen is None or highest > self.best_seen):
            self.best_seen = highest
        rewards = self.stages.rewards
        best = rewards.best if rewards.best is not None else self.best_seen
        solved = [rewards.solved(g.reward, best) for g in drawn.flat]
        stuck = [g for g, done in zip(drawn.flat, solved, strict=True) if not done]
        agreeing = [g for g in stuck if g.agreement > 0.5]
        answers = collections.Counter(g.answer for g in agreeing)
        self.agreed_answer = answers.most_common(1)[0][0] if answers else None
        drawn_groups = drawn.groups_drawn or len(drawn.prompts)
        totals = all_reduce_sums(
            [float(drawn_groups), float(sum(solved)), float(len(stuck)), float(len(agreeing))]
        )
        return dict(
            zip(("groups_drawn", "groups_solved", "groups_stuck", "groups_agreeing"), totals, strict=True)
        )

    def next(self, step: int) -> Drawn:
        """Batch ``step``, waiting for it; a sampling-side error (a server that died) is raised here."""
        if not self._started:
            self._start(step - 1)
        return self.ahead.pop(step).result()

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` keeps: the batches of steps step + 1 .. step + lag (waited for),
        those up to the first that failed, and the stream's position before the first batch not kept."""
        if not self._started:
            return {
                "ahead": [drawn.state() for drawn in self.kept],
                "stream": self.stream.state_dict(),
                "best_seen": self.best_seen,
            }
        kept = []
        for b in range(step + 1, step + self.lag + 1):
            pending = self.ahead.get(b)
            if pending is None:
                break
            # waits for it; a Ctrl-C while waiting is raised here and stops the checkpoint, while a batch's
            # own exception (a reward's KeyboardInterrupt too) is raised when its step asks for it
            if pending.exception() is not None:
                break
            drawn = pending.result()
            if drawn.failure is not None:
                break
            kept.append(drawn.state())
        first = step + 1 + len(kept)
        stream = self.stream_before.get(first, self.stream.state_dict())
        return {"ahead": kept, "stream": stream, "best_seen": self.best_seen}

    def close(self) -> None:
        """Stop the sampling side after the batch it is drawing, and the scoring stage after the batch it is
        scoring (none is trained: the run ends or stops)."""
        self.side.close()
        self.stages.close()


def all_gather_names(logged: dict[str, list[float]]) -> set[str]:
    """The names any rank's rewards logged (every rank reduces every name)."""
    return {name for names in all_gather_list([sorted(logged)]) for name in names}


def dynamic_sampling(config: Config, pool: list[Example], tokenizer: Any) -> Resampling | None:
    """Where rollout.dynamic_sampling draws further prompts: the training examples, templated with the
    sampling side's tokenizer; each rank draws its own prompts' groups and its share of
    rollout.max_extra_groups (None: 3 x prompts_per_step)."""
    if not config.rollout.dynamic_sampling:
        return None
    cap = config.rollout.max_extra_groups
    cap = 3 * config.rollout.prompts_per_step if cap is None else cap
    system = config.task.system_prompt
    return Resampling(
        pool,
        lambda ex: format_prompt(tokenizer, ex.prompt, system_prompt=system),
        cap // world_size(),
        config.rollout.keep_solved_groups,
    )
