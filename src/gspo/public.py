"""gspo's public surface, named in one place: the modules user code may import and the names it may import
from them (`PUBLIC`), and the import paths of earlier releases that keep working (`MOVED`).

Everything else is internal: it may move without notice. A name of `PUBLIC` is a promise: tests/test_public.py
imports every one, and fails when one disappears. A path of `MOVED` (one an earlier README or doc showed)
still imports for at least one release, with a DeprecationWarning naming the new one: `install_moved`, which
`import gspo` calls, puts an import hook on sys.meta_path that answers those paths and nothing else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

PUBLIC: dict[str, tuple[str, ...]] = {
    "gspo": (
        "Config",
        "PAPER_CLIP",
        "PAPER_DEFAULTS",
        "LossInputs",
        "LossOutputs",
        "LossSpec",
        "Stream",
        "Terms",
        "Trainer",
        "Trajectory",
        "TrajectoryError",
        "TrajectoryGroup",
        "causal_lm_logprobs",
        "compute_loss",
        "group_advantages",
        "load_config",
        "objective",
        "policy_loss",
        "register_objective",
        "reward",
        "token_logprobs",
        "train",
    ),
    "gspo.config": ("Config", "ConfigError", "ModelConfig", "load_config"),
    "gspo.core.objectives": (
        "LossInputs",
        "LossOutputs",
        "LossSpec",
        "PAPER_DEFAULTS",
        "compute_loss",
        "policy_loss",
    ),
    "gspo.core.logprobs": ("causal_lm_logprobs", "token_logprobs"),
    "gspo.rewards.builtins": (
        "correct_number",
        "digit_fraction",
        "exact_answer",
        "extract_answer",
        "last_number",
        "number_format",
        "reasoning_gym",
    ),
    "gspo.rewards.calling": ("RewardError", "reward"),
    "gspo.rewards.scoring": ("Rewards", "compute_rewards"),
    "gspo.rollout.samplers": ("Rollouts", "Sampler", "ServerError"),
    "gspo.rollout.openai": ("OpenAIBackend",),
    "gspo.rollout.hf_engine": ("Engine",),
    "gspo.rollout.requests": ("SamplingParams",),
    "gspo.rollout.llama_cpp": ("GGUFReload", "LlamaCppServer"),
    "gspo.rollout.trajectories": ("Trajectory", "TrajectoryError", "TrajectoryGroup"),
    "gspo.client": ("Client", "Episode"),
    "gspo.trl": ("GRPOConfig", "GRPOTrainer"),
    "gspo.training.trainer": ("Trainer",),
    "gspo.training.export": ("export_run",),
    "gspo.serve.server": ("build_service", "start_in_thread"),
    "gspo.models": ("default_model_file", "save_model", "tiny_model", "tiny_tokenizer"),
    "gspo.models.loading": ("hub_snapshot", "load_model"),
    "gspo.models.gguf_export": ("write_gguf",),
    "gspo.integrations.art": ("GspoBackend",),
    "gspo.integrations.verifiers": ("harness_config", "model_context", "rollouts", "train_step"),
}
"""Each public module and the names user code may import from it (module docstring)."""

MOVED: dict[str, tuple[str, ...]] = {
    # the rewards became a package of their own (gspo.rewards)
    "gspo.rollout.rewards": (
        "gspo.rewards.builtins",
        "gspo.rewards.calling",
        "gspo.rewards.scoring",
        "gspo.rewards.resolve",
    ),
    # gspo's own sampling engine, beside the others (vLLM's, llama.cpp's)
    "gspo.rollout.engine": ("gspo.rollout.hf_engine",),
}
"""Module paths of earlier releases, and the modules their names live in now (the first: the module's new
home, which the warning names)."""


class MovedModule(types.ModuleType):
    """An earlier release's module: its names are looked up in the modules they moved to."""

    def __init__(self, name: str, homes: Sequence[str]) -> None:
        super().__init__(name, f"Moved to {homes[0]}; kept for earlier code (gspo.public.MOVED).")
        self.__homes = tuple(homes)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        for home in self.__homes:
            module = importlib.import_module(home)
            if hasattr(module, attribute):
                return getattr(module, attribute)
        raise AttributeError(
            f"module {self.__name__!r} (now {self.__homes[0]}) has no attribute {attribute!r}"
        )

    def __dir__(self) -> list[str]:
        return sorted({n for home in self.__homes for n in dir(importlib.import_module(home))})


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the paths of `MOVED`, and nothing else."""

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        homes = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {homes[0]}: import from there (the old path works for now, and will be "
            "removed in a later release)",
            DeprecationWarning,
            stacklevel=2,  # the import statement: warnings skips the import machinery's own frames
        )
        return MovedModule(spec.name, homes)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_moved() -> None:
    """Put the import hook of `MOVED` on sys.meta_path (once)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
