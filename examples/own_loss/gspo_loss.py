"""GSPO written as a whole loss of your own: the sequence ratio, its clip, the paper's 1/G aggregation and
the metrics, all here (gspo applies nothing around it). `train.objective: gspo_loss.py:gspo_by_hand` in
config.yaml trains with it; tests/test_user_objectives.py checks it against the built-in `gspo` to 1e-6.
"""

import torch

import gspo


@gspo.objective(level="sequence", whole=True, eps_low=3e-4, eps_high=4e-4)
def gspo_by_hand(spec: gspo.LossSpec, inputs: gspo.LossInputs) -> gspo.LossOutputs:
    knobs = spec.knobs()  # the paper's clip range, or train.eps_low / train.eps_high
    valid = inputs.segment_ids >= 0  # (N,) the completion tokens; the others may hold anything
    segment = torch.where(valid, inputs.segment_ids, inputs.num_segments)  # (N,) a spare bucket for the rest
    log_ratio = torch.where(valid, inputs.logp - inputs.old_logp, 0.0)  # (N,) log r_t
    sums = torch.zeros(inputs.num_segments + 1).index_add(0, segment, log_ratio)[:-1]  # (S,)
    lengths = torch.zeros(inputs.num_segments + 1).index_add(0, segment, valid.float())[:-1]  # (S,) |y_i|
    ratio = torch.exp((sums / lengths.clamp_min(1)).clamp(-20, 20))  # s_i = exp(mean_t log r_t)   (S,)
    adv = inputs.advantages
    high = (adv > 0) & (ratio > 1 + knobs["eps_high"])
    low = (adv < 0) & (ratio < 1 - knobs["eps_low"])
    clipped = ratio.detach().clamp(1 - knobs["eps_low"], 1 + knobs["eps_high"]) * adv
    terms = -torch.where(high | low, clipped, ratio * adv)  # (S,) L_i = -min(s_i A_i, clip(s_i) A_i)
    # the whole minibatch's normaliser (its number of sequences), so its micro-batches sum to its loss
    normalizer = inputs.normalizer if inputs.normalizer is not None else inputs.num_segments
    loss = torch.where(lengths > 0, terms, 0.0).sum() / normalizer
    present = lengths > 0
    metrics = {
        "clip_frac_seq": (high | low)[present].float().mean(),
        "ratio_seq_mean": ratio[present].mean(),
        "num_sequences": present.sum(),
    }
    return gspo.LossOutputs(loss, metrics)
