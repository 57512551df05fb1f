"""Bring-your-own rollouts: GSPO updates on conversations that the user's own agent or environment produced.

A `Trajectory` is one chat conversation (OpenAI-style messages, tool turns included) with its reward; a
`TrajectoryGroup` holds the G trajectories of one prompt. `train_on_groups(trainer, groups)` (also
`Trainer.train_on_groups`) tokenises them, computes advantages within each group, and runs the trainer's
own `learn()`: the old-policy log-probs (`train.old_logprobs`), `minibatches_per_rollout` updates, the
same metrics, logged to the run folder like a `gspo train` step. A user's loop:

    trainer = Trainer(load_config("configs/tiny.yaml"))
    for _ in range(steps):
        groups = [TrajectoryGroup([run_my_agent(task) for _ in range(8)]) for task in tasks]
        metrics = trainer.train_on_groups(groups)

Tokenisation and the assistant-token mask. The conversation is rendered with the tokenizer's chat template
and tokenised exactly as the trainer tokenises prompts. For the k-th assistant message, the template is
rendered twice: the messages before it with the generation prompt (P_k, ending with the assistant header)
and the messages through it (F_k). Both must be token-prefixes of the whole conversation's tokens, so the
assistant turn is the token range [len(P_k), len(F_k)): found from token-id boundaries, never by searching
decoded text. A template that renders earlier turns differently once later ones follow (for example one
that drops earlier reasoning) is not prefix-stable and raises `TrajectoryError`. Within that range the
tokens the model generated run up to and including the first end-of-turn token (the tokenizer's EOS);
template glue after it (a newline) is context, as are the header, system, user and tool tokens. An
assistant message with `"train": False` (a scripted or few-shot turn) is context too.

Rewards and advantages (per group g of trajectories i; eps = 1e-6):
  * Trajectory rewards only: A_i = (R_i - mean_g R) / (std_g R + eps), as in `gspo train`
    (`gspo.advantages.group_advantages`), one advantage per sequence, trained with the configured objective.
  * Per-turn rewards (`turn_rewards[k]` for the k-th assistant message), in any trajectory of the group:
    the return from turn k is G_i,k = sum_{j >= k} turn_rewards_i[j] + R_i (the trajectory reward counts
    as received after the last turn), and
        A_i,k = (G_i,k - mean_g G_i,0) / (std_g{G_i,k over all i, k} + eps)
    is the advantage of every trained token of turn k: reward-to-go with the group's mean total return as
    baseline (a constant, so the policy gradient stays unbiased), scaled by the spread of the group's
    returns. Per-token advantages train with GSPO-token (`gspo` is switched to `gspo_token`, which has
    GSPO's value and gradient wherever the advantages are constant over a sequence; `grpo` stays `grpo`).
  * `train.advantage_scale`: "group" as above, "batch" (the std over the whole batch's returns), "none".
  * A group whose returns are all equal has no signal: its advantages are 0 (dropped with
    `train.filter_zero_std_groups`, counted in `zero_std_groups` either way).

Sampler log-probs (optional, for `train.old_logprobs=sampler` and the mismatch metrics): one list per
assistant message, one log-prob per generated token of that turn as tokenised above (end-of-turn token
included; NaN for a token the engine did not report, which the trainer then recomputes). They must be
log-probs of the distribution the trainer scores: the policy's logits divided by `rollout.temperature`.
`sampler_token_ids` (also one list per assistant message) are the ids the engine generated: when given,
they are the turn's trained tokens (the text must still match what the template renders), so a sample
tokenised non-canonically is trained on exactly the tokens that were sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gspo.batching import Sequence
from gspo.rollout import Rollouts, tokenize_prompts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo.trainer import Trainer

ADVANTAGE_EPS = 1e-6


class TrajectoryError(ValueError):
    """A trajectory that cannot be trained on as given; the message names it and the fix."""


@dataclass
class Trajectory:
    """One conversation and its reward.

    messages: chat messages ({"role": "system" | "user" | "assistant" | "tool", "content": ...}, plus any
        keys the template reads, e.g. tool calls); an assistant message with "train": False is context.
    reward: the trajectory's reward (received after its last turn).
    turn_rewards: optional, one per assistant message (in order): per-turn rewards -> per-token advantages.
    sampler_logprobs: optional, one list per assistant message (None for a message the engine did not
        generate): log pi_sampler of each generated token of that turn.
    sampler_token_ids: optional, one list per assistant message: the token ids the engine generated.
    tools: optional tool definitions passed to the chat template.
    """

    messages: list[dict[str, Any]]
    reward: float
    turn_rewards: list[float] | None = None
    sampler_logprobs: list[list[float] | None] | None = None
    sampler_token_ids: list[list[int] | None] | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass
class TrajectoryGroup:
    """The trajectories of one prompt (task): advantages compare them with each other."""

    trajectories: list[Trajectory] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass
class TokenizedTrajectory:
    """A trajectory as one trainable sequence: the first prompt, then the rest of the conversation.

    prompt_ids: tokens up to the first trained assistant turn's header (inclusive);
    completion_ids: every later token; turn: per completion token, the index of the assistant message it
    was generated in if it is trained, else -1; sampler_logprobs: per completion token, NaN if unknown.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    turn: list[int]
    sampler_logprobs: list[float]

    def sequence(self) -> Sequence:
        return Sequence(self.prompt_ids, self.completion_ids, [t >= 0 for t in self.turn])


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool
) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenize_prompts(tokenizer, [text])[0]


