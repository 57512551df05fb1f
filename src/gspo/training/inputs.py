"""What `gspo train` trains and evaluates on, built once from the config and checked before the run folder is
claimed: its examples, its rewards and the rows given in memory (`task_inputs`), and the checks of their
sizes against the model and the memory (the run folder and the policy: gspo.run)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError, TaskConfig
from gspo.config.engines import engine_of
from gspo.files import replace_file, run_path
from gspo.parallel.group import is_main
from gspo.rewards.resolve import RewardFunctions, check_examples, resolve_rewards
from gspo.rewards.scoring import Rewards
from gspo.rollout.data import (
    TASKS,
    DataError,
    Example,
    arithmetic_task,
    format_prompt,
    jsonl_lines,
    load_examples,
    rows_examples,
    split_eval,
)
from gspo.rollout.reasoning_gym import reasoning_gym_task
from gspo.rollout.samplers import tokenize_prompts
from gspo.run.start import Folder, Run


@dataclass(frozen=True)
class TaskInputs:
    """A run's inputs, checked: ``config`` as the run folder keeps it (the rewards it uses named, rows given in
    memory read back from RUN/data.jsonl), the ``rewards`` (name, function, weight; the first is the eval
    accuracy), the ``train`` and ``held_out`` examples, and ``rows``, the text of RUN/data.jsonl (None: no
    rows were given)."""

    config: Config
    rewards: Rewards
    train: list[Example]
    held_out: list[Example]
    rows: str | None
    eval_rows: str | None = None
    """The text of RUN/eval_data.jsonl, the held-out rows given in memory (None: none were)."""


def task_inputs(
    config: Config,
    folder: Folder,
    reward_functions: RewardFunctions | None,
    data: Any,
    *,
    resumed: bool,
    eval_data: Any = None,
) -> TaskInputs:
    """The inputs of a run whose ``folder`` is open (locked when ``resumed``, and the resume checked, before
    any reward file is imported): the rows ``data`` (and held-out ``eval_data``) given in memory, the
    rewards (``reward_functions`` replace config.rewards), the examples, each checked against the rewards
    that read it."""
    given = held = None
    if data is not None:  # the rows, and the config that reads them back from the run folder
        given, config = data_task(config, data, folder.path, resumed=resumed)
    if eval_data is not None:
        held, config = eval_data_task(config, eval_data, folder.path, resumed=resumed)
    rewards = resolve_rewards(config, reward_functions, device=folder.device)
    if reward_functions:  # config.yaml names the rewards this run uses (eval and resume look there)
        config = dataclasses.replace(config, rewards={r.name: r.weight for r in rewards})
    train, held_out = build_examples(config, given, held)
    check_examples(rewards, train + held_out)
    rows = jsonl_lines(given, config.task.prompt_field) if given is not None else None
    eval_rows = jsonl_lines(held, config.task.prompt_field) if held is not None else None
    return TaskInputs(config, rewards, train, held_out, rows, eval_rows)


def _file_examples(task: TaskConfig, key: str = "task.data_path") -> list[Example]:
    if task.data_path is not None and not Path(task.data_path).exists():
        raise FileNotFoundError(
            f"{key}: data file not found: {task.data_path} (a path in a config file is read relative "
            "to that file's folder, one on the command line relative to the working directory)"
        )
    return load_examples(
        task.data_path, prompt_field=task.prompt_field, answer_fields=tuple(task.answer_fields)
    )


def _arithmetic_examples(task: TaskConfig) -> list[Example]:
    return arithmetic_task(
        task.num_train + task.num_eval,
        operand_min=task.operand_min,
        operand_max=task.operand_max,
        operations=task.operations,
        num_operands=task.num_operands,
        seed=task.seed,
    )


def _reasoning_gym_examples(task: TaskConfig) -> list[Example]:
    return reasoning_gym_task(
        task.num_train + task.num_eval,
        dataset=task.dataset,
        dataset_config=task.dataset_config,
        seed=task.seed,
    )


TASK_EXAMPLES: dict[str, Callable[[TaskConfig], list[Example]]] = {
    "file": _file_examples,
    "arithmetic": _arithmetic_examples,
    "reasoning_gym": _reasoning_gym_examples,
    **{
        name: lambda task, make=make: make(task.num_train + task.num_eval, seed=task.seed)
        for name, make in TASKS.items()
        if name != "arithmetic"
    },
}
"""Each task.name's examples, from the task's settings: the one place a task's name becomes its problems."""


