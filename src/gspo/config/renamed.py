"""Config keys of earlier gspo versions and the keys that replaced them: an old key still loads, from a YAML
file, the command line (gspo.config.loading) or Config's keyword arguments (gspo.config.values), with a
deprecation note naming the new key."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

RENAMED: dict[str, tuple[str, ...]] = {
    "train.packing": ("train.layout",),
    "train.minibatches_per_rollout": ("train.minibatches",),
    "train.sapo_tau_pos": ("train.tau_pos",),
    "train.sapo_tau_neg": ("train.tau_neg",),
    **{f"rollout.server.{k}": (f"rollout.openai.{k}",) for k in ("url", "model", "concurrency", "token_ids")},
    "rollout.server.api_key_env": ("rollout.openai.api_key_env",),
    "rollout.server.timeout": ("rollout.openai.timeout", "rollout.llama_cpp.timeout"),
    "rollout.server.sync_every": ("rollout.llama_cpp.sync_every",),
    "rollout.server.gguf_quant": ("rollout.llama_cpp.gguf_quant",),
}
"""Keys of earlier gspo versions and the keys that replaced them (the config's names are the code's names
now): an old key still loads, with a deprecation note, so old configs and run folders keep working."""


class DeprecatedKey(FutureWarning):
    """A config key of an earlier gspo version was used; it loads under its new name."""


def note_renamed(old: str, new: tuple[str, ...], *, stacklevel: int) -> None:
    warnings.warn(
        f"config key {old} is now {' and '.join(new)}; the old name still loads (rename it in your config)",
        DeprecatedKey,
        stacklevel=stacklevel,
    )


def _user_level() -> int:
    """The stack level, from `note_renamed`'s call to warn, of the first frame outside the config package
    and its dataclasses' generated methods: the line of the user's `Config(...)`."""
    here = os.path.dirname(__file__)
    frame, level = sys._getframe(2), 3  # the caller of renamed_in_section, as warn counts from note_renamed
    while frame is not None and (
        frame.f_code.co_filename.startswith(here) or frame.f_code.co_filename == "<string>"
    ):
        frame, level = frame.f_back, level + 1
    return level


def renamed_in_section(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """A section's keys given in Python (`Config(train={...})`), an old key of `RENAMED` that stays in the
    section under its new name (with the deprecation note); a key that moved to another section is left for
    the section's own message, which names it."""
    out = dict(values)
    for leaf in values:
        new = RENAMED.get(f"{section}.{leaf}")
        if new is None or len(new) != 1 or new[0].rpartition(".")[0] != section:
            continue
        target = new[0].rpartition(".")[2]
        if target in out:
            raise ValueError(f"{section}: both {section}.{leaf} and {new[0]} are set; keep only {new[0]}")
        out[target] = out.pop(leaf)
        note_renamed(f"{section}.{leaf}", new, stacklevel=_user_level())
    return out
