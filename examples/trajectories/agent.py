"""Bring your own agent: multi-turn conversations sampled from the policy's current weights, scored turn by
turn by your environment, trained with `Trainer.train_on_groups`. The run folder gets checkpoints, metrics,
plots and a summary as with `gspo train`, and the trained weights are exported at the end for an engine.

The environment is a running total over two turns: the user asks "What is 3 + 4? ...", the assistant
answers; the user says "Add 5 to that. ...", the assistant answers again. Each answer gets a turn reward
(1.0 when its last number is right), so the tokens of each turn get their own advantage
(docs/trajectories.md).

    python examples/trajectories/agent.py            # SmolLM2-135M-Instruct (config.yaml here)
    python examples/trajectories/agent.py --smoke    # the tiny random model, seconds (CI runs this)
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from gspo import Trainer, Trajectory, TrajectoryGroup, load_config
from gspo.rewards.builtins import correct_number
from gspo.training.export import export_run

HERE = Path(__file__).resolve().parent
SMOKE = [
    "model.tiny=llama",
    "train.steps=2",
    "eval.every=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
]


@dataclass(frozen=True)
class Task:
    """One episode: a + b, then + c."""

    a: int
    b: int
    c: int

    def turns(self) -> list[tuple[str, int]]:
        """(user message, the right answer) of each turn."""
        first = f"What is {self.a} + {self.b}? Answer with just the number."
        return [
            (first, self.a + self.b),
            (f"Add {self.c} to that. Answer with just the number.", self.a + self.b + self.c),
        ]


def make_tasks(count: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    return [Task(rng.randint(0, 9), rng.randint(0, 9), rng.randint(1, 9)) for _ in range(count)]


def play(
    trainer: Trainer, tasks: list[Task], attempts: int, *, greedy: bool = False
) -> list[list[Trajectory]]:
    """`attempts` episodes of each task, every turn sampled from the trainer's current weights.

    trainer.sampler is the policy itself (rollout.engine=hf), so each step's update is what the next step
    samples from. Every conversation is sent as one prompt per turn (the chat template applied), batched
    across all episodes; the sampled token ids and log-probs go with each turn into its Trajectory.
    """
    episodes = [task for task in tasks for _ in range(attempts)]
    messages: list[list[dict]] = [[] for _ in episodes]
    token_ids: list[list[list[int]]] = [[] for _ in episodes]
    logprobs: list[list[list[float]]] = [[] for _ in episodes]
    turn_rewards: list[list[float]] = [[] for _ in episodes]
    rollout = trainer.config.rollout
    for turn in range(2):
        for task, conversation in zip(episodes, messages, strict=True):
            conversation.append({"role": "user", "content": task.turns()[turn][0]})
        prompts = [
            trainer.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
            for m in messages
        ]
        replies = trainer.sampler.generate(
            prompts,
            group_size=1,
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            **({"greedy": True} if greedy else {}),
        )
        # the turn's text is its sampled tokens decoded, special tokens kept, the end-of-turn token left to
        # the template: so the template renders exactly the tokens that were sampled
        eos = trainer.tokenizer.eos_token_id
        texts = [
            trainer.tokenizer.decode(ids[:-1] if ids[-1:] == [eos] else ids) for ids in replies.completion_ids
        ]
        answers = [str(task.turns()[turn][1]) for task in episodes]
        correct = correct_number(prompts, texts, answer=answers)
        for i, conversation in enumerate(messages):
            conversation.append({"role": "assistant", "content": texts[i]})
            token_ids[i].append(replies.completion_ids[i])
            logprobs[i].append(replies.sampler_logprobs[i])
            turn_rewards[i].append(correct[i])
    trajectories = [
        Trajectory(m, reward=0.0, turn_rewards=r, sampler_token_ids=t, sampler_logprobs=lp)
        for m, r, t, lp in zip(messages, turn_rewards, token_ids, logprobs, strict=True)
    ]
    return [trajectories[j : j + attempts] for j in range(0, len(trajectories), attempts)]


def evaluate(trainer: Trainer, tasks: list[Task]) -> dict[str, float]:
    """Greedy episodes of the held-out tasks: the share of turns answered right, per turn and in all."""
    episodes = [group[0] for group in play(trainer, tasks, 1, greedy=True)]
    per_turn = [sum(t.turn_rewards[k] for t in episodes) / len(episodes) for k in range(2)]
    return {"accuracy": sum(per_turn) / 2, "turn1_accuracy": per_turn[0], "turn2_accuracy": per_turn[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a two-turn agent on its own trajectories.")
    parser.add_argument("--smoke", action="store_true", help="the tiny random model, a few seconds")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    config = load_config(HERE / "config.yaml", [*(SMOKE if args.smoke else []), *args.overrides])
    trainer = Trainer(config)
    train_tasks, held_out = make_tasks(200, seed=1), make_tasks(20, seed=2)
    rng = random.Random(config.seed)

    def log_eval() -> None:  # the agent's own evaluation, logged as gspo train logs its own
        metrics = evaluate(trainer, held_out)
        trainer.logger.log(trainer.step, metrics, kind="eval")
        print(f"step {trainer.step}: held-out accuracy {metrics['accuracy']:.3f}", flush=True)

    log_eval()
    while trainer.step < config.train.steps:
        tasks = rng.sample(train_tasks, config.rollout.prompts_per_step)
        groups = [TrajectoryGroup(g) for g in play(trainer, tasks, config.rollout.group_size)]
        metrics = trainer.train_on_groups(
            groups
        )  # one step: updates, metrics, a checkpoint every checkpoint.every
        print(f"step {trainer.step}: reward {metrics['reward_mean']:.3f}", flush=True)
        if trainer.step % config.eval.every == 0 or trainer.step == config.train.steps:
            log_eval()
    result = trainer.finish()  # the last checkpoint, plots/*.png and summary.md
    print(f"held-out accuracy: {result['eval_accuracy_first']:.3f} -> {result['eval_accuracy_last']:.3f}")
    # Hand the weights to an inference engine (vLLM, SGLang: a Hugging Face directory; llama.cpp, Ollama:
    # `gspo export RUN --format gguf`). To sync an engine every step instead, see docs/llama_cpp_sync.md.
    print(f"weights for your engine: {export_run(result['run_dir'], format='hf')}")
    print(f"run folder: {result['run_dir']}")


if __name__ == "__main__":
    main()
