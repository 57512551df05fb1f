"""The sampling side, shared by `gspo train` and `gspo serve`: drawing scored rollout batches (with dynamic
sampling), the samplers' registry and the thread that samples ahead of the updates."""
