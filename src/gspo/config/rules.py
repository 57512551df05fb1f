"""What each config key's value must be: one table (`RULES`), one rule per key, the reason in the message.

The types (int, float, str, a Literal's choices) are checked while a value is read (gspo.config.loading),
floats there also for being finite; this table adds the ranges and the non-empty strings. Keys whose type
says everything (booleans, Literal choices) have no rule. Checks that relate several keys are functions in
gspo.config.checks. ``None`` of an optional key means "the default" and is not checked.
"""

from __future__ import annotations

import functools
import math
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gspo.config.schema import Config, ConfigError

SEED_MAX = 2**32 - 1
"""numpy's and torch's seeds are 32-bit unsigned."""


@dataclass(frozen=True)
class Rule:
    """`test(value)` is True for a good value; `must` says what a good value is ("at least 1"); `why`
    is the reason, or the meaning of a special value, shown after it."""

    test: Callable[[Any], bool]
    must: str
    why: str = ""


def at_least(low: int | float, why: str = "") -> Rule:
    return Rule(lambda v: v >= low, f"at least {low}", why)


def above(low: float, why: str = "") -> Rule:
    return Rule(lambda v: v > low, f"> {low}", why)


def between(
    low: float, high: float, *, high_open: bool = False, low_open: bool = False, why: str = ""
) -> Rule:
    def test(v: float) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    left, right = "(" if low_open else "[", ")" if high_open else "]"
    return Rule(test, f"in {left}{low}, {high}{right}", why)


def _text(value: Any) -> bool:
    """A non-empty string without control characters (a NUL in a path or name fails far from here)."""
    return isinstance(value, str) and value.strip() != "" and not any(ord(c) < 32 for c in value if c != "\t")


def non_empty(why: str = "") -> Rule:
    return Rule(_text, "a non-empty string without control characters", why)


def names(why: str = "", *, allow_empty: bool = True) -> Rule:
    def test(value: list[str]) -> bool:
        return (allow_empty or bool(value)) and all(map(_text, value)) and len(set(value)) == len(value)

    return Rule(test, f"a list of distinct non-empty names{'' if allow_empty else ', at least one'}", why)


def http_url_problem(url: str) -> str | None:
    """What is wrong with a server address, or None: http(s), a host, a valid port, no credentials, no
    spaces. (urllib only fails on some of these when a request is made, far from the config.)"""
    if any(c.isspace() or ord(c) < 32 for c in url):
        return "it holds spaces or control characters"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as error:
        return f"it is not a valid URL ({error})"
    if parts.scheme not in ("http", "https"):
        return "only http:// and https:// addresses are supported"
    if not parts.hostname:
        return "it names no host"
    if port == 0:
        return "port 0 is no server's port"
    if parts.username is not None or parts.password is not None:
        return (
            "it holds credentials (user:password@); the API key goes in the environment variable "
            "named by rollout.openai.api_key_env"
        )
    return None


def _url(value: str) -> bool:
    return http_url_problem(value) is None


def _adam_betas(value: list[float]) -> bool:
    return len(value) == 2 and all(0 <= b < 1 for b in value)


def _reward_names(value: dict[str, float]) -> bool:
    return bool(value) and all(map(_text, value))


def _operations(value: str) -> bool:
    return value != "" and set(value) <= set("+-*")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")

