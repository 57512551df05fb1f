"""Bring-your-own rollouts: conversations the user's own agent or environment produced, as training samples.

A `Trajectory` is one chat conversation (tool turns included) with its reward, optionally per-turn rewards
and the sampler's token ids and log-probs; a `TrajectoryGroup` holds the G trajectories of one prompt.
`trajectory_samples` tokenises them as the trainer tokenises prompts (assistant turns located by prefixes
of the chat template's renders, never by searching for their text) into `Sample`s for
`Trainer.train_on_groups`. `render_turns`, shared with gspo serve's chat prompts, tokenises the context
before each assistant turn and the turn apart, as the engine saw them.
docs/trajectories.md has the tokenisation rules, the per-turn advantages and a user's loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gspo.core.samples import Sample
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
    turn_rewards: optional, exactly one per assistant message (in order; 0.0 for a turn without a reward):
        per-turn rewards -> per-token advantages (docs/trajectories.md).
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
) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def _tokens(tokenizer: PreTrainedTokenizerBase, text: str, *, first: bool) -> list[int]:
    """The tokens of one piece of the rendered conversation: the first as the trainer tokenises a prompt,
    later ones without the tokenizer's special tokens (the template wrote those it needs)."""
    if first:
        return tokenize_prompts(tokenizer, [text])[0]
    return tokenizer(text, add_special_tokens=False).input_ids if text else []


def _per_turn(values: list[Any] | None, num_assistant: int, name: str) -> list[Any]:
    if values is None:
        return [None] * num_assistant
    if len(values) != num_assistant:
        raise TrajectoryError(
            f"{name} has {len(values)} entries for {num_assistant} assistant messages (one per assistant message)"
        )
    return list(values)


@dataclass
class Turn:
    """Where one assistant message's generated tokens lie in a rendering: ids[start:end] (its end-of-turn
    token included when it was generated); spliced: they are the caller's tokens, not the template's."""

    message: int
    start: int
    end: int
    spliced: bool


@dataclass
class Rendering:
    """A conversation's token ids and its assistant turns, in order."""

    ids: list[int]
    turns: list[Turn]


Splice = Callable[[int, list[int], list[int], list[int]], tuple[list[int], list[int]] | None]
"""(assistant index, the ids so far: the turn's prompt, the template's generated tokens, the template's glue
after them) -> the (generated, glue) tokens to use instead, or None for the template's."""


