"""A run's home, shared by `gspo train` and `gspo serve`: its folder (paths, lock, trust, own-runs record),
checkpoints and resume, metrics and trackers, and the policy built from its config (gspo.run.start)."""
