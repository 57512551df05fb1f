"""gspo: Group Sequence Policy Optimization (GSPO, GSPO-token, GRPO) for language models.

Layers, each importing only the ones below it (checked by import-linter; docs/architecture.md):
``gspo.integrations`` > ``gspo.cli`` | ``gspo.client`` | ``gspo.torchrun`` | ``gspo.trl`` (the command line;
the client of `gspo serve`; TRL's GRPOTrainer over `train`) > ``gspo.serve`` (the OpenAI-compatible server
that trains on trajectory groups) | ``gspo.training`` (the loop, its inputs, evaluation, progress, plots),
siblings that never import each other > ``gspo.sampling`` (the sampling side both share: the owner of the
sampler, its weights and versions; the sampling and scoring stages; rollout batches, dynamic sampling, the
batches ahead) > ``gspo.rewards`` (a run's rewards, resolved once; how each is called; the built-ins, a
reward model, an LLM judge) | ``gspo.run`` (a run's home: folder, trust, checkpoints and resume, metrics, the
policy built from the config) > ``gspo.rollout`` (engines, samplers, tasks and data, trajectories) >
``gspo.learning`` (the learner) > ``gspo.parallel`` | ``gspo.models`` > ``gspo.config`` (and its engines'
registry) > ``gspo.core`` (the math; its torch-free ``gspo.core.registry`` names the config's loss choices)
| ``gspo.files`` | ``gspo.workers`` (every thread, pool and event loop of a run). The names below are
imported lazily, so ``gspo.core`` works with torch alone; gspo.public names the whole public surface.
"""

import importlib
from typing import Any

from gspo.public import install_moved

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "gspo.config",
    "load_config": "gspo.config",
    "train": "gspo.training.launch",
    "Trainer": "gspo.training.trainer",
    "policy_loss": "gspo.core.objectives",
    "PAPER_DEFAULTS": "gspo.core.objectives",
    "PAPER_CLIP": "gspo.core.objectives",
    "compute_loss": "gspo.core.objectives",
    "LossSpec": "gspo.core.objectives",
    "LossInputs": "gspo.core.objectives",
    "LossOutputs": "gspo.core.objectives",
    "objective": "gspo.core.surrogates",
    "register_objective": "gspo.core.surrogates",
    "Stream": "gspo.core.surrogates",
    "Terms": "gspo.core.surrogates",
    "group_advantages": "gspo.core.advantages",
    "token_logprobs": "gspo.core.logprobs",
    "causal_lm_logprobs": "gspo.core.logprobs",
    "reward": "gspo.rewards.calling",
    "Trajectory": "gspo.rollout.trajectories",
    "TrajectoryGroup": "gspo.rollout.trajectories",
    "TrajectoryError": "gspo.rollout.trajectories",
}
__all__ = sorted(_EXPORTS)  # gspo.public.PUBLIC["gspo"], which tests/test_public.py holds it to
install_moved()  # the import paths of earlier releases (gspo.public.MOVED), with a DeprecationWarning


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gspo' has no attribute {name!r}")
