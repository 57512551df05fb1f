"""What `gspo train` trains and evaluates on, built once from the config and checked before the run folder is
claimed: its examples, its rewards and the rows given in memory (`task_inputs`), and the checks of their
sizes against the model and the memory (the run folder and the policy: gspo.run)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError, TaskConfig
from gspo.config.engines import engine_of
from gspo.config.loading import code_file
from gspo.config.values import shown
from gspo.files import replace_file, run_path
from gspo.parallel.group import is_main
from gspo.rewards.calling import RewardFunction, prepare
from gspo.rewards.resolve import resolve_reward
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
from gspo.rollout.user_code import CodeFileError
from gspo.run.start import Folder, Run


@dataclass(frozen=True)
class TaskInputs:
    """A run's inputs, checked: ``config`` as the run folder keeps it (the rewards it uses named, rows given in
    memory read back from RUN/data.jsonl), the ``rewards`` (name, function, weight; the first is the eval
    accuracy), the ``train`` and ``held_out`` examples, and ``rows``, the text of RUN/data.jsonl (None: no
    rows were given)."""

    config: Config
    rewards: list[tuple[str, RewardFunction, float]]
    train: list[Example]
    held_out: list[Example]
    rows: str | None


def task_inputs(
    config: Config, folder: Folder, reward_functions: RewardFunctions | None, data: Any, *, resumed: bool
) -> TaskInputs:
    """The inputs of a run whose ``folder`` is open (locked when ``resumed``, and the resume checked, before
    any reward file is imported): the rows ``data`` given in memory, the rewards (``reward_functions``
    replace config.rewards), the examples, each checked against the rewards that read it."""
    given = None
    if data is not None:  # the rows, and the config that reads them back from the run folder
        given, config = data_task(config, data, folder.path, resumed=resumed)
    rewards = resolve_rewards(config, reward_functions, device=folder.device)
    if reward_functions:  # config.yaml names the rewards this run uses (eval and resume look there)
        config = dataclasses.replace(config, rewards={name: weight for name, _, weight in rewards})
    train, held_out = build_examples(config, given)
    check_examples(rewards, train + held_out)
    rows = jsonl_lines(given, config.task.prompt_field) if given is not None else None
    return TaskInputs(config, rewards, train, held_out, rows)


def _file_examples(task: TaskConfig) -> list[Example]:
    if task.data_path is not None and not Path(task.data_path).exists():
        raise FileNotFoundError(
            f"task.data_path: data file not found: {task.data_path} (a path in a config file is read relative "
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


def build_examples(config: Config, given: list[Example] | None = None) -> tuple[list[Example], list[Example]]:
    """The (train, eval) problems of the configured task, or of the examples `given` (rows passed in
    memory); deterministic for `task.seed`."""
    task = config.task
    if given is None and task.name not in TASK_EXAMPLES:
        raise ConfigError(f"task.name={task.name!r} is not one of {sorted(TASK_EXAMPLES)}")
    try:
        examples = given if given is not None else TASK_EXAMPLES[task.name](task)
        return split_eval(examples, task.num_eval, seed=task.seed)
    except ValueError as error:  # too many problems asked for, eval split too large, ...
        if isinstance(error, (ConfigError, DataError)):  # a data file's error names the file and the row
            raise
        raise ConfigError(f"task: {error} (see task.num_train, task.num_eval)") from error


RewardFunctions = Mapping[str, RewardFunction] | Sequence[RewardFunction] | RewardFunction
"""Python reward functions: by name, or a list (or one) named by their own names, as TRL's reward_funcs."""


def named_rewards(functions: RewardFunctions | None) -> dict[str, RewardFunction]:
    """`functions` by name: a mapping as it is, a list of functions (or one) by each function's __name__;
    None: {} (the config's rewards). Anything else, an empty collection (a run with no reward), a name that
    is not a function's own (a lambda's, a partial's), a repeated name, or an item that is not callable is a
    ConfigError naming the item and the fix."""
    if functions is None:
        return {}
    if isinstance(functions, Mapping):
        named = dict(functions)
    elif isinstance(functions, (str, bytes)):
        raise ConfigError(_named_not_given(functions, "reward_functions"))
    elif not callable(functions) and not isinstance(functions, Iterable):
        raise ConfigError(
            f"reward_functions={shown(functions)} ({type(functions).__name__}) is not a function, a list of "
            "functions, or a dict of them by name: give one of those (None: the config's rewards)"
        )
    else:
        listed = [functions] if callable(functions) else list(functions)
        named = {}
        for index, function in enumerate(listed):
            if isinstance(function, torch.nn.Module):  # a reward model: TRL takes one, gspo does not
                raise ConfigError(_model_given(function, f"reward_functions[{index}]"))
            name = getattr(function, "__name__", None) if callable(function) else None
            if callable(function) and name in (None, "<lambda>"):
                what = "a lambda" if name else f"a {type(function).__name__}"
                raise ConfigError(
                    f"reward_functions[{index}] is {what}, which has no name of its own: name it with a "
                    "dict, reward_functions={'my_reward': f, ...}"
                )
            if name in named:
                raise ConfigError(
                    f"reward_functions[{index}]: two functions are named {name!r} (metrics and the eval "
                    "accuracy name each reward): name them with a dict, reward_functions={'a': f, 'b': g}"
                )
            named[name or index] = function
    if not named:  # the run's rewards are exactly the functions given: here, none
        raise ConfigError(
            f"reward_functions={shown(functions)} is empty: a run needs a reward; give your functions, or leave "
            "reward_functions out (None) to use the config's rewards"
        )
    for name, function in named.items():
        if isinstance(function, torch.nn.Module):
            raise ConfigError(_model_given(function, f"reward_functions[{name!r}]"))
        if not callable(function):
            raise ConfigError(_named_not_given(function, f"reward_functions[{name!r}]"))
    return named


