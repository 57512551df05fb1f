"""Samplers: G completions per prompt with the sampler's per-token log-probs, from any engine.

A `Sampler` is the trainer's own model in this process (`HFSampler`, a KV-cached sampling loop that
computes each prompt once for its G samples) or an
OpenAI-compatible server (gspo.rollout.openai.OpenAIBackend). The log-probs are those of the tempered
distribution, log_softmax(logits / temperature) at the sampled token, which the trainer also scores;
top-p truncation is not folded into them (as in vLLM's default), and HF's implicit top_k=50 is off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Rollouts:
    """Completions of a rollout batch, sample-major: the G samples of prompt j are rows j*G .. j*G+G-1."""

    prompt_ids: list[list[int]]
    """Token ids of each sample's (templated) prompt."""
    completion_ids: list[list[int]]
    """Sampled token ids, up to and including the first EOS."""
    sampler_logprobs: list[list[float]]
    """log pi_sampler of each completion token (aligned with completion_ids)."""
    truncated: list[bool]
    """True when the completion hit max_new_tokens without an EOS."""
    completions: list[str]
    """Decoded completions, special tokens removed."""
    computed_tokens: int = 0
    """Tokens the sampler ran through the model (prompts once per group, padding included); 0: unknown."""

    def __len__(self) -> int:
        return len(self.completion_ids)


def tokenize_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    # a chat template already wrote the special tokens it needs; a raw prompt gets the tokenizer's (e.g. BOS)
    add_special = getattr(tokenizer, "chat_template", None) is None
    return [tokenizer(p, add_special_tokens=add_special).input_ids for p in prompts]


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    batch_size: int = 64,
) -> Rollouts:
    """Sample `group_size` completions of each prompt (already templated), about `batch_size` at a time.

    Each prompt runs through the model once: its KV cache is then copied to its G samples, which decode
    together; a sample that has produced EOS leaves the batch. Sampling draws from torch's global RNG.
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token: set tokenizer.eos_token so completions can stop")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    prompt_ids = tokenize_prompts(tokenizer, prompts)
    out = Rollouts([], [], [], [], [])
    was_training = model.training
    model.eval()
    per_call = max(1, batch_size // group_size)  # prompts per call: about batch_size sequences
    for start in range(0, len(prompt_ids), per_call):
        rows = prompt_ids[start : start + per_call]
        new, logprobs, lengths, computed = _sample(
            model, rows, group_size, max_new_tokens, temperature, top_p, greedy, eos_id, pad_id
        )
        out.computed_tokens += computed
        for i in range(len(rows) * group_size):
            n = int(lengths[i])
            completion = new[i, :n].tolist()
            out.prompt_ids.append(rows[i // group_size])
            out.completion_ids.append(completion)
            out.sampler_logprobs.append(logprobs[i, :n].tolist())
            out.truncated.append(eos_id not in completion)
            out.completions.append(tokenizer.decode(completion, skip_special_tokens=True))
    model.train(was_training)
    return out


def _sample(
    model: PreTrainedModel,
    rows: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    greedy: bool,
    eos_id: int,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Tokens (n, max_new_tokens), their log-probs, lengths (up to and including EOS) and the number of
    tokens computed, for n = len(rows) * group_size samples."""
    device = model.device
    ids, mask = (t.to(device) for t in _left_pad(rows, pad_id))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # the prompts once; only the last position's logits are needed
    result = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    cache = result.past_key_values
    cache.batch_repeat_interleave(group_size)  # each prompt's keys and values for its G samples
    logits = result.logits[:, -1].float().repeat_interleave(group_size, 0)  # (n, V)
    mask = mask.repeat_interleave(group_size, 0)
    position = positions[:, -1:].repeat_interleave(group_size, 0) + 1  # (n, 1)
    n = logits.shape[0]
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    active = torch.arange(n, device=device)  # the samples still generating, in the cache's row order
    computed = ids.numel()
    for t in range(max_new_tokens):
        # log pi_sampler = log_softmax(logits / T): the distribution the trainer scores (top-p not folded in)
        log_pi = torch.log_softmax(logits if greedy else logits / temperature, dim=-1)
        chosen = log_pi.argmax(-1) if greedy else _draw(log_pi, top_p)
        tokens[active, t] = chosen
        logprobs[active, t] = log_pi.gather(1, chosen[:, None]).squeeze(1)
        done = chosen == eos_id
        lengths[active[done]] = t + 1
        keep = (~done).nonzero().squeeze(1)
        if t == max_new_tokens - 1 or keep.numel() == 0:
            break
        if keep.numel() < active.numel():  # finished samples leave the batch
            cache.batch_select_indices(keep)
            active, chosen, mask, position = active[keep], chosen[keep], mask[keep], position[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        result = model(
            input_ids=chosen[:, None],
            attention_mask=mask,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
        )
        computed += chosen.numel()
        logits = result.logits[:, -1].float()
        position = position + 1
    return tokens.cpu(), logprobs.cpu(), lengths.cpu(), computed


def _draw(log_pi: torch.Tensor, top_p: float) -> torch.Tensor:
    """One token per row from exp(log_pi), restricted to the top-p nucleus (the smallest set of the most
    likely tokens whose probability reaches top_p; transformers' TopPLogitsWarper rule)."""
    probs = log_pi.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1)  # ascending
        drop = sorted_probs.cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1).squeeze(1)


class Sampler(Protocol):
    """Draws ``group_size`` completions of each (templated) prompt, with their per-token log-probs.

    current: whether the samples come from the trainer's current weights in its compute dtype, so that
    its log-probs are the old policy's (``train.old_logprobs=auto`` then skips the recompute pass).
    sync_weights: called after each rollout batch's updates, to hand the new weights to the engine.
    """

    current: bool

    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> Rollouts: ...

    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None: ...


@dataclass
class HFSampler:
    """The trainer's own model, sampling in this process (`generate`: each prompt computed once per group).

    context: entered around each call, e.g. FSDP2's gathered parameters and the compute dtype's autocast.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    batch_size: int = 64
    context: Callable[[], AbstractContextManager[Any]] = field(default=contextlib.nullcontext)
    current: bool = True

    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> Rollouts:
        with self.context():
            return generate(
                self.model,
                self.tokenizer,
                prompts,
                group_size=group_size,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                greedy=greedy,
                batch_size=self.batch_size,
            )

    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        """Nothing to do: it samples from the trainer's own parameters."""
