"""What the loss can be asked for, by name and without torch: each objective once (its level and its knobs'
paper defaults), the aggregations and the mismatch corrections with their default bounds.

gspo.core.surrogates registers each objective's terms function against `REGISTRY`; the config
(gspo.config.schema) takes its choices from here, so adding an objective is one `Objective` entry below
plus its terms function (``@terms_of("name")`` in gspo.core.surrogates).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args


@dataclass(frozen=True)
class Objective:
    """One objective: the unit of its loss terms and its knobs with their paper defaults."""

    level: Literal["sequence", "token"]
    """"sequence": one term per sequence (it takes per-sequence advantages and the sequence_* corrections);
    "token": one term per token."""
    defaults: Mapping[str, float]
    """Its knobs and their paper defaults: ``eps_low``, ``eps_high`` (a clip range) or ``tau_pos``,
    ``tau_neg`` (SAPO's gate temperatures)."""
    token_form: str | None = None
    """A sequence objective's form for per-token advantages (per-turn rewards), whose value and gradient
    equal its own for per-sequence ones: gspo -> gspo_token (GSPO paper, Eq. 13-14); None: it has none."""


_GSPO_CLIP = {"eps_low": 3e-4, "eps_high": 4e-4}  # GSPO paper, section 5.1
_SAPO_GATE = {"tau_pos": 1.0, "tau_neg": 1.05}  # gate temperatures for A > 0 and A <= 0 (SAPO paper)

REGISTRY: dict[str, Objective] = {  # the built-ins; gspo.core.surrogates.register_objective adds yours
    "gspo": Objective("sequence", _GSPO_CLIP, token_form="gspo_token"),
    "gspo_token": Objective("token", _GSPO_CLIP),
    "grpo": Objective("token", {"eps_low": 0.2, "eps_high": 0.27}),  # the GSPO paper's GRPO baseline
    "gmpo": Objective("sequence", {"eps_low": 0.4, "eps_high": 0.4}),  # log space: log r_t in [-0.4, 0.4]
    "sapo": Objective("token", _SAPO_GATE),
    "sapo_seq": Objective("sequence", _SAPO_GATE),
    # CISPO: its detached weight in [0, 5], no lower bound (MiniMax-M1); ART's default
    "cispo": Objective("token", {"eps_low": 1.0, "eps_high": 4.0}),
}
"""Every objective of `gspo.core.objectives.policy_loss`, each once; docs/objectives.md has the formulas."""

OBJECTIVES = tuple(REGISTRY)
"""The built-in objectives' names."""
PAPER_DEFAULTS: dict[str, dict[str, float]] = {name: dict(o.defaults) for name, o in REGISTRY.items()}
"""Each objective's knobs and their paper defaults."""
PAPER_CLIP = {name: (p["eps_low"], p["eps_high"]) for name, p in PAPER_DEFAULTS.items() if "eps_low" in p}
"""The default clip range (eps_low, eps_high) of each clipping objective."""
SEQUENCE_OBJECTIVES = tuple(name for name, o in REGISTRY.items() if o.level == "sequence")
"""Objectives with one term per sequence: they take per-sequence advantages and sequence-level corrections."""

Aggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""How the terms are averaged (docs/objectives.md, "Aggregation")."""
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)

CORRECTION_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "token_truncate": (None, 2.0),
    "token_mask": (0.5, 5.0),
    "sequence_truncate": (None, 2.0),
    "sequence_mask": (0.5, 5.0),
}
"""Default [C_min, C_max] per mismatch correction (None: unbounded on that side): TIS truncates at C = 2 (Yao
et al., "Your efficient RL framework secretly brings you off-policy RL training"); masked IS keeps [0.5, 5],
IcePop's band (Ring-1T report). gspo.core.corrections applies them."""
CORRECTIONS = tuple(CORRECTION_BOUNDS)
SamplerCorrection = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
"""The values of ``sampler_correction``: "none" or one of the corrections."""
SAMPLER_CORRECTIONS: tuple[str, ...] = get_args(SamplerCorrection)
assert ("none", *CORRECTIONS) == SAMPLER_CORRECTIONS