def build_examples(
    config: Config, given: list[Example] | None = None, held: list[Example] | None = None
) -> tuple[list[Example], list[Example]]:
    """The (train, eval) problems of the configured task, or of the examples `given` (rows passed in
    memory); deterministic for `task.seed`. The held-out problems are `held` (rows passed in memory), or
    task.eval_data_path's rows, with every problem of the task training; else task.num_eval of the task's."""
    task = config.task
    if given is None and task.name not in TASK_EXAMPLES:
        raise ConfigError(f"task.name={task.name!r} is not one of {sorted(TASK_EXAMPLES)}")
    if held is None and task.eval_data_path is not None:
        held = _file_examples(dataclasses.replace(task, data_path=task.eval_data_path), "task.eval_data_path")
    try:
        examples = given if given is not None else TASK_EXAMPLES[task.name](task)
        if held is not None:  # a held-out set of its own: the task's problems all train
            return list(examples), list(held)
        return split_eval(examples, task.num_eval, seed=task.seed)
    except ValueError as error:  # too many problems asked for, eval split too large, ...
        if isinstance(error, (ConfigError, DataError)):  # a data file's error names the file and the row
            raise
        raise ConfigError(f"task: {error} (see task.num_train, task.num_eval)") from error


DATA_FILE = "data.jsonl"
"""Where a run keeps the rows it was given in memory (`data=`), for --resume and gspo eval to read."""
EVAL_DATA_FILE = "eval_data.jsonl"
"""Where a run keeps the held-out rows it was given in memory (`eval_data=`)."""


def data_task(config: Config, data: Any, run_dir: Path, *, resumed: bool) -> tuple[list[Example], Config]:
    """The examples of rows given in memory (a datasets.Dataset, a list of dicts), and the config whose
    task reads them back from RUN/data.jsonl (`write_data` writes it once the run folder is claimed)."""
    task = config.task
    if resumed:
        raise ConfigError(
            f"data= with resume: a resumed run reads the rows it was given from its own {DATA_FILE} "
            "(task.data_path in its config.yaml): leave out data="
        )
    if task.data_path is not None or task.name not in ("arithmetic", "file"):
        named = f"task.data_path={task.data_path!r}" if task.data_path else f"task.name={task.name!r}"
        raise ConfigError(
            f"data= gives the task's rows, and {named} names others: keep one (data= is task.name=file with "
            f"the rows kept in the run folder's {DATA_FILE})"
        )
    examples = rows_examples(data, prompt_field=task.prompt_field, answer_fields=task.answer_fields)
    path = os.path.abspath(run_dir / DATA_FILE)
    return examples, dataclasses.replace(config, task=dataclasses.replace(task, name="file", data_path=path))


def write_data(run: Run, rows: str | None, eval_rows: str | None = None) -> None:
    """RUN/data.jsonl and RUN/eval_data.jsonl, the rows a run was given in memory (None: none were), by
    replacement (gspo.files): a kill leaves no half file for --resume to read."""
    for name, text in ((DATA_FILE, rows), (EVAL_DATA_FILE, eval_rows)):
        if text is not None and is_main():
            replace_file(run_path(run.path, name), text)


def eval_data_task(
    config: Config, data: Any, run_dir: Path, *, resumed: bool
) -> tuple[list[Example], Config]:
    """The held-out examples of rows given in memory (`eval_data=`: a datasets.Dataset, a list of dicts, read
    with the task's prompt_field and answer_fields), and the config whose task.eval_data_path reads them
    back from RUN/eval_data.jsonl."""
    task = config.task
    if resumed:
        raise ConfigError(
            f"eval_data= with resume: a resumed run reads its held-out rows from its own {EVAL_DATA_FILE} "
            "(task.eval_data_path in its config.yaml): leave out eval_data="
        )
    if task.eval_data_path is not None:
        raise ConfigError(
            f"eval_data= gives the held-out rows, and task.eval_data_path={task.eval_data_path!r} names others: "
            "keep one"
        )
    examples = rows_examples(data, prompt_field=task.prompt_field, answer_fields=task.answer_fields)
    path = os.path.abspath(run_dir / EVAL_DATA_FILE)
    return examples, dataclasses.replace(config, task=dataclasses.replace(task, eval_data_path=path))


