"""The MoE studies' task: a tiny Qwen3-MoE learning sums, cold-started once by SFT and shared by every run.

Sums a + b with 0 <= a, b <= operand_max, chat-formatted, reward 1 for the exact answer; the model is a
transformers Qwen3-MoE (top-k routing, gates renormalised over the k like Qwen3-30B-A3B) with the
character-level tokenizer of ``gspo.models``. The cold start fine-tunes on the training split until the
greedy accuracy on training problems reaches a target, so that RL starts from a non-zero reward.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.config import load_config
from gspo.models import save_model, tiny_tokenizer
from gspo.rewards.builtins import exact_answer
from gspo.rollout.data import Example, format_prompt
from gspo.rollout.requests import SamplingParams
from gspo.rollout.samplers import generate, tokenize_prompts
from gspo.training.inputs import build_examples


@dataclass(frozen=True)
class Spec:
    """Everything that sizes a study on this task: model, cold start, RL runs (paper.FULL, paper.REDUCED)."""

    hidden: int = 64
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    operand_max: int = 19
    """Sums a + b with 0 <= a, b <= operand_max."""
    num_eval: int = 100
    sft_batch: int = 64
    sft_lr: float = 3e-3
    sft_max_steps: int = 600
    sft_target: float = 0.3
    """Stop the cold start once greedy accuracy on (the first 100) training problems reaches this."""
    sft_check_every: int = 25
    seeds: tuple[int, ...] = (0, 1, 2)
    lrs: tuple[float, ...] = (3e-4, 1e-3)
    """RL learning rates, each run for every method and seed. Chosen before the experiment from a 30-step
    GRPO probe on seed 0 with the FULL cold start (2026-11-22): at 1e-3 held-out accuracy fell from 0.34 to
    0.11 (the regime where stability claims can show), at 3e-4 the training reward rose from 0.26 to 0.33
    (the largest probed rate where GRPO learns)."""
    steps: int = 300
    prompts_per_step: int = 16
    group_size: int = 8
    minibatches: int = 4
    eval_every: int = 20
    checkpoint_every: int = 50
    minibatch_split: str = "sample"
    """train.minibatch_split: any samples per minibatch (the default, and what docs/paper_reproduction.md ran
    with), or whole groups (their prompts computed once)."""

    @property
    def num_train(self) -> int:
        return (self.operand_max + 1) ** 2 - self.num_eval

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


def base_overrides(spec: Spec) -> list[str]:
    """The config of every RL run on this task, as `gspo train` overrides (seed, lr and method apart)."""
    return [
        "task.name=arithmetic",
        "task.operand_min=0",
        f"task.operand_max={spec.operand_max}",
        f"task.num_train={spec.num_train}",
        f"task.num_eval={spec.num_eval}",
        "rewards={exact_answer: 1.0}",
        f"rollout.prompts_per_step={spec.prompts_per_step}",
        f"rollout.group_size={spec.group_size}",
        "rollout.max_new_tokens=4",
        "rollout.temperature=1.0",
        # docs/bakeoff.md and docs/paper_reproduction.md were measured without redrawing flat groups (the
        # default run's dynamic sampling): each method's clip and ratio figures over the groups it drew
        "rollout.dynamic_sampling=false",
        f"train.steps={spec.steps}",
        f"train.minibatches={spec.minibatches}",
        "train.max_grad_norm=1.0",
        f"eval.every={spec.eval_every}",
        "eval.max_new_tokens=4",
        f"train.minibatch_split={spec.minibatch_split}",
        f"checkpoint.every={spec.checkpoint_every}",
        # the studies compare clip and ratio metrics over every sample, as docs/bakeoff.md and
        # docs/paper_reproduction.md were measured; skipping zero-advantage samples (the same weights)
        # would leave them over the computed samples only
        "train.skip_zero_advantage=false",
        "report_to=[]",
        "progress=false",
    ]


def cold_start_model(runs_dir: Path) -> Path:
    """Where the cold start's model is saved: every run's model.path."""
    return runs_dir / "cold_start" / "model"


def build_model(spec: Spec, tokenizer: Any, seed: int) -> torch.nn.Module:
    """A randomly initialised Qwen3-MoE: `experts` experts, top-`top_k`, gates renormalised over the k."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=2 * spec.hidden,
        moe_intermediate_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=spec.hidden // 4,
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3MoeForCausalLM(config)
    model.config.use_cache = False
    return model


