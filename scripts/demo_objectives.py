"""Compare GSPO, GSPO-token and GRPO on one toy batch, on-policy and off-policy.

Prints, for each objective: the loss, token and sequence clip fractions, and the norm of the gradient
with respect to each sequence's log-probs. Things to see:
  * on-policy (old_logp = logp.detach()) GSPO and GRPO have the same gradient, and GSPO-token always
    matches GSPO (per-sequence advantages);
  * GSPO's gradient per token is A_i s_i / |y_i|, so longer sequences get smaller per-sequence norms;
  * off-policy, GSPO's tiny clip range (3e-4, 4e-4) clips whole sequences, GRPO (0.2, 0.27) few tokens.

Run: python scripts/demo_objectives.py
"""

from __future__ import annotations

import torch

from gspo.core.advantages import group_advantages
from gspo.core.objectives import OBJECTIVES, policy_loss


def toy_batch(seed: int = 0, group_size: int = 4, num_groups: int = 2, max_len: int = 24):
    g = torch.Generator().manual_seed(seed)
    B = group_size * num_groups
    lengths = torch.randint(3, max_len + 1, (B,), generator=g)
    mask = torch.arange(max_len) < lengths[:, None]
    logp = torch.where(mask, -2.0 * torch.rand(B, max_len, generator=g), 0.0)
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    rewards[:group_size] = torch.tensor([1.0, 0.0, 1.0, 0.0])  # keep group 0 informative
    advantages, _ = group_advantages(rewards, group_size)
    # a behaviour policy that drifted a little from the current one (as after a few minibatch updates)
    drift = torch.where(mask, 0.02 * torch.randn(B, max_len, generator=g), 0.0)
    return logp, logp + drift, advantages, mask, lengths


def main() -> None:
    logp0, drifted_old, advantages, mask, lengths = toy_batch()
    print("lengths   ", " ".join(f"{n:>6d}" for n in lengths.tolist()))
    print("advantages", " ".join(f"{a:>6.2f}" for a in advantages.tolist()))
    print()
    header = (
        f"{'objective':<11}{'old_logp':<12}{'loss':>10}{'clip_tok':>10}{'clip_seq':>10}   per-sequence |grad|"
    )
    print(header)
    print("-" * (len(header) + 40))
    for setting in ("on-policy", "off-policy"):
        for name in OBJECTIVES:
            logp = logp0.clone().requires_grad_()
            # on-policy the behaviour policy is the current one: the ratio is 1, its gradient is not
            old_logp = logp.detach() if setting == "on-policy" else drifted_old
            loss, metrics = policy_loss(name, logp, old_logp, advantages, mask)
            loss.backward()
            norms = logp.grad.norm(dim=1)
            print(
                f"{name:<11}{setting:<12}{loss.item():>10.5f}{metrics['clip_frac_token'].item():>10.3f}"
                f"{metrics['clip_frac_seq'].item():>10.3f}   " + " ".join(f"{n:.4f}" for n in norms.tolist())
            )
        print()


if __name__ == "__main__":
    main()
