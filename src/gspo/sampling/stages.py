"""`gspo train`'s rollout batches as two stages with one future type between them: sampling, on the sampling
side's turn (gspo.sampling.side: its thread at rollout.lag > 0), and scoring, on a stage of its own
(gspo.workers.Stage); the trainer's thread is the third, learning. Batch b is scored while b + 1 samples and
the trainer learns on b - 1. At lag 0 both stages are in place (gspo.workers.InPlace): the very same steps
run one after another, in the trainer's thread, when its step asks for its batch.

Dynamic sampling is a policy of the sampling stage, not a mode of its own: its rounds run on the sampling
stage, each waiting for its scores from the scoring stage before the next is drawn (gspo.sampling.batches
.draw_dynamic). A reward's failure becomes the batch's (`Drawn.failure`, raised on every rank together by
the schedule); a KeyboardInterrupt raised inside a reward stays one, for the trainer to stop on.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from gspo.config import RolloutConfig
from gspo.rewards.calling import RewardError
from gspo.rewards.scoring import Rewards
from gspo.sampling.batches import (
    Drawn,
    Request,
    Resampling,
    Sampled,
    Scored,
    assemble,
    draw_dynamic,
    failed,
    sample,
    score,
    solved_by,
)
from gspo.sampling.side import SamplingSide
from gspo.workers import InPlace, Stage, Workers


@dataclass
class Stages:
    """The sampling stage (``side``'s turn), the scoring stage, and what they draw and score with."""

    side: SamplingSide
    scoring: Stage | InPlace
    rewards: Rewards
    cfg: RolloutConfig
    resampling: Resampling | None
    """Dynamic sampling's further prompts (None: off)."""
    workers: Workers
    """The run's threads and loop, which the rewards' calls borrow."""

    @classmethod
    def open(
        cls,
        side: SamplingSide,
        rewards: Rewards,
        cfg: RolloutConfig,
        resampling: Resampling | None,
        workers: Workers,
    ) -> Stages:
        """The stages of ``side``: threaded beside a threaded side, in place in line with the updates."""
        scoring = workers.stage("scoring") if side.threaded else InPlace()
        return cls(side, scoring, rewards, cfg, resampling, workers)

    def draw(self, request: Request) -> concurrent.futures.Future[Drawn]:
        """Batch ``request``, drawn and scored by the stages; its future holds it."""
        if self.resampling is not None:
            return self.side.call(lambda: self._dynamic(request))
        sampled = self.side.call(lambda: sample(self.side.sampler, self.cfg, request))
        return self.scoring.submit(lambda: self._scored(request, sampled))

    def _scored(self, request: Request, sampled: concurrent.futures.Future[Sampled]) -> Drawn:
        drawn = sampled.result()
        try:
            return assemble(request, [score(self.rewards, self.cfg, drawn, self.workers)])
        except RewardError as error:
            return failed(request, drawn.seconds, error)

    def _dynamic(self, request: Request) -> Drawn:
        """Dynamic sampling's rounds, on the sampling stage, each scored by the scoring stage."""
        assert self.resampling is not None

        def scores(sampled: Sampled) -> Scored:
            return self.scoring.submit(lambda: score(self.rewards, self.cfg, sampled, self.workers)).result()

        solved = solved_by(self.rewards, self.resampling)
        try:
            return draw_dynamic(self.side.sampler, self.cfg, request, self.resampling, scores, solved)
        except RewardError as error:
            return failed(request, 0.0, error)

    def close(self) -> None:
        """The scoring stage stops after the batch it scores; what waits is cancelled."""
        self.scoring.close()
