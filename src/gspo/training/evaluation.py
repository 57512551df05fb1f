"""Evaluation: held-out problems completed by the policy and scored by the run's rewards.

`evaluate` is the one code path of the trainer's evaluations and of `gspo eval`. Greedy (the default): one
completion per problem; accuracy = mean of the first reward function, reward_mean = mean weighted total.
Sampled (`samples=k`): k completions per problem at `temperature`; mean@k = mean of the first reward function
over all k, and pass@j for j = 1, 2, 4, ..., k with the unbiased estimator, where a completion passes when the
first reward function gives it a positive reward (1.0 of a 0/1 verifier). Under torchrun each rank completes
its share of the problems and every rank gets the whole result.

`evaluate_target` is `gspo eval`: the model of a run's checkpoint (LoRA merged), a model directory, a .gguf
file or the config's model, on the configured task's held-out split or on a data file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError, load_config
from gspo.core.seeds import evaluation_seed
from gspo.files import replace_file, run_path
from gspo.learning.policy import Policy
from gspo.models import load_model
from gspo.parallel.collectives import all_gather_list
from gspo.parallel.group import rank, resolve_device, world_size
from gspo.rewards.calling import RewardFunction
from gspo.rewards.resolve import resolve_rewards
from gspo.rewards.scoring import Rewards
from gspo.rollout.data import Example, batch_fields, format_prompt, load_examples
from gspo.rollout.samplers import HFSampler
from gspo.run.build import generating, load_checkpoint_policy
from gspo.run.checkpoint import check_output, checkpoint_step, find_checkpoint
from gspo.run.trust import check_reaches, check_run_folder_config, model_reaches
from gspo.training.inputs import build_examples
from gspo.workers import Workers

EVALS_DIR = "evals"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without
    replacement hold at least one pass; computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), free of huge binomials."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a pass
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(samples: int) -> list[int]:
    """The k of the reported pass@k: powers of two below `samples`, and `samples` itself."""
    return sorted({*(2**i for i in range(samples.bit_length()) if 2**i < samples), samples})


@dataclass
class Evaluation:
    """metrics: the summary (floats, what the trainer logs); problems: per problem, in the given order,
    its prompt, fields, completions, total and per-function rewards, and how many completions passed."""

    metrics: dict[str, float]
    problems: list[dict[str, Any]]


def evaluate_policy(
    policy: Policy,
    tokenizer: Any,
    config: Config,
    examples: Sequence[Example],
    rewards: Rewards,
    step: int,
    *,
    workers: Workers | None = None,
) -> dict[str, float]:
    """The trainer's evaluation at ``step``: greedy completions of the held-out ``examples`` by the policy in
    training, scored by the run's rewards (their calls in the run's ``workers``), drawn with a seed of their
    own (gspo.core.seeds.evaluation_seed): how often a run evaluates changes nothing it trains on."""
    sampler = HFSampler(policy.model, tokenizer, config.eval.batch_size, lambda: generating(policy))
    return evaluate(
        sampler,
        examples,
        rewards,
        max_new_tokens=config.eval.max_new_tokens,
        system_prompt=config.task.system_prompt,
        seed=evaluation_seed(config.seed, step),
        workers=workers,
    ).metrics


def evaluate(
    sampler: HFSampler,
    examples: Sequence[Example],
    rewards: Rewards | Sequence[tuple[str, RewardFunction, float]],
    *,
    max_new_tokens: int,
    system_prompt: str | None = None,
    samples: int | None = None,
    temperature: float = 1.0,
    seed: int | None = None,
    workers: Workers | None = None,
) -> Evaluation:
    """Complete every example (greedy, or `samples` draws at `temperature`) and score it (module docstring):
    a problem's completions are a group. seed: the draws' (None: from torch's global generator); workers:
    the run's threads and loop, which the rewards' calls borrow (None: ones of this call's own). ``rewards``:
    the run's, or (name, function, weight) triples, the first the accuracy."""
    if samples is not None and samples < 1:
        raise ValueError(f"samples={samples}: draw at least one completion per problem")
    rewards = rewards if isinstance(rewards, Rewards) else Rewards.of(rewards)
    k = samples or 1
    mine = list(enumerate(examples))[rank() :: world_size()]  # this rank's share
    prompts = [format_prompt(sampler.tokenizer, ex.prompt, system_prompt=system_prompt) for _, ex in mine]
    rollouts = sampler.generate(
        prompts,
        group_size=k,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        greedy=samples is None,
        seed=seed,
    )
    scores = rewards.score(
        [p for p in prompts for _ in range(k)],
        rollouts.completions,
        batch_fields([ex for _, ex in mine], repeat=k),
        group_ids=[j for j in range(len(mine)) for _ in range(k)],
        completion_ids=rollouts.completion_ids,
        example_prompts=[ex.prompt for _, ex in mine for _ in range(k)],
        workers=workers,
    )
    total, per_function = scores.total, scores.per_function
    first = rewards.accuracy
    problems = []
    for j, (index, example) in enumerate(mine):
        rows = slice(j * k, (j + 1) * k)  # sample-major: problem j's k completions
        problems.append(
            {
                "index": index,
                "prompt": example.prompt,
                "fields": example.fields,
                "completions": rollouts.completions[rows],
                "completion_tokens": [len(ids) for ids in rollouts.completion_ids[rows]],
                "reward": total[rows].tolist(),
                "rewards": {name: values[rows].tolist() for name, values in per_function.items()},
                "passed": int((per_function[first][rows] > 0).sum()),
            }
        )
    problems = sorted(all_gather_list(problems), key=lambda p: p["index"])
    return Evaluation(_metrics(problems, first, samples), problems)


def _metrics(problems: list[dict[str, Any]], first: str, samples: int | None) -> dict[str, float]:
    def mean(values: list[float]) -> float:
        values = [v for v in values if not math.isnan(v)]  # a reward that scored no such sample (None)
        return sum(values) / len(values) if values else math.nan  # nothing measured

    lengths = [n for p in problems for n in p["completion_tokens"]]
    scores = [r for p in problems for r in p["rewards"][first]]
    reward = mean([r for p in problems for r in p["reward"]])
    if samples is None:
        return {"accuracy": mean(scores), "reward_mean": reward, "completion_len_mean": mean(lengths)}
    passes = {
        f"pass@{k}": mean([pass_at_k(samples, p["passed"], k) for p in problems]) for k in pass_ks(samples)
    }
    return {
        f"mean@{samples}": mean(scores),
        **passes,
        "reward_mean": reward,
        "completion_len_mean": mean(lengths),
    }


# ---- gspo eval -----------------------------------------------------------------------------------------------
def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / "config.yaml").is_file() and (Path(path) / "checkpoints").is_dir()


def evaluate_target(
    target: str | None,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    *,
    step: int | None = None,
    data: str | None = None,
    samples: int | None = None,
    temperature: float = 1.0,
    trust_run_folder: bool = False,
) -> tuple[Evaluation, dict[str, Any]]:
    """`gspo eval`: (evaluation, report header). target: a run folder (its checkpoint of `step`, default
    the latest), a model directory, a .gguf file, or None (the config's model; by default the embedded one).

    The task, rewards and eval settings come from `config_file` (default: the run's config.yaml, else the
    defaults) and `overrides`; `data` evaluates every row of a JSONL/CSV/datasets file instead of the task's
    held-out split. Reward code, data and a base model named by a run's config.yaml are used only when the
    overrides name them again, or with `trust_run_folder` (gspo.run.trust).
    """
    header: dict[str, Any] = {"target": target}
    if target is not None and is_run_dir(target):
        trust = trust_run_folder
        run_config, config = _run_configs(target, config_file, overrides, data=data, trust_run_folder=trust)
        checkpoint = find_checkpoint(target, step)
        model, tokenizer = load_checkpoint_policy(run_config, checkpoint)
        header |= {"checkpoint": str(checkpoint), "step": checkpoint_step(checkpoint)}
    else:
        if step is not None:
            raise ValueError(f"--step needs a run folder as the target; {target!r} is not one")
        if target is not None and not Path(target).exists():
            raise FileNotFoundError(f"{target}: no run folder, model directory or .gguf file there")
        model_overrides = [] if target is None else [f"model.path={target}", "model.tiny=null"]
        config = load_config(config_file, [*overrides, *model_overrides])
        model, tokenizer = load_model(config.model, seed=config.seed)
        header["model"] = config.model.path or config.model.tiny or "embedded SmolLM2-135M-Instruct"
    examples, header["data"] = _problems(config, data)
    rewards = resolve_rewards(config, None)
    model = model.to(resolve_device(config.device))
    torch.manual_seed(config.seed)
    sampler = HFSampler(model, tokenizer, config.eval.batch_size)
    result = evaluate(
        sampler,
        examples,
        rewards,
        max_new_tokens=config.eval.max_new_tokens,
        system_prompt=config.task.system_prompt,
        samples=samples,
        temperature=temperature,
    )
    header |= {
        "mode": "greedy" if samples is None else f"{samples} samples at temperature {temperature}",
        "max_new_tokens": config.eval.max_new_tokens,
        "rewards": {name: weight for name, _, weight in rewards},
        "problems": len(examples),
    }
    return result, header


def _run_configs(
    target: str,
    config_file: str | None,
    overrides: Sequence[str],
    *,
    data: str | None,
    trust_run_folder: bool,
) -> tuple[Config, Config]:
    """(the run's config, which loads its checkpoint; the evaluation's config) of a run folder target, the
    folder's reward code, data, reward model, judge (its URL, template and key variable) and base model
    checked first (gspo.run.trust): data until the user names them, as for --resume."""
    # the model the checkpoint loads with: the run's, or the base model the user names (model.path=...)
    model_given = [o for o in overrides if o.partition("=")[0].strip().startswith("model.")]
    run_config = load_config(run_path(target, "config.yaml"), model_given)
    config = load_config(config_file or run_path(target, "config.yaml"), overrides)
    folder, trust = Path(target), trust_run_folder
    if config_file is None:  # a config file of the user's is theirs: its rewards and data too
        reads = [*REWARD_REACHES, *(() if data is not None else ("task.data_path", "task.eval_data_path"))]
        check_run_folder_config(config, overrides, folder=folder, trust_run_folder=trust, reaches=reads)
    reads = model_reaches(run_config, copies_gguf=False)
    check_reaches(run_config, overrides, folder=folder, trust_run_folder=trust, keys=reads)
    return run_config, config


REWARD_REACHES = ("judge.url", "judge.template", "judge.api_key_env", "reward_model.path")
"""What an evaluation's rewards reach outside the run folder (gspo.run.trust.REACHES): the judge's server,
template and key variable, and the reward model's folder."""


def _problems(config: Config, data: str | None) -> tuple[list[Example], str]:
    """What `gspo eval` scores, and where it comes from: every row of `data`, else the task's held-out
    split."""
    task = config.task
    if data is not None:
        fields = tuple(task.answer_fields)
        return load_examples(data, prompt_field=task.prompt_field, answer_fields=fields), str(data)
    examples = build_examples(config)[1]
    if not examples:
        raise ConfigError(
            "task.num_eval=0: the task holds no problem out to evaluate; pass task.num_eval=N or --data FILE"
        )
    return examples, f"held-out split of task {task.name!r}"


def summary_line(evaluation: Evaluation, header: dict[str, Any]) -> str:
    """One line: the metrics, then what was evaluated on what."""
    metrics = ", ".join(f"{name} {value:.3f}" for name, value in evaluation.metrics.items())
    what = header.get("checkpoint") or header.get("model")
    return f"{metrics} ({header['problems']} problems, {header['data']}, {header['mode']}; {what})"


def write_report(
    evaluation: Evaluation, header: dict[str, Any], path: str | Path, *, force: bool = True
) -> Path:
    """The JSON report: the header, the metrics and every problem's completions and rewards; written
    beside `path` and renamed into place. An existing file is replaced only with `force`, and never one
    inside a checkpoint."""
    path = Path(path)
    check_output(path, force=force)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {**header, "metrics": evaluation.metrics, "per_problem": evaluation.problems}
    replace_file(path, json.dumps(report, indent=1, default=str) + "\n")
    return path


def default_report_path(header: dict[str, Any], samples: int | None) -> Path | None:
    """RUN_DIR/evals/step_000040[_samples8].json for a run; None for any other target (no report unless
    the user names one)."""
    if "step" not in header:
        return None
    suffix = "" if samples is None else f"_samples{samples}"
    return run_path(header["target"], EVALS_DIR, f"step_{header['step']:06d}{suffix}.json")