def _model_given(model: torch.nn.Module, where: str) -> str:
    return (
        f"{where} is a model ({type(model).__name__}): gspo's rewards are functions, def reward(completions, "
        "**kwargs) -> list[float]; score with the model inside one"
    )


def _named_not_given(value: object, where: str) -> str:
    """The message for a reward given by name where functions go: a built-in's name or a file's function
    belongs in config.rewards; a hub id (a reward model, as TRL takes) has no place in gspo."""
    if not isinstance(value, str):
        return (
            f"{where} is a {type(value).__name__}, not a function: a built-in or a file's function goes in "
            "config.rewards (e.g. rewards={'exact_answer': 1.0})"
        )
    if "/" in value and ":" not in value:  # "OpenAssistant/reward-model-deberta-v3-large-v2"
        return (
            f"{where}={value!r} names a model: gspo's rewards are functions, def reward(completions, **kwargs) "
            "-> list[float]; score with the model inside one (a reward model is not taken by name)"
        )
    return (
        f"{where}={value!r} is a name: reward_functions takes the functions themselves; a built-in or a "
        f"file's function goes in config.rewards (e.g. rewards={{{value!r}: 1.0}})"
    )


def resolve_rewards(
    config: Config, custom: RewardFunctions | None, *, device: torch.device | str = "cpu"
) -> list[tuple[str, RewardFunction, float]]:
    """(name, function, weight) of the run's rewards, in order; the first is the eval accuracy. Each function
    is prepared (gspo.rewards.calling.prepare): called as it is declared, each call within reward_timeout,
    at most reward_concurrency of a concurrent one's in flight; a reward model runs on ``device``.

    `custom` (Python callables: by name, or a list named by their own names) replaces config.rewards, as
    TRL's reward_funcs do: the run's rewards are exactly these, each weighing config.rewards[name] where the
    config names it, else 1.0.
    """
    custom = named_rewards(custom)
    weights = {name: config.rewards.get(name, 1.0) for name in custom} if custom else dict(config.rewards)
    labels = {name: name for name in custom} if custom else reward_labels(list(weights))
    resolved = []
    for name, weight in weights.items():
        try:
            function = custom[name] if name in custom else resolve_reward(name, config, device=device)
        except (CodeFileError, FileNotFoundError) as error:  # the file: missing, or failing when run
            where = " (read from the working directory when named on the command line, else from the folder of the config file that names it)"
            missing = where if isinstance(error, FileNotFoundError) else ""
            raise CodeFileError(f"{as_written(name, error)}{missing}") from error
        except (ValueError, TypeError, ImportError) as error:  # unknown name, no such function, ...
            raise ConfigError(as_written(name, error)) from error
        except (Exception, SystemExit) as error:  # a module (module:function) that fails when imported
            raise CodeFileError(
                f"rewards.{name}: importing it raised {type(error).__name__}: {error}"
            ) from error
        label = labels[name]
        prepared = prepare(
            function, label, timeout=config.reward_timeout, concurrency=config.reward_concurrency
        )
        resolved.append((label, prepared, weight))
    return resolved


def as_written(name: str, error: BaseException) -> str:
    """ "rewards.KEY: error" for a reward that failed to load, its file's path as the user most likely wrote
    it: relative to the working directory when the file lies inside it (loading made it absolute)."""
    file = code_file(name)
    text = str(error)
    if file is not None and file.is_absolute() and file.is_relative_to(Path.cwd()):
        relative = str(file.relative_to(Path.cwd()))
        name, text = name.replace(str(file), relative, 1), text.replace(str(file), relative)
    return f"rewards.{name}: {text}"


DATA_FILE = "data.jsonl"
"""Where a run keeps the rows it was given in memory (`data=`), for --resume and gspo eval to read."""


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


def write_data(run: Run, rows: str | None) -> None:
    """RUN/data.jsonl, the rows a run was given in memory (None: none were), by replacement (gspo.files): a
    kill leaves no half file for --resume to read."""
    if rows is not None and is_main():
        replace_file(run_path(run.path, DATA_FILE), rows)


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


def reward_labels(names: list[str]) -> dict[str, str]:
    """Each configured reward's name in metrics, reports and messages: its function's name, as TRL names
    them ("reward/exact_capital", not the file's absolute path), or the whole key where two share one.

    >>> reward_labels(["correct_number", "/tasks/capitals/rewards.py:exact_capital"])
    {'correct_number': 'correct_number', '/tasks/capitals/rewards.py:exact_capital': 'exact_capital'}
    """
    short = {name: name.rpartition(":")[2] for name in names}
    counts = {label: list(short.values()).count(label) for label in short.values()}
    return {name: label if counts[label] == 1 else name for name, label in short.items()}


def check_examples(rewards: list[tuple[str, RewardFunction, float]], examples: list[Example]) -> None:
    """Every example has the fields each reward function needs (its keyword-only parameters without a
    default) and passes the function's own `validate_example`, if any: found at start-up, not when the
    row is first drawn."""
    for name, function, _ in rewards:
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):  # some callables have no signature to read
            parameters = []
        needed = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        validate = getattr(function, "validate_example", None)
        for index, example in enumerate(examples):
            where = example.source or f"example {index} ({example.prompt[:60]!r})"
            missing = [field for field in needed if field not in example.fields]
            if missing:
                raise DataError(
                    f"{where}: reward {name!r} needs the field(s) {missing}, and the example has "
                    f"{sorted(example.fields)} (set task.answer_fields)"
                )
            if validate is not None:
                try:
                    validate(example.fields)
                except ValueError as error:
                    raise DataError(f"{where}: {error}, which reward {name!r} cannot use") from None


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
