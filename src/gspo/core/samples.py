"""One scored sample: what sampling (`gspo train`'s rollouts, a server's records, the user's trajectories)
hands to learning (gspo.learning.batch), so that neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    """One scored completion (or conversation) of a group of samples of the same prompt.

    prompt_ids, completion_ids: token ids; sampler_logprobs: per completion token, the sampler's log-prob
    (NaN where unknown); reward: the sample's (trajectory's) reward; group: which group (prompt) of this
    process's samples it belongs to; truncated: it hit the length limit; train_mask: per completion
    token, whether it gets gradient (None: all); turns and turn_rewards (multi-turn): per completion token
    the index of the turn it was generated in, and one reward per turn, for per-turn advantages;
    version: the version of the policy's weights that drew it (rollout.lag: docs/async.md).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]
    reward: float
    group: int
    truncated: bool = False
    train_mask: list[bool] | None = None
    turns: list[int] | None = None
    turn_rewards: list[float] | None = None
    version: int = 0

    def returns(self) -> list[float]:
        """G_k = sum_{j >= k} turn_rewards[j] + reward: the return from each turn on (the reward last)."""
        to_go, acc = [], self.reward
        for r in reversed(self.turn_rewards or []):
            acc += r
            to_go.append(acc)
        return to_go[::-1] or [self.reward]
