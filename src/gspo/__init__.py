"""gspo: Group Sequence Policy Optimization for language models.

The core is a set of pure tensor functions (``gspo.losses``, ``gspo.advantages``,
``gspo.logprobs``); the trainer composes them in a flat loop.
"""

__version__ = "0.1.0"