def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, examples: list[Example]) -> float:
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    rollouts = generate(model, tokenizer, prompts, SamplingParams(4, greedy=True), batch_size=100)
    rewards = exact_answer(prompts, rollouts.completions, answer=[ex.fields["answer"] for ex in examples])
    return sum(rewards) / len(rewards)


@dataclass
class _SftData:
    """The training problems tokenized: chat prompts, and answers closed by EOS (the SFT labels)."""

    prompts: list[list[int]]
    answers: list[list[int]]

    def batch(self, picks: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask and labels (the answer tokens only) of the picked problems (B, T)."""
        rows = [self.prompts[i] + self.answers[i] for i in picks]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad_id)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100)  # loss on the answer only
        for r, i in enumerate(picks):
            n, p = len(rows[r]), len(self.prompts[i])
            input_ids[r, :n] = torch.tensor(rows[r])
            attention[r, :n] = 1
            labels[r, p:n] = torch.tensor(self.answers[i])
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def _sft(spec: Spec, model: torch.nn.Module, tokenizer: Any, train: list[Example]) -> list[dict[str, Any]]:
    """SFT steps (the model's load-balancing loss included) until the greedy accuracy on the first 100
    training problems reaches ``spec.sft_target`` or ``sft_max_steps``; returns the accuracy checks."""
    data = _SftData(
        tokenize_prompts(tokenizer, [format_prompt(tokenizer, ex.prompt) for ex in train]),
        [
            [*tokenizer(ex.fields["answer"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
            for ex in train
        ],
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(0)
    history, step = [], 0
    while True:
        if step % spec.sft_check_every == 0 or step == spec.sft_max_steps:
            model.eval()
            history.append({"step": step, "train_accuracy": greedy_accuracy(model, tokenizer, train[:100])})
            if history[-1]["train_accuracy"] >= spec.sft_target or step == spec.sft_max_steps:
                return history
        model.train()
        picks = torch.randint(len(train), (spec.sft_batch,), generator=generator).tolist()
        loss = model(**data.batch(picks, tokenizer.pad_token_id), output_router_logits=True).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1


def cold_start(spec: Spec, runs_dir: Path) -> dict[str, Any]:
    """The shared cold start, saved to runs_dir/cold_start (made once: a later call reads its record)."""
    out = runs_dir / "cold_start"
    info_path = out / "cold_start.json"
    if info_path.is_file():  # an earlier (interrupted) invocation already made it
        return json.loads(info_path.read_text())
    t0 = time.perf_counter()
    tokenizer = tiny_tokenizer()
    model = build_model(spec, tokenizer, seed=0)
    train_examples, eval_examples = build_examples(load_config(None, [*base_overrides(spec), "seed=0"]))
    history = _sft(spec, model, tokenizer, train_examples)
    model.eval()
    save_model(model, tokenizer, out / "model")
    info = {
        "steps": history[-1]["step"],
        "train_accuracy": history[-1]["train_accuracy"],
        "eval_accuracy": greedy_accuracy(model, tokenizer, eval_examples),
        "history": history,
        "seconds": time.perf_counter() - t0,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    info_path.write_text(json.dumps(info, indent=1))
    return info


def run_overrides(
    spec: Spec, runs_dir: Path, name: str, seed: int, lr: float, method: dict[str, Any]
) -> tuple[str, ...]:
    """One RL run from the cold start, as overrides: the task's, then seed, lr, folder and the method's keys."""
    return (
        *base_overrides(spec),
        f"seed={seed}",
        f"train.lr={lr}",
        f"model.path={cold_start_model(runs_dir)}",
        f"output_dir={runs_dir / name}",
        *(f"{key}={json.dumps(value)}" for key, value in method.items()),
    )
