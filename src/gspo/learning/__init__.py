"""The learner: a batch of scored samples -> old-policy log-probs -> K minibatch updates of a policy."""
