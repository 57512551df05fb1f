"""`gspo train`: the training loop, its front door, its inputs, evaluation, progress and plots (a run's home, checkpoints and metrics: gspo.run)."""
