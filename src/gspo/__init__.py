"""gspo: Group Sequence Policy Optimization for language models.

The core is a set of pure tensor functions (``gspo.losses``, ``gspo.advantages``, ``gspo.logprobs``);
the trainer (``gspo.trainer``) composes them in a flat loop. ``train`` is imported lazily so that the
objectives can be used with torch alone.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Config", "load_config", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from gspo.trainer import train

        return train
    if name in ("Config", "load_config"):
        from gspo import config

        return getattr(config, name)
    raise AttributeError(f"module 'gspo' has no attribute {name!r}")
