"""Which reasoning-gym task can SmolLM2 learn? The untrained model's held-out scores on candidate tasks.

A task suits a short RL run when the untrained model scores above zero (some groups hold a right answer to
learn from) and well below half (room to improve), and its sampled completions differ in score within a
group (GSPO's advantages are zero otherwise). For each candidate (a reasoning-gym dataset and settings) this
script builds the held-out split exactly as `gspo train` does (task.name=reasoning_gym, task.seed) and
prints one table row:

  greedy    mean `reasoning_gym` score of the greedy completions (what the run's eval accuracy starts at)
  exact     share of greedy completions scoring 1.0
  some      share of greedy completions scoring above 0 (the answer at least inside the last line: most
            datasets' scorers give len(reference) / len(text) then, so a format fix alone may raise these)
  mean@K    mean score of K completions per problem sampled at temperature 1 (what training samples)
  spread    share of problems whose K sampled scores are not all equal (groups with a learning signal)
  tokens    mean completion length (greedy), and the share cut at max_new_tokens
  s         seconds for the candidate (greedy + sampled)

Run (1 thread, the machine is shared):
  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/choose_reasoning_task.py --max-new-tokens 128 \\
      --num-eval 40 --samples 4 [--candidate 'chain_sum' --candidate 'chain_sum:{max_terms: 3}' ...] \\
      [--output candidates.json]
A candidate is `dataset` or `dataset:{yaml mapping of its settings}`; without --candidate a built-in list runs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch
import yaml

from gspo.config import load_config
from gspo.models import load_model
from gspo.rewards.builtins import reasoning_gym
from gspo.rollout.samplers import HFSampler
from gspo.training.evaluation import evaluate
from gspo.training.inputs import build_examples

# Simple, arithmetic-like or short-answer tasks a 135M model might get right now and then.
CANDIDATES = (
    "chain_sum:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
    "chain_sum:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    "chain_sum:{min_terms: 2, max_terms: 3, min_digits: 1, max_digits: 1}",
    "basic_arithmetic:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ['+', '-', '*']}",
    "leg_counting:{min_animals: 1, max_animals: 2, max_instances: 3}",
    "letter_counting:{min_words: 3, max_words: 5}",
    "number_sorting:{min_numbers: 3, max_numbers: 3, max_decimals: 0, min_value: 0, max_value: 99}",
    "spell_backward:{min_word_len: 3, max_word_len: 4}",
    "word_sequence_reversal:{min_words: 3, max_words: 3}",
    "gcd:{max_value: 30}",
    "aiw",
    "syllogism",
)


@dataclass
class Row:
    candidate: str
    greedy: float
    exact: float
    some: float
    mean_at_k: float
    spread: float
    tokens: float
    truncated: float
    seconds: float


def parse_candidate(text: str) -> tuple[str, dict]:
    """'chain_sum:{max_terms: 3}' -> ('chain_sum', {'max_terms': 3})."""
    name, _, settings = text.partition(":")
    return name.strip(), (yaml.safe_load(settings) if settings.strip() else {}) or {}


def measure(sampler: HFSampler, candidate: str, args: argparse.Namespace) -> Row:
    dataset, settings = parse_candidate(candidate)
    config = load_config(
        None,
        [
            "task.name=reasoning_gym",
            f"task.dataset={dataset}",
            f"task.dataset_config={json.dumps(settings)}",
            f"task.num_eval={args.num_eval}",
            f"task.num_train={args.num_train}",
            f"task.seed={args.task_seed}",
        ],
    )
    system_prompt = args.system_prompt
    held_out = build_examples(config)[1]
    rewards = [("reasoning_gym", reasoning_gym, 1.0)]
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    greedy = evaluate(
        sampler, held_out, rewards, max_new_tokens=args.max_new_tokens, system_prompt=system_prompt
    )
    sampled = evaluate(
        sampler,
        held_out,
        rewards,
        max_new_tokens=args.max_new_tokens,
        system_prompt=system_prompt,
        samples=args.samples,
    )
    scores = [p["rewards"]["reasoning_gym"] for p in greedy.problems]
    lengths = [n for p in greedy.problems for n in p["completion_tokens"]]
    groups = [p["rewards"]["reasoning_gym"] for p in sampled.problems]
    return Row(
        candidate=candidate,
        greedy=greedy.metrics["accuracy"],
        exact=sum(s[0] == 1.0 for s in scores) / len(scores),
        some=sum(s[0] > 0 for s in scores) / len(scores),
        mean_at_k=sampled.metrics[f"mean@{args.samples}"],
        spread=sum(len(set(g)) > 1 for g in groups) / len(groups),
        tokens=sum(lengths) / len(lengths),
        truncated=sum(n >= args.max_new_tokens for n in lengths) / len(lengths),
        seconds=time.perf_counter() - t0,
    )


def table(rows: list[Row], samples: int) -> str:
    lines = [
        f"| candidate | greedy | exact | some | mean@{samples} | spread | tokens (cut) | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.candidate}` | {r.greedy:.3f} | {r.exact:.2f} | {r.some:.2f} | {r.mean_at_k:.3f} | {r.spread:.2f} | "
            f"{r.tokens:.0f} ({r.truncated:.0%}) | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--candidate", action="append", help="dataset or 'dataset:{settings}' (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-eval", type=int, default=40, help="held-out problems per candidate")
    parser.add_argument("--num-train", type=int, default=100, help="as in the run (the split depends on it)")
    parser.add_argument("--task-seed", type=int, default=1234, help="task.seed")
    parser.add_argument("--samples", type=int, default=4, help="K of mean@K")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--system-prompt", help="task.system_prompt (default: the chat template's own)")
    parser.add_argument("--output", help="also write the rows as JSON here")
    args = parser.parse_args()

    model, tokenizer = load_model(load_config().model)
    model.eval()
    sampler = HFSampler(model, tokenizer, batch_size=64)
    print(
        f"SmolLM2-135M-Instruct, max_new_tokens={args.max_new_tokens}, {args.num_eval} held-out problems "
        f"(task.seed={args.task_seed}, num_train={args.num_train}), mean@{args.samples} at temperature 1, "
        f"system prompt {args.system_prompt!r}",
        flush=True,
    )
    rows = []
    for candidate in args.candidate or CANDIDATES:
        rows.append(measure(sampler, candidate, args))
        print(table(rows[-1:], args.samples).splitlines()[-1], flush=True)
    print()
    print(table(rows, args.samples))
    if args.output:
        with open(args.output, "w") as out:
            json.dump({"args": vars(args), "rows": [asdict(r) for r in rows]}, out, indent=1)


if __name__ == "__main__":
    main()