def _per_turn(values: list[Any] | None, num_assistant: int, name: str) -> list[Any]:
    if values is None:
        return [None] * num_assistant
    if len(values) != num_assistant:
        raise TrajectoryError(
            f"{name} has {len(values)} entries for {num_assistant} assistant messages (one per assistant message)"
        )
    return list(values)


def tokenize_trajectory(tokenizer: PreTrainedTokenizerBase, trajectory: Trajectory) -> TokenizedTrajectory:
    """Tokens, trained-token turns and sampler log-probs of a trajectory (module docstring: the method)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise TrajectoryError("trajectories need a tokenizer with a chat template (tokenizer.chat_template)")
    messages, tools = trajectory.messages, trajectory.tools
    assistant = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    trained = [a for a, k in enumerate(assistant) if messages[k].get("train", True)]
    if not trained:
        roles = [m.get("role") for m in messages]
        raise TrajectoryError(
            f"no assistant tokens to train: the messages have roles {roles} (an assistant message with "
            '"train": False is context only); drop this trajectory or add the assistant turns it produced'
        )
    logprobs = _per_turn(trajectory.sampler_logprobs, len(assistant), "sampler_logprobs")
    sampled_ids = _per_turn(trajectory.sampler_token_ids, len(assistant), "sampler_token_ids")
    end_ids = {tokenizer.eos_token_id}
    full = _render(tokenizer, messages, tools, False)
    ids: list[int] = []
    turn: list[int] = []
    lps: list[float] = []
    starts: dict[int, int] = {}  # assistant index -> where its generated tokens start in `ids`
    pos = 0  # how much of `full` has been copied
    for a, k in enumerate(assistant):
        before = _render(tokenizer, messages[:k], tools, True)
        through = _render(tokenizer, messages[: k + 1], tools, False)
        for name, part in (("the messages before it (with the generation prompt)", before), ("it", through)):
            if full[: len(part)] != part:
                raise TrajectoryError(
                    f"assistant message {a} (message {k}): the chat template is not prefix-stable: rendering "
                    f"the conversation up to {name} does not give a prefix of the whole conversation's "
                    "tokens (the template renders a turn differently once later messages follow, e.g. it "
                    "drops earlier reasoning). Train each assistant turn as its own trajectory instead."
                )
        if len(before) < pos or len(through) < len(before):
            raise TrajectoryError(
                f"assistant message {a} (message {k}): the chat template reorders turns; cannot locate its tokens"
            )
        region = full[len(before) : len(through)]
        end = next((j + 1 for j, t in enumerate(region) if t in end_ids), len(region))
        generated, glue = region[:end], region[end:]
        ids += full[pos : len(before)]
        turn += [-1] * (len(before) - pos)
        lps += [math.nan] * (len(before) - pos)
        if sampled_ids[a] is not None:
            generated, glue = _splice_sampled(tokenizer, a, list(sampled_ids[a]), generated, glue, end_ids)
        if logprobs[a] is not None and len(logprobs[a]) != len(generated):
            pieces = tokenizer.convert_ids_to_tokens(generated)
            raise TrajectoryError(
                f"assistant message {a}: {len(logprobs[a])} sampler log-probs for {len(generated)} generated "
                f"tokens {pieces} (the trainer's tokenisation, end-of-turn token included; NaN for a token "
                "the engine did not report). The engine's tokens are not aligned with the trainer's: pass "
                "sampler_token_ids, or check that the engine serves the same tokenizer."
            )
        starts[a] = len(ids)
        is_trained = a in trained
        ids += generated
        turn += [a if is_trained else -1] * len(generated)
        lps += [float(x) for x in logprobs[a]] if logprobs[a] is not None else [math.nan] * len(generated)
        ids += glue
        turn += [-1] * len(glue)
        lps += [math.nan] * len(glue)
        pos = len(through)
    if not any(t >= 0 for t in turn):
        raise TrajectoryError("no assistant tokens to train: every trained assistant message renders empty")
    # the prompt ends where the first trained turn starts; tokens after the last trained one change nothing
    first = starts[trained[0]]
    last = max(j for j, t in enumerate(turn) if t >= 0) + 1
    return TokenizedTrajectory(ids[:first], ids[first:last], turn[first:last], lps[first:last])


def _splice_sampled(
    tokenizer: PreTrainedTokenizerBase,
    a: int,
    sampled: list[int],
    generated: list[int],
    glue: list[int],
    end_ids: set[int],
) -> tuple[list[int], list[int]]:
    """The engine's own tokens for a turn, checked to spell what the template renders there."""
    # a turn cut off at the length limit has no end-of-turn token: the template's one becomes context
    if generated and generated[-1] in end_ids and (not sampled or sampled[-1] not in end_ids):
        generated, glue = generated[:-1], [generated[-1], *glue]
    mine, theirs = tokenizer.decode(generated), tokenizer.decode(sampled)
    if mine != theirs:
        raise TrajectoryError(
            f"assistant message {a}: sampler_token_ids spell {theirs!r} but the chat template renders "
            f"{mine!r} for this turn; the message content must be the decoded sampled tokens (templates that "
            "rewrite content, e.g. strip whitespace, cannot be aligned)"
        )
    return sampled, glue