RULES: dict[str, Rule] = {
    "seed": between(0, SEED_MAX, why="numpy's and torch's seeds are 32-bit unsigned"),
    "output_dir": non_empty("an empty path would be the current folder"),
    "device": Rule(lambda v: _DEVICE.fullmatch(v) is not None, '"auto", "cpu", "cuda" or "cuda:N"'),
    "model.path": non_empty("a model directory or a .gguf file"),
    "model.attn_implementation": non_empty('transformers\' attention, e.g. "sdpa" or "eager"'),
    "lora.rank": at_least(0, "0 trains all parameters"),
    "lora.alpha": above(0, "the adapters' scale is alpha / rank"),
    "lora.dropout": between(0, 1, high_open=True, why="a probability below 1"),
    "lora.target_modules": names("the module names that get adapters", allow_empty=False),
    "task.name": non_empty(),
    "task.data_path": non_empty("a .jsonl, .csv or datasets directory"),
    "task.prompt_field": non_empty("the column holding the prompt"),
    "task.answer_fields": names("columns passed to the rewards"),
    "task.num_train": at_least(1, "the prompt stream needs at least one training problem"),
    "task.num_eval": at_least(0, "0: no held-out evaluation"),
    "task.operations": Rule(_operations, 'a non-empty string of the operators "+-*"'),
    "task.num_operands": at_least(2),
    "task.seed": between(0, SEED_MAX),
    "task.dataset": non_empty("a reasoning-gym dataset name, e.g. chain_sum"),
    "rewards": Rule(
        _reward_names, "at least one reward with a non-empty name", "e.g. rewards={exact_answer: 1.0}"
    ),
    "reward_timeout": at_least(0, "seconds; 0: no limit"),
    "rollout.openai.url": Rule(_url, 'an http:// or https:// address, e.g. "http://127.0.0.1:8000/v1"'),
    "rollout.openai.model": non_empty("the served model's name; null: the server's default"),
    "rollout.openai.concurrency": at_least(1),
    "rollout.openai.timeout": above(0, "seconds a request may take"),
    "rollout.openai.api_key_env": Rule(
        lambda v: _ENV_NAME.fullmatch(v) is not None, "an environment variable's name", "e.g. OPENAI_API_KEY"
    ),
    "rollout.llama_cpp.sync_every": at_least(1),
    "rollout.llama_cpp.timeout": above(0, "seconds the server may take"),
    "rollout.prompts_per_step": at_least(1),
    "rollout.group_size": at_least(
        2,
        "advantages compare each completion with the others of its prompt's group, so with one every "
        "advantage is 0 and nothing is learned",
    ),
    "rollout.max_new_tokens": at_least(1),
    "rollout.temperature": above(0, "the logits are divided by it"),
    "rollout.top_p": between(0, 1, low_open=True, why="1.0: off"),
    "rollout.generation_batch_size": at_least(1),
    "train.objective": non_empty(
        "a built-in's name or your own, 'path/file.py:function' (gspo.config.checks)"
    ),
    "train.eps_low": at_least(0),
    "train.eps_high": at_least(0),
    "train.tau_pos": above(0, "SAPO's gate divides by it"),
    "train.tau_neg": above(0, "SAPO's gate divides by it"),
    "train.steps": at_least(1),
    "train.minibatches": at_least(1),
    "train.micro_batch_tokens": at_least(1),
    "train.lr": above(0),
    "train.weight_decay": at_least(0),
    "train.adam_betas": Rule(_adam_betas, "two numbers in [0, 1)", "AdamW's moment decays"),
    "train.warmup_updates": at_least(0, "0: no warm-up"),
    "train.max_grad_norm": at_least(0, "0: no clipping"),
    "train.beta": at_least(0, "0: no KL term"),
    "train.pack_length": at_least(1),
    "train.logprob_chunk_size": at_least(1),
    "train.sampler_correction_min": at_least(0),
    "train.sampler_correction_max": above(0),
    "train.opsm_delta": at_least(0, "null disables it"),
    "train.warn_after_flat_steps": at_least(0, "0: never"),
    "eval.every": at_least(0, "0: only before and after training"),
    "eval.max_new_tokens": at_least(1),
    "eval.batch_size": at_least(1),
    "checkpoint.every": at_least(0, "0: only at the end"),
    "checkpoint.keep": at_least(1),
    "distributed.timeout_minutes": above(0),
    "serve.host": non_empty('the address to listen on, e.g. "127.0.0.1"'),
    "serve.port": between(0, 65535, why="0: any free port"),
    "serve.api_key_env": Rule(
        lambda v: _ENV_NAME.fullmatch(v) is not None, "an environment variable's name", "e.g. GSPO_API_KEY"
    ),
    "serve.model_name": non_empty("the name /v1/models lists"),
    "serve.slots": at_least(1),
    "serve.max_tokens": at_least(1),
    "serve.max_n": at_least(1),
    "serve.max_waiting": at_least(1),
    "serve.request_timeout": above(0, "seconds a request may take"),
    "serve.max_staleness": at_least(0, "0: only the current version's completions"),
    "serve.max_records": at_least(1),
    "serve.record_ttl": above(0, "seconds a record is kept"),
    "serve.train_timeout": above(0, "seconds a train call may wait for the one before it"),
}
"""One rule per key (dotted name); tests/test_config.py checks that every key without a Literal or bool
type has one, or is in `ANY_VALUE`."""

ANY_VALUE = {
    "task.operand_min": "any integer (task.operand_min <= task.operand_max is checked with both)",
    "task.operand_max": "any integer",
    "task.dataset_config": "any mapping; the dataset's own config checks it when the task is built",
    "task.system_prompt": "any text, the empty one included; null: the chat template's default",
}
"""Keys that take any value of their type, and why."""


def shown(value: Any, limit: int = 100) -> str:
    """repr(value), cut to about `limit` characters: a message stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def value_of(config: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), config)


def check_values(config: Config) -> None:
    """Every key's value against its rule (`RULES`); the first that fails is a ConfigError naming the key,
    what it must be, the value, and why."""
    for key, rule in RULES.items():
        value = value_of(config, key)
        if value is None or _passes(rule, value):
            continue
        why = f": {rule.why}" if rule.why else ""
        if key == "rollout.openai.url":
            why = f": {http_url_problem(value)}"
        raise ConfigError(f"{key} must be {rule.must}, got {shown(value)}{why}")


def _passes(rule: Rule, value: Any) -> bool:
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison's `not`
        return False
    try:
        return bool(rule.test(value))
    except TypeError:  # a value of a type the rule cannot compare: the type check missed it
        return False
