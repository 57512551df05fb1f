"""vLLM's log-probs against the trainer's, fp32 and bf16: the mismatch `train.old_logprobs=sampler` would see.

On the default task's training prompts (SmolLM2-135M-Instruct), vLLM in this process (gspo's own
`rollout.engine=vllm` sampler, gspo.rollout.vllm_engine.VLLMSampler) draws --group-size samples of each
prompt at temperature 1, at each --max-new-tokens setting (the default task's 4, and a longer one so that
lengths vary), once computing in fp32 and once in bf16 (vLLM's weights in bf16, as on GPUs). The trainer
then scores the sampled tokens with gspo.core.logprobs.causal_lm_logprobs, as its old-policy pass does: in
fp32, under bf16 autocast over the fp32 weights (`train.mixed_precision=bf16`), and with its weights in
bf16 (`model.dtype=bfloat16`). For each pair the ratios from the mismatch alone are

    token      r_t = exp(log pi_trainer(y_t) - log pi_vllm(y_t))
    sequence   s_i = exp((1/|y_i|) sum_t log r_t)            (GSPO's length-normalised ratio)

and the script prints their |log ratio| quantiles, std, mean, and the share outside GSPO's clip band
[1 - 3e-4, 1 + 4e-4] and GRPO's [1 - 0.2, 1 + 0.27] (benchmarks/sampler_mismatch.py's `describe`). vLLM
reports the EOS token's log-prob too, so every sampled token counts.

Run in the vLLM venv (scripts/setup.sh vllm; about 10 minutes on one core; docs/vllm.md holds the figures):
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_mismatch.py \
        [--prompts 32] [--group-size 8] [--max-new-tokens 4 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time

import torch
from sampler_mismatch import describe  # benchmarks/, the script's own folder

from gspo.config import load_config
from gspo.core.layout import TokenSequence, make_micro_batches
from gspo.core.logprobs import causal_lm_logprobs
from gspo.models import load_model
from gspo.rollout.data import format_prompt
from gspo.rollout.samplers import Rollouts
from gspo.rollout.vllm_engine import VLLMSampler
from gspo.training.inputs import build_examples

VLLM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAINERS = {"fp32": (torch.float32, None), "bf16 autocast": (torch.float32, torch.bfloat16)}
TRAINERS["bf16 weights"] = (torch.bfloat16, None)
"""The trainer's (weights, autocast): fp32; bf16 autocast over the fp32 weights (train.mixed_precision=bf16);
the weights in bf16 (model.dtype=bfloat16, which also starts vLLM in bf16)."""


def sample(model, tokenizer, dtype: torch.dtype, prompts, args) -> dict[int, Rollouts]:
    """One vLLM engine in `dtype` (its weights the policy's, cast), its samples at each length setting."""
    policy = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    sampler = VLLMSampler(policy, tokenizer, max_num_seqs=args.batch * args.group_size, seed=args.seed)
    out = {}
    for n in args.max_new_tokens:
        out[n] = Rollouts([], [], [], [], [])
        # rollout batches of the training run's size, each its own seed
        for b in range(0, len(prompts), args.batch):
            batch = sampler.generate(
                prompts[b : b + args.batch], group_size=args.group_size, max_new_tokens=n, seed=args.seed + b
            )
            for column in ("prompt_ids", "completion_ids", "sampler_logprobs", "truncated", "completions"):
                getattr(out[n], column).extend(getattr(batch, column))
    del sampler, policy  # the next dtype's engine replaces it
    gc.collect()
    return out


def score(model, rollouts: Rollouts, autocast: torch.dtype | None) -> list[torch.Tensor]:
    """The trainer's log-probs of each completion's tokens, as its old-policy pass computes them."""
    sequences = [
        TokenSequence(p, c, [True] * len(c))
        for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)
    ]
    out = [torch.empty(0)] * len(sequences)
    batches = make_micro_batches(
        sequences, layout="padded", pack_length=1024, micro_batch_tokens=4096, pad_id=0
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        for mb in batches:
            logp = causal_lm_logprobs(
                model,
                mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                logprob_mask=mb.logprob_mask,
            )
            for row, i in enumerate(mb.indices):
                out[i] = logp[row][mb.logprob_mask[row]].float()
    return out


def compare(trainer: list[torch.Tensor], rollouts: Rollouts) -> dict:
    deltas = [t - torch.tensor(v) for t, v in zip(trainer, rollouts.sampler_logprobs, strict=True)]
    lengths = [len(d) for d in deltas]
    return {
        "token": describe(torch.cat(deltas)),
        "sequence": describe(torch.stack([d.mean() for d in deltas])),
        "length_mean": statistics.mean(lengths),
        "length_min": min(lengths),
        "length_max": max(lengths),
        "truncated": sum(rollouts.truncated) / len(lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=32, help="training prompts (default task: 8 a step)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="prompts per rollout batch (the default task's)")
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--vllm-dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(VLLM_DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()

    config = load_config(None)
    model, tokenizer = load_model(config.model)
    model.eval()
    examples = build_examples(config)[0][: args.prompts]
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    models = {torch.float32: model, torch.bfloat16: copy.deepcopy(model).to(torch.bfloat16)}
    results = []
    for vllm_name in args.vllm_dtypes:
        start = time.perf_counter()
        samples = sample(model, tokenizer, VLLM_DTYPES[vllm_name], prompts, args)
        print(f"# vLLM {vllm_name}: sampled in {time.perf_counter() - start:.0f} s", flush=True)
        for new_tokens, rollouts in samples.items():
            for trainer_name, (weights, autocast) in TRAINERS.items():
                row = compare(score(models[weights], rollouts, autocast), rollouts)
                row.update(vllm=vllm_name, trainer=trainer_name, max_new_tokens=new_tokens)
                results.append(row)
                print(f"# {row}", flush=True)

    print(
        f"\n{args.prompts} training prompts of the default task x {args.group_size} samples, temperature 1, "
        f"seed {args.seed}; torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n"
    )
    print(
        "| max new tokens (mean length) | vLLM | trainer | ratio | n | mean abs log-ratio | median | p99 | max "
        "| mean | outside GSPO band | outside GRPO band |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        for level in ("token", "sequence"):
            d = row[level]
            print(
                f"| {row['max_new_tokens']} ({row['length_mean']:.1f}) | {row['vllm']} | {row['trainer']} | {level} | "
                f"{d['n']} | {d['abs_mean']:.1e} | {d['abs_p50']:.1e} | {d['abs_p99']:.1e} | {d['abs_max']:.1e} | "
                f"{d['mean']:+.1e} | {d['outside_gspo_band']:.1%} | {d['outside_grpo_band']:.1%} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
