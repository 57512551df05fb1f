"""Runs: the training loop, its setup, checkpoints, metrics and plots."""
