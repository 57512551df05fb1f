"""The update phase on a GPU, side by side: gspo, TRL's GRPOTrainer loss path, Liger-Kernel's fused GRPO loss.

One rollout batch's update phase (the old-policy pass, then K minibatch updates: forward, backward, AdamW)
on models built from real configurations with random weights (no download): SmolLM2-135M, Qwen2.5-0.5B and
-1.5B (dense), a small Qwen3-MoE; at several completion lengths; bf16 autocast with fp32 master weights
(fp32 on a CPU). Per row: tokens/s (prompt + completion tokens of every sequence over the phase's time),
MFU (model FLOPs over time over the measured bf16 matmul peak), peak memory (weights, gradients and AdamW
state included). The batch: P prompts of --prompt-len tokens x G completions, completion lengths drawn
uniformly in [L/2, L] (seeded), random token ids and advantages (the cost does not depend on them).

Systems, the same batch, model, weights, optimizer and K:
- gspo: `gspo.learning.learner.learn`, GSPO, shared-prefix rows (a group's prompt once), whole-group
  minibatches, micro-batches of --micro-tokens tokens; once per log-prob kernel (--kernels).
- trl: TRL's own GRPOTrainer (importance_sampling_level="sequence", loss_type="grpo", beta=0) built on the
  model; the old-policy pass is its `_get_per_token_logps_and_entropies`, each micro-batch's loss its
  `compute_loss`, then our backward, clipping and AdamW step (TRL's training loop is not timed: no
  generation, no rewards). One right-padded row per sequence, the prompt in every row, as TRL lays it out.
- liger: Liger-Kernel's LigerFusedLinearGRPOLoss (loss_type="grpo", importance_sampling_level="sequence")
  on the decoder's hidden states of the same padded rows; its old-policy pass uses Liger's own chunked
  log-prob function (LigerFusedLinearPPOBase.chunk_forward).
A system whose package is missing prints a "not installed" row; docs/gpu.md says how to carry the wheels.

MFU counts model FLOPs: per sequence of T tokens (prompt + completion, every sequence whole, as TRL computes
it), forward = 2 N_active T + 2 layers heads head_dim T^2 (causal attention) + 2 H V (completion tokens);
the phase is 4 forwards' worth (1 for the old-policy pass, 3 for an update's forward and backward). What
gspo's prompt sharing skips is counted too, so its MFU is an effective figure.

--head: the log-prob + loss path alone on (N, H) hidden states: gspo (torch, triton), Liger's fused
linear loss, and the naive full-logits path: time and peak memory of forward + backward.

Run:  python benchmarks/gpu.py [--models ...] [--lengths ...] [--out results.jsonl]
      python benchmarks/gpu.py --device cpu --small        # the CPU smoke run (tests/test_gpu_benchmark.py)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from gspo.core.layout import TokenSequence
from gspo.core.logprobs import token_logprobs
from gspo.core.objectives import PAPER_CLIP, LossInputs, LossSpec, compute_loss
from gspo.learning.batch import Batch
from gspo.learning.learner import learn
from gspo.learning.policy import Policy, UpdateSpec
from gspo.models.loading import tiny_tokenizer
from gspo.parallel.wrap import LogprobScorer

G = 8  # completions per prompt


# ---- models -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    family: str  # "llama", "qwen2", "qwen3" or "qwen3_moe"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int | None = None
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0

    def config(self) -> transformers.PretrainedConfig:
        common = dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=2,
            pad_token_id=0,
            attn_implementation="sdpa",
        )
        if self.family == "llama":
            return transformers.LlamaConfig(**common, rope_theta=100000.0)
        if self.family == "qwen2":
            return transformers.Qwen2Config(**common, use_sliding_window=False, sliding_window=None)
        if self.family == "qwen3":
            return transformers.Qwen3Config(**common, head_dim=self.head_dim, sliding_window=None)
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=self.head_dim,
            num_experts=self.experts,
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.moe_intermediate,
            sliding_window=None,
        )

    def forward_flops(self, tokens: int, scored: int) -> float:
        """Model FLOPs of one forward over a sequence of `tokens` tokens, `scored` of them through the head."""
        head_dim = self.head_dim or self.hidden // self.heads
        attention = 2 * self.hidden * head_dim * (self.heads + self.kv_heads)  # q, o; k, v
        if self.experts:
            mlp = 3 * self.hidden * self.moe_intermediate * self.top_k + self.hidden * self.experts
        else:
            mlp = 3 * self.hidden * self.intermediate
        linear = 2 * self.layers * (attention + mlp) * tokens
        causal = 2 * self.layers * self.heads * head_dim * tokens**2  # QK^T and AV, half the square each
        return linear + causal + 2 * self.hidden * self.vocab * scored


MODELS = {
    # HuggingFaceTB/SmolLM2-135M's configuration
    "smollm2-135m": ModelSpec("llama", 49152, 576, 30, 9, 3, 1536),
    # Qwen/Qwen2.5-0.5B's and -1.5B's configurations (q/k/v biases included by the Qwen2 class)
    "qwen2.5-0.5b": ModelSpec("qwen2", 151936, 896, 24, 14, 2, 4864),
    "qwen2.5-1.5b": ModelSpec("qwen2", 151936, 1536, 28, 12, 2, 8960),
    # Qwen/Qwen3-0.6B's configuration (its head_dim of 128 is not hidden / heads)
    "qwen3-0.6b": ModelSpec("qwen3", 151936, 1024, 28, 16, 8, 3072, head_dim=128),
    # a small Qwen3-MoE: Qwen3-30B-A3B's shape (128 experts, top 8) scaled down to 0.6B total, 0.25B active
    "qwen3-moe-small": ModelSpec("qwen3_moe", 151936, 1024, 12, 16, 4, 3072, 64, 32, 4, 512),
}
SMALL_MODELS = {
    "tiny-llama": ModelSpec("llama", 512, 64, 2, 4, 2, 128),
    "tiny-moe": ModelSpec("qwen3_moe", 512, 64, 2, 4, 2, 128, 16, 8, 2, 32),
}


def build_model(spec: ModelSpec, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """Random fp32 weights, built directly on ``device``, in eval mode (no dropout)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(spec.config(), dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


# ---- the batch ----------------------------------------------------------------------------------------
def make_batch(spec: ModelSpec, prompts: int, prompt_len: int, length: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    sequences, groups = [], []
    for group in range(prompts):
        prompt = torch.randint(3, spec.vocab, (prompt_len,), generator=g).tolist()
        for _ in range(G):
            n = int(torch.randint(length // 2, length + 1, (), generator=g))
            completion = torch.randint(3, spec.vocab, (n,), generator=g).tolist()
            sequences.append(TokenSequence(prompt, completion, [True] * n))
            groups.append(group)
    advantages = torch.randn(len(sequences), generator=g)
    return Batch(sequences, advantages, [[math.nan] * len(s.completion_ids) for s in sequences], groups)


def padded(batch: Batch, ids: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """TRL's layout of the sequences `ids`: prompts (all of one length here) then right-padded completions."""
    width = max(len(batch.sequences[i].completion_ids) for i in ids)
    completion = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for row, i in enumerate(ids):
        c = batch.sequences[i].completion_ids
        completion[row, : len(c)] = torch.tensor(c)
        mask[row, : len(c)] = 1
    prompt = torch.tensor([batch.sequences[i].prompt_ids for i in ids])
    return {
        "prompt_ids": prompt.to(device),
        "prompt_mask": torch.ones_like(prompt).to(device),
        "completion_ids": completion.to(device),
        "completion_mask": mask.to(device),
        "advantages": batch.advantages[ids].to(device),
    }


def split(n: int, parts: int, seed: int) -> list[list[int]]:
    """A seeded shuffle of range(n) in `parts` near-equal minibatches (TRL and Liger: samples, not groups)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[k::parts] for k in range(parts)]


# ---- measuring ----------------------------------------------------------------------------------------
@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype | None  # autocast dtype (bf16 on CUDA), None: fp32
    minibatches: int
    micro_tokens: int
    eps: tuple[float, float]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """Best FLOP/s of a random square matmul in `dtype` (METHOD.md: random data, warm-up, events)."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    a @ b
    sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # gspo's own optimizer (gspo.training.inputs), for every system: the loss path is what differs
    return torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0, fused=True)


def clip_and_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def autocast(setup: Setup) -> contextlib.AbstractContextManager:
    return torch.autocast(setup.device.type, dtype=setup.dtype, enabled=setup.dtype is not None)


def run_gspo(model, batch: Batch, setup: Setup, kernel: str, pad_len: int) -> Callable[[int], None]:
    policy = Policy(
        model,
        (opt := optimizer(model)),
        torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
        scorer=LogprobScorer(model, setup.dtype) if setup.dtype is not None else model,
        compute_dtype=setup.dtype,
    )
    spec = UpdateSpec(
        LossSpec("gspo", eps_low=setup.eps[0], eps_high=setup.eps[1]),
        minibatches=setup.minibatches,
        minibatch_split="group",
        layout="shared_prefix",
        pack_length=max(pad_len, setup.micro_tokens),
        micro_batch_tokens=setup.micro_tokens,
        logprob_kernel=kernel,
        old_logprobs="recompute",
    )
    return lambda seed: learn(policy, spec, batch, seed=seed)


def run_trl(model, batch: Batch, setup: Setup, workdir: Path) -> Callable[[int], None]:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    rows = max(1, setup.micro_tokens // max(len(s) for s in batch.sequences))  # sequences per micro-batch
    with warnings.catch_warnings():  # TRL's and transformers' deprecation notices are not ours to fix
        warnings.simplefilter("ignore", FutureWarning)
        args = GRPOConfig(
            output_dir=str(workdir),
            per_device_train_batch_size=G,
            num_generations=G,
            importance_sampling_level="sequence",
            loss_type="grpo",
            epsilon=setup.eps[0],
            epsilon_high=setup.eps[1],
            beta=0.0,
            bf16=setup.dtype is not None,
            use_cpu=setup.device.type == "cpu",
            report_to="none",
            disable_dropout=True,
            max_completion_length=max(len(s.completion_ids) for s in batch.sequences),
            logging_steps=10**9,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": ["x"] * G}),
            processing_class=tiny_tokenizer(),
        )
    model = trainer.model
    model.train()  # TRL trains in train mode (its loss reads model.training); dropout is off
    opt = optimizer(model)
    n = len(batch.sequences)

    def phase(seed: int) -> None:
        with torch.no_grad():  # the old-policy pass, micro-batch by micro-batch (TRL's own chunking)
            inputs = padded(batch, list(range(n)), setup.device)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            old, _, _ = trainer._get_per_token_logps_and_entropies(
                model, ids, mask, inputs["completion_ids"].size(1), batch_size=rows
            )
        for mini in split(n, setup.minibatches, seed):
            micro = [mini[k : k + rows] for k in range(0, len(mini), rows)]
            trainer.current_gradient_accumulation_steps = len(micro)
            for part in micro:
                inputs = padded(batch, part, setup.device)
                width = inputs["completion_ids"].size(1)
                inputs["old_per_token_logps"] = old[part, :width]
                trainer.compute_loss(model, inputs).backward()
            clip_and_step(model, opt)

    return phase


def run_liger(model, batch: Batch, setup: Setup) -> Callable[[int], None]:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.0,
        use_ref_model=False,
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon_low=setup.eps[0],
        epsilon_high=setup.eps[1],
        compiled=setup.device.type == "cuda",
    )
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    rows = max(1, setup.micro_tokens // max(len(s) for s in batch.sequences))
    opt = optimizer(model)
    n = len(batch.sequences)

    def hidden_states(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, Lc, H): the hidden state that predicts each completion token."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        out = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        width = inputs["completion_ids"].size(1)
        return out[:, -width - 1 : -1]

    def phase(seed: int) -> None:
        width = max(len(s.completion_ids) for s in batch.sequences)
        old = torch.zeros(n, width, device=setup.device)  # (n, Lc), right-padded like the rows
        with torch.no_grad(), autocast(setup):
            for k in range(0, n, rows):
                part = list(range(k, min(k + rows, n)))
                inputs = padded(batch, part, setup.device)
                logp = LigerFusedLinearPPOBase.chunk_forward(
                    hidden_states(inputs), head.weight, inputs["completion_ids"], bias=head.bias
                )
                old[part, : logp.size(1)] = logp.float()
        for mini in split(n, setup.minibatches, seed):
            micro = [mini[k : k + rows] for k in range(0, len(mini), rows)]
            for part in micro:
                inputs = padded(batch, part, setup.device)
                width = inputs["completion_ids"].size(1)
                with autocast(setup):
                    loss, _ = loss_fn(
                        hidden_states(inputs),
                        head.weight,
                        inputs["completion_ids"],
                        inputs["completion_mask"],
                        inputs["advantages"],
                        bias=head.bias,
                        old_per_token_logps=old[part, :width],
                    )
                # Liger's "grpo" averages over the micro-batch's sequences: weight it by its share
                (loss * len(part) / len(mini)).backward()
            clip_and_step(model, opt)

    return phase


SYSTEMS = {"trl": ("trl", "datasets"), "liger": ("liger_kernel",)}


def measure(
    make: Callable[[], Callable[[int], None]], setup: Setup, warmup: int, repeats: int, profile: bool = False
) -> dict[str, Any]:
    """Median seconds of `repeats` phases after `warmup` ones, and the peak memory (CUDA); with `profile`,
    one more phase under torch.profiler, whose top operators by device time are printed."""
    device = setup.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    phase = make()
    for k in range(warmup):
        phase(1000 + k)
    times = []
    for k in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        phase(k)
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            phase(repeats)
            sync(device)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=15), flush=True)
    return {"seconds": statistics.median(times), "peak_gib": peak}


def row_for(name: str, spec: ModelSpec, length: int, batch: Batch, setup: Setup, args, peak_flops: float):
    tokens = sum(len(s) for s in batch.sequences)
    flops = 4 * sum(spec.forward_flops(len(s), len(s.completion_ids)) for s in batch.sequences)
    base = {"model": args.model_name, "length": length, "system": name, "tokens": tokens}
    system = name.split(":")[0]
    missing = [m for m in SYSTEMS.get(system, ()) if importlib.util.find_spec(m) is None]
    if missing:
        return {**base, "note": f"not installed ({', '.join(missing)}: see docs/gpu.md)"}
    pad_len = max(len(s) for s in batch.sequences)

    def make():
        model = build_model(spec, setup.device)
        if system == "gspo":
            return run_gspo(model, batch, setup, name.split(":")[1], pad_len)
        if system == "trl":
            return run_trl(model, batch, setup, Path(args.workdir))
        return run_liger(model, batch, setup)

    try:
        result = measure(make, setup, args.warmup, args.repeats, profile=args.profile and system == "gspo")
    except torch.cuda.OutOfMemoryError:
        return {**base, "note": "out of memory"}
    except Exception as error:  # one system failing must not lose the others' figures
        traceback.print_exc(file=sys.stderr)
        return {**base, "note": f"failed: {type(error).__name__}: {str(error)[:120]}"}
    finally:
        gc.collect()
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        **base,
        "seconds": result["seconds"],
        "tokens_per_s": tokens / result["seconds"],
        "mfu": flops / result["seconds"] / peak_flops,
        "peak_gib": result["peak_gib"],
    }


# ---- the head alone -----------------------------------------------------------------------------------
def head_rows(spec: ModelSpec, n: int, setup: Setup, kernels: list[str], name: str) -> list[dict[str, Any]]:
    """Forward + backward of log-probs and a GSPO loss from (n, H) hidden states, each path alone."""
    device = setup.device
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(spec.vocab, spec.hidden, generator=g) * 0.02).to(device).requires_grad_()
    targets = torch.randint(0, spec.vocab, (n,), generator=g).to(device)
    hidden0 = torch.randn(n, spec.hidden, generator=g).to(device)
    seqs = 8
    segment = torch.arange(n, device=device) * seqs // n  # 8 sequences of n/8 tokens
    advantages = torch.randn(seqs, generator=g).to(device)
    old = -torch.rand(n, generator=g).to(device) * 5

    spec = LossSpec("gspo", eps_low=setup.eps[0], eps_high=setup.eps[1])

    def gspo_loss(logp):
        return compute_loss(spec, LossInputs(logp, old, advantages, segment, seqs))[0]

    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        f"gspo:{k}": (lambda h, k=k: gspo_loss(token_logprobs(h, weight, targets, kernel=k))) for k in kernels
    }
    paths["naive"] = lambda h: gspo_loss(
        torch.log_softmax((h @ weight.T).float(), -1).gather(1, targets[:, None]).squeeze(1)
    )
    if importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(
            beta=0.0,
            use_ref_model=False,
            loss_type="grpo",
            importance_sampling_level="sequence",
            epsilon_low=setup.eps[0],
            epsilon_high=setup.eps[1],
            compiled=device.type == "cuda",
        )
        shape = (seqs, n // seqs)
        paths["liger"] = lambda h: liger(
            h[: seqs * shape[1]].view(*shape, -1),
            weight,
            targets[: seqs * shape[1]].view(shape),
            torch.ones(shape, device=device),
            advantages,
            old_per_token_logps=old[: seqs * shape[1]].view(shape),
        )[0]
    rows = []
    for path, fn in paths.items():
        hidden = hidden0.clone().requires_grad_()
        try:
            for _ in range(2):  # the first one warms up (compilation, allocator)
                sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                t0 = time.perf_counter()
                with autocast(setup):
                    loss = fn(hidden)
                loss.backward()
                sync(device)
                seconds = time.perf_counter() - t0
                weight.grad = hidden.grad = None
            peak = (
                (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else None
            )
            rows.append({"model": name, "tokens": n, "path": path, "seconds": seconds, "extra_gib": peak})
        except torch.cuda.OutOfMemoryError:
            rows.append({"model": name, "tokens": n, "path": path, "note": "out of memory"})
        except Exception as error:  # one path's failure (a peer's compiled kernel) loses only its row
            rows.append({"model": name, "tokens": n, "path": path, "note": f"failed: {type(error).__name__}"})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- the run ------------------------------------------------------------------------------------------
def fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def versions() -> str:
    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    for package in ("triton", "trl", "liger_kernel"):
        if importlib.util.find_spec(package) is not None:
            from importlib.metadata import version

            parts.append(f"{package} {version(package.replace('_', '-'))}")
        else:
            parts.append(f"{package} not installed")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny models and lengths (the CPU smoke run)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument(
        "--lengths", help="comma-separated completion lengths (default 256,512,1024,2048,4096)"
    )
    parser.add_argument("--systems", default="gspo,trl,liger", help="comma-separated, of gspo, trl, liger")
    parser.add_argument(
        "--kernels", help="gspo's log-prob kernels (default: torch,triton on CUDA, torch else)"
    )
    parser.add_argument("--tokens", type=int, default=65536, help="completion tokens per batch (at least")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--minibatches", type=int, default=4, help="K, optimizer updates per batch")
    parser.add_argument("--micro-tokens", type=int, default=16384, help="tokens per forward/backward")
    parser.add_argument("--warmup", type=int, default=1, help="phases before timing")
    parser.add_argument("--repeats", type=int, default=2, help="timed phases (the median is reported)")
    parser.add_argument("--head", action="store_true", help="also the log-prob + loss path alone")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="start no new row after this")
    parser.add_argument("--out", help="append every row to this JSON-lines file as it completes")
    parser.add_argument("--profile", action="store_true", help="print gspo's top operators per row")
    args = parser.parse_args()

    device = torch.device(args.device)
    models = SMALL_MODELS if args.small else MODELS
    names = args.models.split(",") if args.models else list(models)
    if args.small:  # seconds on a CPU: one short length, one timed phase, no warm-up
        lengths = [int(x) for x in (args.lengths or "16").split(",")]
        args.prompt_len, args.tokens, args.micro_tokens = min(args.prompt_len, 8), min(args.tokens, 128), 256
        args.minibatches, args.warmup, args.repeats = min(args.minibatches, 2), 0, 1
    else:
        lengths = [int(x) for x in (args.lengths or "256,512,1024,2048,4096").split(",")]
    kernels = (args.kernels or ("torch,triton" if device.type == "cuda" else "torch")).split(",")
    systems = args.systems.split(",")
    dtype = torch.bfloat16 if device.type == "cuda" else None
    setup = Setup(device, dtype, args.minibatches, args.micro_tokens, PAPER_CLIP["gspo"])
    peak = matmul_peak(device, dtype or torch.float32, 8192 if device.type == "cuda" else 512)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# {gpu}; {versions()}")
    print(
        f"# {'bf16 autocast, fp32 master weights' if dtype else 'fp32'}; matmul peak {peak / 1e12:.3g} TFLOP/s "
        f"({dtype or torch.float32}, measured); G={G}, prompt {args.prompt_len} tokens, K={args.minibatches}, "
        f"{args.micro_tokens} tokens per micro-batch",
        flush=True,
    )
    header = f"{'model':<16} {'L':>5} {'system':<13} {'tokens':>7} {'s':>7} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>8}  note"
    print(header)
    print("-" * len(header), flush=True)
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        for name in names:
            spec = models[name]
            args.model_name = name
            for length in lengths:
                prompts = max(args.minibatches, round(args.tokens / (G * length * 0.75)))
                batch = make_batch(spec, prompts, args.prompt_len, length, seed=length)
                for system in systems:
                    for variant in [f"gspo:{k}" for k in kernels] if system == "gspo" else [system]:
                        if time.perf_counter() - start > args.budget_s:
                            print(f"# --budget-s {args.budget_s:.0f} reached: stopping", flush=True)
                            return
                        row = row_for(variant, spec, length, batch, setup, args, peak)
                        rows.append(row)
                        print(
                            f"{name:<16} {length:>5} {variant:<13} {row['tokens']:>7} {fmt(row.get('seconds'), '7.2f')} "
                            f"{fmt(row.get('tokens_per_s'), '9.0f')} {fmt(row.get('mfu'), '6.1%')} "
                            f"{fmt(row.get('peak_gib'), '8.2f', 'n/a')}  {row.get('note', '')}",
                            flush=True,
                        )
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps({**row, "device": gpu}) + "\n")
            if args.head:
                n = args.micro_tokens
                for hrow in head_rows(spec, n, setup, kernels, name):
                    print(
                        f"head {name:<16} N={n:<6} {hrow['path']:<13} {fmt(hrow.get('seconds'), '8.4f')} s "
                        f"{fmt(hrow.get('extra_gib'), '7.2f', 'n/a')} GiB above inputs  {hrow.get('note', '')}",
                        flush=True,
                    )
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps({**hrow, "kind": "head", "device": gpu}) + "\n")
    summary(rows)
    print(f"# {len(rows)} rows in {time.perf_counter() - start:.0f} s", flush=True)


def summary(rows: list[dict[str, Any]]) -> None:
    """Per model and length: gspo's faster kernel against TRL and Liger (the issue's goals)."""
    keys = sorted({(r["model"], r["length"]) for r in rows}, key=lambda k: (k[0], k[1]))
    print("\nsummary: gspo (its faster kernel) against the others on the same batch")
    for model, length in keys:
        mine = [r for r in rows if (r["model"], r["length"]) == (model, length) and "tokens_per_s" in r]
        ours = max(
            (r for r in mine if r["system"].startswith("gspo")), key=lambda r: r["tokens_per_s"], default=None
        )
        if ours is None:
            continue
        parts = [
            f"{model} L={length}: {ours['system']} {ours['tokens_per_s']:.0f} tokens/s, MFU {ours['mfu']:.1%}"
        ]
        for other in ("trl", "liger"):
            theirs = next((r for r in mine if r["system"] == other), None)
            if theirs is None:
                continue
            part = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x {other}'s tokens/s"
            if ours["peak_gib"] is not None and theirs["peak_gib"]:
                part += f", {ours['peak_gib'] / theirs['peak_gib']:.2f}x its peak memory"
            parts.append(part)
        print("  " + "; ".join(parts))


if __name__ == "__main__":
    main()
