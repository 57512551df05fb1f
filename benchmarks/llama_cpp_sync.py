"""One rollout batch on the CPU: the in-process sampler vs a llama.cpp server plus a GGUF weight sync.

For each completion length in --tokens, one batch of --prompts x --group-size completions of the default task
(held-out arithmetic prompts) on the embedded SmolLM2, every completion exactly that many tokens long: EOS and
the other special tokens are barred in both engines, so both do the same work. Columns:
- in-process: `HFSampler.generate`, what `gspo train` uses (fp32, batched, KV cache).
- llama.cpp: `OpenAIBackend` against a `LlamaCppServer` of the policy exported as --quant (one request per
  completion: llama-cpp-python's server serves one at a time), and one `GGUFReload` sync (export + restart),
  the cost of every rollout batch with `every=1`, a quarter of it with `every=4`.

    HF_HUB_OFFLINE=1 python benchmarks/llama_cpp_sync.py [--tokens 4 64 256] [--prompts 8 --group-size 8]
        [--quant f16 q8_0] [--threads 2]

On a CPU shared with other jobs, use --threads 1: both engines' OpenMP workers spin-wait at every barrier
and stall when the cores are oversubscribed.

Prints a markdown table (docs/llama_cpp_sync.md holds the measured one).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from gspo.config import load_config
from gspo.models import default_model_file, load_model
from gspo.models.gguf_export import write_gguf
from gspo.rollout.data import format_prompt
from gspo.rollout.llama_cpp import GGUFReload, LlamaCppServer
from gspo.rollout.openai import DEFAULT_SAMPLING, OpenAIBackend
from gspo.rollout.samplers import HFSampler
from gspo.training.inputs import build_examples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--quant", nargs="+", default=["f16"])
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch's and llama.cpp's"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # both engines get the same cores

    config = load_config(None)
    model, tokenizer = load_model(config.model)
    examples = build_examples(config)[1][: args.prompts]
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    barred = sorted(tokenizer.added_tokens_decoder)  # EOS and every other special token
    # in-process: bar them with -inf logits at the LM head (samplers.py itself is untouched)
    model.lm_head.register_forward_hook(
        lambda module, inputs, out: out.index_fill_(-1, torch.tensor(barred), -1e9)
    )
    sampler = HFSampler(model, tokenizer, batch_size=args.prompts * args.group_size)
    n = args.prompts * args.group_size
    print(
        f"# {args.prompts} prompts x {args.group_size} = {n} completions per rollout batch; torch threads "
        f"{torch.get_num_threads()}, llama.cpp threads {args.threads}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for quant in args.quant:
            first = write_gguf(
                model, tokenizer, Path(work) / "initial.gguf", quant=quant, source=default_model_file()
            )
            with LlamaCppServer(first, n_ctx=1024, threads=args.threads) as server:
                sync = GGUFReload(server, Path(work) / "sync", quant=quant, source=default_model_file())
                backend = OpenAIBackend(
                    server.url,
                    tokenizer,
                    max_concurrency=1,
                    timeout=3600,
                    misaligned="resample",
                    sampling={**DEFAULT_SAMPLING, "logit_bias": {str(i): -1e9 for i in barred}},
                )
                for tokens in args.tokens:
                    timings = {}
                    if quant == args.quant[0]:
                        start = time.perf_counter()
                        ours = sampler.generate(prompts, group_size=args.group_size, max_new_tokens=tokens)
                        timings["hf"] = time.perf_counter() - start
                        assert all(len(c) == tokens for c in ours.completion_ids)
                    start = time.perf_counter()
                    theirs = backend.generate(
                        prompts, group_size=args.group_size, max_new_tokens=tokens, seed=0
                    )
                    timings["llama"] = time.perf_counter() - start
                    timings["llama_tokens"] = sum(len(c) for c in theirs.completion_ids) / n  # mean length
                    sync(model, tokenizer, 1)
                    timings["sync"] = sync.seconds[-1]
                    rows.append((quant, tokens, timings))
                    print(
                        f"# {quant} {tokens} tokens: {timings} (resampled so far: {backend.resampled})",
                        flush=True,
                    )
    hf = {tokens: t["hf"] for q, tokens, t in rows if "hf" in t}
    print(
        "\n| new tokens | in-process (fp32) | llama.cpp | generation (mean length; tok/s) | sync (export + restart) | sync every step | sync every 4 steps |"
    )
    print("|---|---|---|---|---|---|---|")
    for quant, tokens, t in rows:
        every1, every4 = t["llama"] + t["sync"], t["llama"] + t["sync"] / 4
        print(
            f"| {tokens} | {hf[tokens]:.1f} s ({n * tokens / hf[tokens]:.0f} tok/s) | {quant} | {t['llama']:.1f} s "
            f"({t['llama_tokens']:.1f}; {n * t['llama_tokens'] / t['llama']:.0f} tok/s) | {t['sync']:.1f} s | {every1:.1f} s ({every1 / hf[tokens]:.1f}x) "
            f"| {every4:.1f} s ({every4 / hf[tokens]:.1f}x) |"
        )


if __name__ == "__main__":
    main()