def check_train_arguments(config: Any, overrides: Sequence[str]) -> None:
    """`train`'s config argument: a Config, a YAML file's path, or None; a misplaced argument (rows, a
    Config with overrides, which would be ignored) is a ConfigError naming where it goes."""
    if config is None or isinstance(config, (str, Path)):
        return
    if not isinstance(config, Config):
        rows = hasattr(config, "column_names") or isinstance(config, list)
        raise ConfigError(
            f"train's first argument is the config (a Config, or a YAML file's path), got a "
            f"{type(config).__name__}" + (": rows go in train(config, data=rows)" if rows else "")
        )
    if overrides:
        raise ConfigError(
            "overrides= go with a config file's path, train('config.yaml', overrides=[...]); a Config takes "
            "its values in Python (config.train.lr = 3e-6) or Config(train={'lr': 3e-6})"
        )


def check_prompt_lengths(
    config: Config, tokenizer: Any, model: torch.nn.Module, train: list[Example], held_out: list[Example]
) -> dict[str, int]:
    """Every prompt (with the chat template) plus the completion length fits the model's context; returns
    the longest sequence, prompt and completion, of the rollouts and of the evaluation."""
    context = getattr(model.config, "max_position_embeddings", None) or math.inf
    longest = {}
    for examples, budget, key in (
        (train, config.rollout.max_new_tokens, "rollout.max_new_tokens"),
        (held_out, config.eval.max_new_tokens, "eval.max_new_tokens"),
    ):
        prompts = [
            format_prompt(tokenizer, ex.prompt, system_prompt=config.task.system_prompt) for ex in examples
        ]
        lengths = [len(ids) for ids in tokenize_prompts(tokenizer, prompts)] if prompts else []
        longest[key] = max(lengths, default=0) + budget
        too_long = [i for i, n in enumerate(lengths) if n + budget > context]
        if too_long:
            i = too_long[0]
            where = examples[i].source or f"example {examples[i].prompt[:60]!r}"
            others = f" ({len(too_long) - 1} more prompts are too long)" if len(too_long) > 1 else ""
            raise DataError(
                f"{where}: the prompt is {lengths[i]} tokens with the chat template, + {key}={budget} = "
                f"{lengths[i] + budget} > the model's context of {context} tokens{others}: shorten or drop "
                f"it, or lower {key}"
            )
    return longest


def kv_cache_bytes(model: torch.nn.Module, sequences: int, tokens: int) -> int:
    """The key/value cache of `sequences` slots of `tokens` positions (gspo.rollout.kv_cache.SlotCache):
    2 (keys, values) x layers x sequences x kv_heads x tokens x head_dim x the weights' element size."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * sequences * kv_heads * tokens * head_dim * element


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: the GPU's free memory, or the system's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as meminfo:
        line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_sizes(
    config: Config, tokenizer: Any, model: torch.nn.Module, train: list[Example], held_out: list[Example]
) -> None:
    """Before generating: every prompt fits the model's context with its completion, and the key/value
    cache of the rollout (rollout.engine=hf) and of the evaluation fits the memory free on the model's
    device; refused with the estimate."""
    longest = check_prompt_lengths(config, tokenizer, model, train, held_out)
    check_generation_memory(config, model, longest, len(held_out), next(model.parameters()).device)


def check_generation_memory(
    config: Config, model: torch.nn.Module, longest: dict[str, int], num_eval: int, device: torch.device
) -> None:
    """Refuse, before generating, sizes whose key/value cache cannot fit in the memory available on the
    device that generates (rollout.engine=hf, and every evaluation), with the estimate."""
    rollout = config.rollout
    needs = [
        (
            min(config.eval.batch_size, num_eval),
            longest.get("eval.max_new_tokens", 0),
            "eval.batch_size",
            "eval.max_new_tokens",
        )
    ]
    engine = engine_of(config)
    if engine is not None and engine.in_process:  # the trainer's own model generates here
        batch = rollout.prompts_per_step * rollout.group_size
        needs.append(
            (
                min(rollout.generation_batch_size, batch),
                longest.get("rollout.max_new_tokens", 0),
                "rollout.generation_batch_size",
                "rollout.max_new_tokens",
            )
        )
    free = available_memory(device)
    for sequences, tokens, slots_key, tokens_key in needs:
        need = kv_cache_bytes(model, sequences, tokens)
        if need > free:
            raise ConfigError(
                f"{sequences} sequences of up to {tokens:,} tokens ({slots_key}, the longest prompt + "
                f"{tokens_key}) need a key/value cache of about {_size(need)}, and {_size(free)} is free on "
                f"{device}: lower {slots_key} or {tokens_key}"
            )
