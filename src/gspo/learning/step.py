"""One step on scored samples, the same for `gspo train` and `gspo serve`: samples -> batch (advantages,
reward metrics: make_batch) -> old-policy log-probs and the minibatch updates (learn), or no update when
every group was filtered out. Its minibatch shuffle is seeded by `gspo.core.seeds.step_seed`.
"""

from __future__ import annotations

from collections.abc import Callable

from gspo.config import ConfigError
from gspo.core.objectives import NonFiniteInput
from gspo.core.samples import Sample
from gspo.learning.batch import Batch, make_batch
from gspo.learning.learner import learn
from gspo.learning.policy import Policy, UpdateSpec


def learn_from_samples(
    policy: Policy,
    spec: UpdateSpec,
    samples: list[Sample],
    *,
    seed: int,
    relayout: Callable[[Batch], Batch] | None = None,
) -> dict[str, float]:
    """The batch of ``samples`` (make_batch with the spec's advantage_scale, filter_zero_std_groups and
    mask_truncated), then its updates; returns the batch's and the updates' metrics.

    seed: `step_seed`'s. relayout: a function from the batch to the sequences actually trained, in one
    process (`gspo serve` lays a trajectory out as its exact segments); num_trained then counts them.
    """
    batch, metrics = make_batch(
        samples,
        advantage_scale=spec.advantage_scale,
        filter_zero_std_groups=spec.filter_zero_std_groups,
        mask_truncated=spec.mask_truncated,
    )
    if relayout is not None:
        batch = relayout(batch)
        metrics["num_trained"] = float(len(batch.sequences))
    if metrics["num_trained"] == 0:  # every group had equal returns and was filtered out
        return metrics | {"time_old_logprobs": 0.0, "time_update": 0.0}
    try:
        return metrics | learn(policy, spec, batch, seed=seed)
    except NonFiniteInput as error:
        if error.name not in ("logp", "old_logp"):  # a reference's or an advantage's: not the weights
            raise
        lr = policy.optimizer.param_groups[0]["lr"]
        raise ConfigError(
            f"the policy's log-probs are not finite: its weights diverged (learning rate {lr:g}); lower "
            "train.lr and keep train.max_grad_norm on (the run's checkpoints hold the weights from before)"
        ) from error
