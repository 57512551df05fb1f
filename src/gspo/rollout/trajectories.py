"""Bring-your-own rollouts: conversations the user's own agent or environment produced, as training samples.

A `Trajectory` is one chat conversation (tool turns included) with its reward, optionally per-turn rewards
and the sampler's token ids and log-probs; a `TrajectoryGroup` holds the G trajectories of one prompt.
`trajectory_samples` tokenises them exactly as the trainer tokenises prompts (assistant turns located by
token-id prefixes of the chat template, never by searching text) into `Sample`s for `Trainer.train_on_groups`.
docs/trajectories.md has the tokenisation rules, the per-turn advantages and a user's loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gspo.learning.batch import Sample
from gspo.rollout.samplers import Rollouts, tokenize_prompts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
        before, through = _locate_turn(tokenizer, trajectory, full, (a, k), pos)
        region = full[before:through]
        end = next((j + 1 for j, t in enumerate(region) if t in end_ids), len(region))
        generated, glue = region[:end], region[end:]
        ids += full[pos:before]
        turn += [-1] * (before - pos)
        lps += [math.nan] * (before - pos)
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
        pos = through
    if not any(t >= 0 for t in turn):
        raise TrajectoryError("no assistant tokens to train: every trained assistant message renders empty")
    # the prompt ends where the first trained turn starts; tokens after the last trained one change nothing
    first = starts[trained[0]]
    last = max(j for j, t in enumerate(turn) if t >= 0) + 1
    return TokenizedTrajectory(ids[:first], ids[first:last], turn[first:last], lps[first:last])


def _locate_turn(
    tokenizer: PreTrainedTokenizerBase,
    trajectory: Trajectory,
    full: list[int],
    where: tuple[int, int],
    pos: int,
) -> tuple[int, int]:
    """Where assistant message k (the a-th, ``where = (a, k)``) renders in the whole conversation's tokens
    ``full``: (end of the messages before it with the generation prompt, end of it); checked to be prefixes
    of ``full`` past ``pos`` (the tokens already placed)."""
    a, k = where
    messages, tools = trajectory.messages, trajectory.tools
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
    return len(before), len(through)


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


def trajectory_samples(
    tokenizer: PreTrainedTokenizerBase, groups: Seq[TrajectoryGroup], *, need_sampler_logprobs: bool = False
) -> list[Sample]:
    """The training samples of trajectory groups, in order (group g's trajectories have group id g).

    When any trajectory has turn rewards, every sample gets one per assistant message (zeros where none
    were given), so all advantages are per turn. need_sampler_logprobs: refuse trajectories without them.
    Raises TrajectoryError naming the group and trajectory.
    """
    groups = list(groups)
    if not groups or any(len(g) == 0 for g in groups):
        raise TrajectoryError("train_on_groups needs at least one group, and no empty group")
    per_turn = any(t.turn_rewards is not None for g in groups for t in g.trajectories)
    samples = []
    for g, group in enumerate(groups):
        for i, trajectory in enumerate(group.trajectories):
            try:
                tokens = tokenize_trajectory(tokenizer, trajectory)
            except TrajectoryError as error:
                raise TrajectoryError(f"group {g}, trajectory {i}: {error}") from None
            if need_sampler_logprobs and trajectory.sampler_logprobs is None:
                raise TrajectoryError(
                    f"group {g}, trajectory {i}: train.old_logprobs=sampler needs the sampler's log-probs "
                    "(Trajectory.sampler_logprobs); give them, or set train.old_logprobs=recompute"
                )
            bad = [r for r in [trajectory.reward, *(trajectory.turn_rewards or [])] if not math.isfinite(r)]
            if bad:
                raise TrajectoryError(f"group {g}, trajectory {i}: reward {bad[0]} is not finite")
            turn_rewards = None
            if per_turn:  # G_k = sum_{j >= k} r_j + R over every assistant message, zeros where not given
                turns = sum(m.get("role") == "assistant" for m in trajectory.messages)
                given = list(trajectory.turn_rewards or [])
                turn_rewards = given + [0.0] * (turns - len(given))
            samples.append(
                Sample(
                    tokens.prompt_ids,
                    tokens.completion_ids,
                    tokens.sampler_logprobs,
                    reward=trajectory.reward,
                    group=g,
                    train_mask=[t >= 0 for t in tokens.turn],
                    turns=tokens.turn,
                    turn_rewards=turn_rewards,
                )
            )
    return samples


def groups_from_rollouts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[dict[str, Any]]],
    rollouts: Rollouts,
    rewards: Seq[float],
) -> list[TrajectoryGroup]:
    """Single-turn trajectory groups from `Rollouts` (the HF sampler's or `gspo.rollout.openai`'s).

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