def group_token_advantages(
    groups: list[TrajectoryGroup], tokenized: list[list[TokenizedTrajectory]], scale: str
) -> tuple[list[list[float]] | torch.Tensor, torch.Tensor]:
    """Advantages of every trajectory (module docstring: the mapping), groups flattened in order.

    Returns (advantages, zero_std): advantages (n,) per sequence when no trajectory has turn rewards, else
    one list per sequence with a value per completion token (0 off trained tokens); zero_std (num_groups,).
    """
    totals = [
        [t.reward + sum(t.turn_rewards or []) for t in group.trajectories] for group in groups
    ]  # R_i + sum_k r_i,k = G_i,0
    returns = []  # per group, per trajectory: G_i,k for each assistant message k
    for group in groups:
        returns.append([])
        for t in group.trajectories:
            rewards = list(t.turn_rewards) if t.turn_rewards is not None else []
            num_turns = sum(m.get("role") == "assistant" for m in t.messages)
            rewards += [0.0] * (num_turns - len(rewards))
            # G_k = sum_{j >= k} r_j + R   (reward-to-go, the trajectory reward last)
            to_go, acc = [], t.reward
            for r in reversed(rewards):
                acc += r
                to_go.append(acc)
            returns[-1].append(to_go[::-1])
    per_token = any(t.turn_rewards is not None for g in groups for t in g.trajectories)
    values = [[v for gs in group for v in gs] for group in returns]  # all G_i,k of a group
    if not per_token:
        values = [list(group) for group in totals]
    zero_std = torch.tensor([all(v == vs[0] for v in vs) for vs in values])
    flat = torch.tensor([v for vs in values for v in vs], dtype=torch.float64)
    batch_std = float(flat.std(unbiased=False)) if flat.numel() else 0.0
    scales = []
    for vs in values:
        std = float(torch.tensor(vs, dtype=torch.float64).std(unbiased=False))
        scales.append({"group": std + ADVANTAGE_EPS, "batch": batch_std + ADVANTAGE_EPS, "none": 1.0}[scale])
    baselines = [sum(g) / len(g) for g in totals]
    if not per_token:
        out = [
            0.0 if zero_std[g] else (total - baselines[g]) / scales[g]
            for g, group in enumerate(totals)
            for total in group
        ]
        return torch.tensor(out, dtype=torch.float32), zero_std
    token_adv = []
    for g, group in enumerate(tokenized):
        for i, tok in enumerate(group):
            turn_adv = [0.0 if zero_std[g] else (r - baselines[g]) / scales[g] for r in returns[g][i]]
            token_adv.append([turn_adv[k] if k >= 0 else 0.0 for k in tok.turn])
    return token_adv, zero_std


