"""Data parallelism under torchrun (DDP, FSDP2), exact across ranks: N ranks make the one-process update.

Every helper is the identity in a single process, so callers use them always (docs/distributed.md).
"""