def render_turns(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: Any = None,
    *,
    generation_prompt: bool = False,
    splice: Splice | None = None,
    check_text: Callable[[str], None] | None = None,
) -> Rendering:
    """The chat template's tokens of a conversation with each assistant turn located (module docstring),
    and, where `splice` gives them, the turn's own tokens in place of the template's. `check_text` sees
    the conversation's text before anything is tokenised (and may raise to refuse it)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise TrajectoryError("trajectories need a tokenizer with a chat template (tokenizer.chat_template)")
    end_ids = {tokenizer.eos_token_id}
    full = _render(tokenizer, messages, tools, generation_prompt)
    if check_text is not None:
        check_text(full)
    ids: list[int] = []
    turns: list[Turn] = []
    pos = 0  # how much of `full` (characters) has been placed
    assistant = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    for a, k in enumerate(assistant):
        before, through = _locate_turn(tokenizer, messages, tools, full, (a, k), pos)
        # the context up to the turn's header and the turn are tokenised apart, as the engine saw them: it
        # was prompted with the context's tokens and generated the turn's (one string would merge a turn's
        # leading newline into the header's)
        ids += _tokens(tokenizer, full[pos:before], first=pos == 0)
        region = _tokens(tokenizer, full[before:through], first=False)
        end = next((j + 1 for j, t in enumerate(region) if t in end_ids), len(region))
        generated, glue = region[:end], region[end:]
        own = splice(a, ids, generated, glue) if splice is not None else None
        if own is not None:
            generated, glue = own
        turns.append(Turn(k, len(ids), len(ids) + len(generated), own is not None))
        ids += generated + glue
        pos = through
    return Rendering(ids + _tokens(tokenizer, full[pos:], first=pos == 0), turns)


def _locate_turn(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: Any,
    full: str,
    where: tuple[int, int],
    pos: int,
) -> tuple[int, int]:
    """Where assistant message k (the a-th, ``where = (a, k)``) renders in the whole conversation's text
    ``full``: (end of the messages before it with the generation prompt, end of it), in characters; checked
    to be prefixes of ``full`` past ``pos`` (the text already placed)."""
    a, k = where
    before = _render(tokenizer, messages[:k], tools, True)
    through = _render(tokenizer, messages[: k + 1], tools, False)
    for name, part in (("the messages before it (with the generation prompt)", before), ("it", through)):
        if not full.startswith(part):
            raise TrajectoryError(
                f"assistant message {a} (message {k}): the chat template is not prefix-stable: rendering "
                f"the conversation up to {name} does not give a prefix of the whole conversation "
                "(the template renders a turn differently once later messages follow, e.g. it drops "
                "earlier reasoning). Train each assistant turn as its own trajectory instead."
            )
    if len(before) < pos or len(through) < len(before):
        raise TrajectoryError(
            f"assistant message {a} (message {k}): the chat template reorders turns; cannot locate its tokens"
        )
    return len(before), len(through)


def tokenize_trajectory(tokenizer: PreTrainedTokenizerBase, trajectory: Trajectory) -> TokenizedTrajectory:
    """Tokens, trained-token turns and sampler log-probs of a trajectory (module docstring: the method)."""
    messages = trajectory.messages
    assistant = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    trained = [a for a, k in enumerate(assistant) if messages[k].get("train", True)]
    if not trained:
        roles = [m.get("role") for m in messages]
        raise TrajectoryError(
            f"no assistant tokens to train: the messages have roles {roles} (an assistant message with "
            '"train": False is context only); drop this trajectory or add the assistant turns it produced'
        )
    _per_turn(trajectory.turn_rewards, len(assistant), "turn_rewards")  # 0.0 for a turn without a reward
    logprobs = _per_turn(trajectory.sampler_logprobs, len(assistant), "sampler_logprobs")
    sampled_ids = _per_turn(trajectory.sampler_token_ids, len(assistant), "sampler_token_ids")
    end_ids = {tokenizer.eos_token_id}

    def splice(
        a: int, _: list[int], generated: list[int], glue: list[int]
    ) -> tuple[list[int], list[int]] | None:
        if sampled_ids[a] is None:
            return None
        return _splice_sampled(tokenizer, a, list(sampled_ids[a]), generated, glue, end_ids)

    rendering = render_turns(tokenizer, messages, trajectory.tools, splice=splice)
    ids = rendering.ids
    turn = [-1] * len(ids)
    lps = [math.nan] * len(ids)
    for a, span in enumerate(rendering.turns):
        width = span.end - span.start
        if logprobs[a] is not None and len(logprobs[a]) != width:
            pieces = tokenizer.convert_ids_to_tokens(ids[span.start : span.end])
            raise TrajectoryError(
                f"assistant message {a}: {len(logprobs[a])} sampler log-probs for {width} generated "
                f"tokens {pieces} (the trainer's tokenisation, end-of-turn token included; NaN for a token "
                "the engine did not report). The engine's tokens are not aligned with the trainer's: pass "
                "sampler_token_ids, or check that the engine serves the same tokenizer."
            )
        if a in trained:
            turn[span.start : span.end] = [a] * width
        if logprobs[a] is not None:
            lps[span.start : span.end] = [float(x) for x in logprobs[a]]
    if not any(t >= 0 for t in turn):
        raise TrajectoryError("no assistant tokens to train: every trained assistant message renders empty")
    # the prompt ends where the first trained turn starts; tokens after the last trained one change nothing
    first = rendering.turns[trained[0]].start
    last = max(j for j, t in enumerate(turn) if t >= 0) + 1
    return TokenizedTrajectory(ids[:first], ids[first:last], turn[first:last], lps[first:last])


def end_of_turn_as_context(
    sampled: list[int], generated: list[int], glue: list[int], end_ids: set[int]
) -> tuple[list[int], list[int]]:
    """The template's (generated, glue) tokens of a turn whose sampled tokens replace `generated`: a turn
    cut off before its end-of-turn token (the length limit, a stop string) did not generate the template's
    one, which becomes context (glue)."""
    if generated and generated[-1] in end_ids and (not sampled or sampled[-1] not in end_ids):
        return generated[:-1], [generated[-1], *glue]
    return generated, glue


def _splice_sampled(
    tokenizer: PreTrainedTokenizerBase,
    a: int,
    sampled: list[int],
    generated: list[int],
    glue: list[int],
    end_ids: set[int],
) -> tuple[list[int], list[int]]:
    """The engine's own tokens for a turn, checked to spell what the template renders there."""
    generated, glue = end_of_turn_as_context(sampled, generated, glue, end_ids)
    mine, theirs = tokenizer.decode(generated), tokenizer.decode(sampled)
    if mine != theirs:
        raise TrajectoryError(
            f"assistant message {a}: sampler_token_ids spell {theirs!r} but the chat template renders "
            f"{mine!r} for this turn; the message content must be the decoded sampled tokens (templates that "
            "rewrite content, e.g. strip whitespace, cannot be aligned)"
        )
    return sampled, glue


def trajectory_samples(
    tokenizer: PreTrainedTokenizerBase,
    groups: Sequence[TrajectoryGroup],
    *,
    need_sampler_logprobs: bool = False,
) -> list[Sample]:
    """The training samples of trajectory groups, in order (group g's trajectories have group id g).

    Every group holds at least two trajectories (advantages compare a group's trajectories with each other)
    and turn rewards, where given, are one per assistant message. When any trajectory has them, every
    sample gets them (zeros for a trajectory without), so all advantages are per turn.
    need_sampler_logprobs: refuse trajectories without them. Raises TrajectoryError naming the group and
    trajectory.
    """
    groups = list(groups)
    if not groups:
        raise TrajectoryError("train_on_groups needs at least one group of trajectories")
    for g, group in enumerate(groups):
        if len(group) < 2:
            raise TrajectoryError(
                f"group {g} has {len(group)} trajector{'y' if len(group) == 1 else 'ies'}: advantages compare "
                "the trajectories of a group with each other, so a group needs at least 2 (the same task "
                "attempted several times, like rollout.group_size); a group of one would train nothing"
            )
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
            if per_turn:  # G_k = sum_{j >= k} r_j + R over every assistant message (checked: one each)
                turns = sum(m.get("role") == "assistant" for m in trajectory.messages)
                turn_rewards = list(trajectory.turn_rewards or [0.0] * turns)
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
    rewards: Sequence[float],
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
        expected = _tokens(tokenizer, _render(tokenizer, messages, None, True), first=True)
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