def train_on_groups(trainer: Trainer, groups: Seq[TrajectoryGroup]) -> dict[str, float]:
    """One rollout batch of GSPO updates on the user's trajectory groups; returns (and logs) its metrics."""
    groups = list(groups)
    if not groups or any(len(g) == 0 for g in groups):
        raise TrajectoryError("train_on_groups needs at least one group, and no empty group")
    config = trainer.config
    tokenized: list[list[TokenizedTrajectory]] = []
    for g, group in enumerate(groups):
        tokenized.append([])
        for i, trajectory in enumerate(group.trajectories):
            try:
                tokenized[-1].append(tokenize_trajectory(trainer.tokenizer, trajectory))
            except TrajectoryError as error:
                raise TrajectoryError(f"group {g}, trajectory {i}: {error}") from None
            if config.train.old_logprobs == "sampler" and trajectory.sampler_logprobs is None:
                raise TrajectoryError(
                    f"group {g}, trajectory {i}: train.old_logprobs=sampler needs the sampler's log-probs "
                    "(Trajectory.sampler_logprobs); give them, or set train.old_logprobs=recompute"
                )
            bad = [r for r in [trajectory.reward, *(trajectory.turn_rewards or [])] if not math.isfinite(r)]
            if bad:
                raise TrajectoryError(f"group {g}, trajectory {i}: reward {bad[0]} is not finite")
    advantages, zero_std = group_token_advantages(groups, tokenized, config.train.advantage_scale)
    flat = [tok for group in tokenized for tok in group]
    group_of = [g for g, group in enumerate(groups) for _ in group.trajectories]
    rewards = torch.tensor([t.reward + sum(t.turn_rewards or []) for g in groups for t in g.trajectories])
    logged = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "zero_std_groups": float(zero_std.sum()),
        "num_groups": float(len(groups)),
        "num_trajectories": float(len(flat)),
        "assistant_tokens_mean": sum(sum(t >= 0 for t in tok.turn) for tok in flat) / len(flat),
        "completion_len_mean": sum(len(tok.completion_ids) for tok in flat) / len(flat),
        "lr": trainer.scheduler.get_last_lr()[0],
    }
    keep = [
        i for i in range(len(flat)) if not (config.train.filter_zero_std_groups and zero_std[group_of[i]])
    ]
    if 0 < len(keep) < config.train.minibatches_per_rollout:
        raise TrajectoryError(
            f"{len(keep)} trajectories to train on (after filter_zero_std_groups) cannot fill "
            f"train.minibatches_per_rollout={config.train.minibatches_per_rollout} minibatches: pass more "
            "groups per call or lower train.minibatches_per_rollout"
        )
    if not keep:  # every group had equal returns: nothing to learn from this batch
        metrics = {**logged, "time_old_logprobs": 0.0, "time_update": 0.0, "num_trained": 0.0}
    else:
        sequences = [flat[i].sequence() for i in keep]
        if isinstance(advantages, torch.Tensor):
            kept_adv: torch.Tensor | list[list[float]] = advantages[keep]
        else:
            kept_adv = [advantages[i] for i in keep]
        learned = trainer.learn(sequences, kept_adv, [flat[i].sampler_logprobs for i in keep])
        metrics = {**logged, **learned, "num_trained": float(len(keep))}
    trainer.step += 1
    trainer.logger.log(trainer.step, metrics)
    return metrics


def groups_from_rollouts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[dict[str, Any]]],
    rollouts: Rollouts,
    rewards: Seq[float],
) -> list[TrajectoryGroup]:
    """Single-turn trajectory groups from `Rollouts` (the HF sampler's or `gspo.openai_backend`'s).

    prompts: the chat messages of each prompt, whose templated text the rollouts continued; rewards: one
    per sample (sample-major, like the rollouts). The sampled token ids and log-probs travel with each
    trajectory; its prompt tokens must be those the sampler was given.
    """
    if len(rollouts) % max(len(prompts), 1) or len(rewards) != len(rollouts):
        raise TrajectoryError(
            f"{len(rollouts)} rollouts and {len(rewards)} rewards for {len(prompts)} prompts: "
            "expected the same number of samples for every prompt and one reward per sample"
        )
    group_size = len(rollouts) // len(prompts)
    eos = tokenizer.eos_token_id
    groups = []
    for j, messages in enumerate(prompts):
        expected = _render(tokenizer, messages, None, True)
        trajectories = []
        for i in range(j * group_size, (j + 1) * group_size):
            if rollouts.prompt_ids[i] != expected:
                raise TrajectoryError(
                    f"sample {i}: its prompt tokens are not the chat template's rendering of prompt {j}"
                )
            ids = rollouts.completion_ids[i]
            content = tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids)
            trajectories.append(
                Trajectory(
                    [*messages, {"role": "assistant", "content": content}],
                    reward=float(rewards[i]),
                    sampler_logprobs=[list(rollouts.sampler_logprobs[i])],
                    sampler_token_ids=[list(ids)],
                )
            )
        groups.append(TrajectoryGroup(trajectories))
    return groups
