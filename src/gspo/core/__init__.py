"""The math: objectives, advantages, log-probs, attention over packed rows, sequence layouts, mismatch metrics.

Pure functions over tensors (and a transformers model where log-probs need one); nothing here knows about
configs, processes or runs.
"""
