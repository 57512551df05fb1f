"""Samplers: G completions per prompt with the sampler's per-token log-probs, from any engine.

A `Sampler` is the trainer's own model in this process (`HFSampler`, transformers `generate`) or an
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
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase


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
    """Sample `group_size` completions for each prompt (already templated), `batch_size` sequences at a time."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token: set tokenizer.eos_token so completions can stop")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    generation = GenerationConfig(
        do_sample=not greedy, temperature=None if greedy else temperature, top_p=None if greedy else top_p,
        top_k=None if greedy else 0, max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
        use_cache=True, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    prompt_ids = [ids for ids in tokenize_prompts(tokenizer, prompts) for _ in range(group_size)]
    out = Rollouts([], [], [], [], [])
    was_training = model.training
    model.eval()
    for start in range(0, len(prompt_ids), batch_size):
        rows = prompt_ids[start : start + batch_size]
        ids, mask = (t.to(model.device) for t in _left_pad(rows, pad_id))
        result = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation)
        new = result.sequences[:, ids.shape[1] :]  # (b, n)
        logits = torch.stack(result.logits, dim=1).float()  # (b, n, V)
        logprobs = torch.log_softmax(logits / (1.0 if greedy else temperature), dim=-1)
        token_logprobs = logprobs.gather(-1, new.unsqueeze(-1)).squeeze(-1).cpu()  # (b, n)
        new = new.cpu()  # read back once per batch, not per row
        is_eos = new == eos_id
        has_eos = is_eos.any(dim=1)
        # length up to and including the first EOS; the whole row when there is none
        lengths = torch.where(
            has_eos,
            is_eos.float().argmax(dim=1) + 1,
            torch.full_like(has_eos, new.shape[1], dtype=torch.long),
        )
        for i, row in enumerate(rows):
            n = int(lengths[i])
            completion = new[i, :n].tolist()
            out.prompt_ids.append(row)
            out.completion_ids.append(completion)
            out.sampler_logprobs.append(token_logprobs[i, :n].tolist())
            out.truncated.append(not bool(has_eos[i]))
            out.completions.append(tokenizer.decode(completion, skip_special_tokens=True))
    model.train(was_training)
    return out


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
    """The trainer's own model, sampling with transformers `generate` in this process.

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
