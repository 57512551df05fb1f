"""What each config key's value must be: one table (`RULES`), one rule per key, the reason in the message.

The types (int, float, str, a Literal's choices) are checked while a value is read (gspo.config.loading),
floats there also for being finite; this table adds the ranges and the non-empty strings. Keys whose type
says everything (booleans, Literal choices) have no rule. Checks that relate several keys are functions in
gspo.config.checks. ``None`` of an optional key means "the default" and is not checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gspo.config.engines import ENGINES
from gspo.config.values import ConfigError, shown
from gspo.core.registry import OBJECTIVES

SEED_MAX = 2**32 - 1
"""numpy's and torch's seeds are 32-bit unsigned."""

STEPS_MAX = 10**9
"""Steps, updates and cadences: a billion is years of training at any speed."""
TOKENS_MAX = 2**20
"""Tokens of one sequence: beyond every model's context (a million tokens)."""
BATCH_MAX = 2**16
"""Sequences, prompts or requests handled at once."""
GROUP_MAX = 1024
"""Completions of one prompt: GSPO and GRPO use 4 to 64; each costs a full generation."""
SECONDS_MAX = 10**7
"""A timeout or a time to keep something: about 115 days; threading refuses waits beyond about 2**33 s."""


@dataclass(frozen=True)
class Rule:
    """`test(value)` is True for a good value; `must` says what a good value is ("at least 1"); `why`
    is the reason, or the meaning of a special value, shown after it."""

    test: Callable[[Any], bool]
    must: str
    why: str = ""
    most: int | float | None = None
    """The largest good value, checked apart so that its message names it (`upto`)."""
    most_why: str = ""
    problem: Callable[[Any], str | None] | None = None
    """What is wrong with a value that passes `test`, in its own words (a name that is no choice, with the
    closest one), or None."""

    def upto(self, most: int | float, why: str) -> Rule:
        """This rule, and a value at most `most`: every number gets a ceiling that fits its use."""
        return dataclasses.replace(self, most=most, most_why=why)


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


def _choice_problem(what: str, choices: tuple[str, ...], own: str) -> Callable[[Any], str | None]:
    """A name that is one of ``choices`` or user code ("path/file.py:function", "module:function"): checked
    as it is set, so `config.train.objective = "sequence"` stops at that line (not at train time)."""

    def problem(value: str) -> str | None:
        if ":" in value or value in choices:
            return None
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        return f"{value!r} is not one of {', '.join(map(repr, choices))}, nor your own {what} ({own})" + (
            f"; did you mean {close[0]!r}?" if close else ""
        )

    return problem


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")

RULES: dict[str, Rule] = {
    "seed": between(0, SEED_MAX, why="numpy's and torch's seeds are 32-bit unsigned"),
    "output_dir": non_empty("an empty path would be the current folder"),
    "project": non_empty("the trackers' project name"),
    "report_to": names("each tracker once; []: metrics.jsonl only"),
    "completions_per_step": at_least(0, "0: none").upto(BATCH_MAX, "completions of one rollout batch"),
    "device": Rule(lambda v: _DEVICE.fullmatch(v) is not None, '"auto", "cpu", "cuda" or "cuda:N"'),
    "model.path": non_empty("a model directory, a .gguf file or a hub id in the Hugging Face cache"),
    "model.attn_implementation": non_empty('transformers\' attention, e.g. "sdpa" or "eager"'),
    "lora.rank": at_least(0, "0 trains all parameters").upto(2**16, "beyond any layer's width"),
    "lora.alpha": above(0, "the adapters' scale is alpha / rank"),
    "lora.dropout": between(0, 1, high_open=True, why="a probability below 1"),
    "lora.target_modules": names("the module names that get adapters", allow_empty=False),
    "task.name": non_empty(),
    "task.data_path": non_empty("a .jsonl, .csv or datasets directory"),
    "task.eval_data_path": non_empty("a .jsonl, .csv or datasets directory"),
    "task.prompt_field": non_empty("the column holding the prompt"),
    "task.answer_fields": names("columns passed to the rewards"),
    "task.num_train": at_least(1, "the prompt stream needs at least one training problem").upto(
        10**8, "problems are built in memory"
    ),
    "task.num_eval": at_least(0, "0: no held-out evaluation").upto(10**8, "problems are built in memory"),
    "task.operations": Rule(_operations, 'a non-empty string of the operators "+-*"'),
    "task.num_operands": at_least(2).upto(1000, "a prompt of more terms is no arithmetic problem"),
    "task.seed": between(0, SEED_MAX),
    "task.operand_min": between(-(10**15), 10**15, why="operands are numbers a prompt spells out"),
    "task.operand_max": between(-(10**15), 10**15, why="operands are numbers a prompt spells out"),
    "task.dataset": non_empty("a reasoning-gym dataset name, e.g. chain_sum"),
    "rewards": Rule(
        _reward_names, "at least one reward with a non-empty name", "e.g. rewards={exact_answer: 1.0}"
    ),
    "reward_timeout": at_least(0, "seconds; 0: no limit").upto(SECONDS_MAX, "0 sets no limit"),
    "reward_concurrency": at_least(1, "calls in flight at once").upto(BATCH_MAX, "calls in flight at once"),
    "reward_model.path": non_empty("a sequence-classification model folder"),
    "reward_model.batch_size": at_least(1).upto(BATCH_MAX, "texts scored at once"),
    "reward_model.max_length": at_least(1).upto(TOKENS_MAX, "beyond every model's context"),
    "judge.url": Rule(_url, 'an http:// or https:// address, e.g. "http://127.0.0.1:8000/v1"'),
    "judge.model": non_empty("the served model's name"),
    "judge.template": non_empty("a text file with $prompt and $completions"),
    "judge.api_key_env": Rule(lambda v: _ENV_NAME.fullmatch(v) is not None, "an environment variable's name"),
    "judge.max_tokens": at_least(1).upto(TOKENS_MAX, "beyond every model's context"),
    "judge.temperature": at_least(0, "0: greedy").upto(10, "far beyond any judge's useful range"),
    "rollout.openai.url": Rule(_url, 'an http:// or https:// address, e.g. "http://127.0.0.1:8000/v1"'),
    "rollout.openai.model": non_empty("the served model's name; null: the server's default"),
    "rollout.openai.concurrency": at_least(1).upto(1024, "requests open at once"),
    "rollout.openai.timeout": above(0, "seconds a request may take").upto(SECONDS_MAX, "seconds"),
    "rollout.openai.api_key_env": Rule(
        lambda v: _ENV_NAME.fullmatch(v) is not None, "an environment variable's name", "e.g. OPENAI_API_KEY"
    ),
    "rollout.llama_cpp.sync_every": at_least(1).upto(STEPS_MAX, "steps"),
    "rollout.llama_cpp.timeout": above(0, "seconds the server may take").upto(SECONDS_MAX, "seconds"),
    "rollout.vllm.kv_cache_gib": above(0, "GiB for vLLM's keys and values"),
    "rollout.vllm.timeout": above(0, "seconds the vLLM server may take").upto(SECONDS_MAX, "seconds"),
    "rollout.vllm.url": Rule(_url, 'an http:// or https:// address, e.g. "http://127.0.0.1:8000/v1"'),
    "rollout.vllm.weights_dir": non_empty("a folder both gspo and the vLLM server see"),
    "rollout.vllm.server_weights_dir": non_empty("the weights folder's path on the server's machine"),
    "rollout.vllm.nccl_address": non_empty("this machine's address, as the vLLM server reaches it"),
    "rollout.prompts_per_step": at_least(1).upto(BATCH_MAX, "prompts of one step, generated together"),
    "rollout.group_size": at_least(
        2,
        "advantages compare each completion with the others of its prompt's group, so with one every "
        "advantage is 0 and nothing is learned",
    ).upto(GROUP_MAX, "GSPO and GRPO use 4 to 64 completions per prompt; each costs a full generation"),
    "rollout.max_extra_groups": at_least(0, "0: no extra draws").upto(
        BATCH_MAX, "groups drawn for one rollout batch beyond its own"
    ),
    "rollout.max_new_tokens": at_least(1).upto(TOKENS_MAX, "beyond every model's context"),
    "rollout.temperature": above(0, "the logits are divided by it"),
    "rollout.top_p": between(0, 1, low_open=True, why="1.0: off"),
    "rollout.generation_batch_size": at_least(1).upto(BATCH_MAX, "sequences decoded at once"),
    "rollout.lag": at_least(0, "0: the synchronous loop").upto(
        16, "each version of lag adds staleness, and a batch held in memory"
    ),
    "rollout.engine": dataclasses.replace(
        non_empty("a built-in's name or your own factory, 'path/file.py:function'"),
        problem=_choice_problem(
            "sampler factory",
            tuple(ENGINES),
            "'path/file.py:function' or 'module:function', docs/rollout_servers.md",
        ),
    ),
    "train.objective": dataclasses.replace(
        non_empty("a built-in's name or your own, 'path/file.py:function'"),
        problem=_choice_problem(
            "objective", OBJECTIVES, "'path/file.py:function' or 'module:function', docs/objectives.md"
        ),
    ),
    "train.eps_low": at_least(0),
    "train.eps_high": at_least(0),
    "train.tau_pos": above(0, "SAPO's gate divides by it"),
    "train.tau_neg": above(0, "SAPO's gate divides by it"),
    "train.steps": at_least(1).upto(STEPS_MAX, "a billion steps is years of training"),
    "train.minibatches": at_least(1).upto(BATCH_MAX, "updates per step"),
    "train.micro_batch_tokens": at_least(1).upto(2**26, "tokens in one forward pass"),
    "train.lr": above(0),
    "train.weight_decay": at_least(0),
    "train.adam_betas": Rule(_adam_betas, "two numbers in [0, 1)", "AdamW's moment decays"),
    "train.warmup_updates": at_least(0, "0: no warm-up").upto(
        STEPS_MAX, "a billion steps is years of training"
    ),
    "train.max_grad_norm": at_least(0, "0: no clipping"),
    "train.beta": at_least(0, "0: no KL term"),
    "train.entropy_coef": at_least(0, "0: no entropy bonus"),
    "train.entropy_target": above(0, "nats per token; None: a fixed entropy_coef"),
    "train.entropy_coef_delta": above(0, "the adaptive coefficient's step per update"),
    "train.entropy_coef_max": above(0, "the adaptive coefficient's ceiling"),
    "train.pack_length": at_least(1).upto(TOKENS_MAX, "beyond every model's context"),
    "train.logprob_chunk_size": at_least(1).upto(TOKENS_MAX, "tokens scored at once"),
    "train.sampler_correction_min": at_least(0),
    "train.sampler_correction_max": above(0),
    "train.opsm_delta": at_least(0, "null disables it"),
    "train.warn_after_flat_steps": at_least(0, "0: never").upto(
        STEPS_MAX, "a billion steps is years of training"
    ),
    "eval.every": at_least(0, "0: only before and after training").upto(
        STEPS_MAX, "a billion steps is years of training"
    ),
    "eval.max_new_tokens": at_least(1).upto(TOKENS_MAX, "beyond every model's context"),
    "eval.batch_size": at_least(1).upto(BATCH_MAX, "sequences decoded at once"),
    "checkpoint.every": at_least(0, "0: only at the end").upto(
        STEPS_MAX, "a billion steps is years of training"
    ),
    "checkpoint.keep": at_least(1).upto(10**6, "checkpoints on disk"),
    "distributed.timeout_minutes": above(0).upto(SECONDS_MAX // 60, "minutes"),
    "distributed.sequence_parallel": at_least(1, "1: every row whole on one rank").upto(
        BATCH_MAX, "ranks sharing a row"
    ),
    "serve.host": non_empty('the address to listen on, e.g. "127.0.0.1"'),
    "serve.port": between(0, 65535, why="0: any free port"),
    "serve.api_key_env": Rule(
        lambda v: _ENV_NAME.fullmatch(v) is not None, "an environment variable's name", "e.g. GSPO_API_KEY"
    ),
    "serve.model_name": non_empty("the name /v1/models lists"),
    "serve.slots": at_least(1).upto(BATCH_MAX, "sequences decoded at once"),
    "serve.max_tokens": at_least(1).upto(TOKENS_MAX, "beyond every model's context"),
    "serve.max_n": at_least(1).upto(GROUP_MAX, "completions of one request"),
    "serve.max_waiting": at_least(1).upto(10**6, "samples queued"),
    "serve.request_timeout": above(0, "seconds a request may take").upto(SECONDS_MAX, "seconds"),
    "serve.max_body_bytes": between(1024, 2**30, why="bytes of one request body"),
    "serve.max_staleness": at_least(0, "0: only the current version's completions").upto(
        STEPS_MAX, "versions"
    ),
    "serve.max_records": at_least(1).upto(10**8, "records kept in memory"),
    "serve.record_ttl": above(0, "seconds a record is kept").upto(SECONDS_MAX, "seconds"),
    "serve.train_timeout": above(0, "seconds a train call may wait for the one before it").upto(
        SECONDS_MAX, "seconds"
    ),
}
"""One rule per key (dotted name); tests/test_config.py checks that every key without a Literal or bool
type has one, or is in `ANY_VALUE`."""

ANY_VALUE = {
    "task.dataset_config": "any mapping; the dataset's own config checks it when the task is built",
    "task.system_prompt": "any text, the empty one included; null: the chat template's default",
}
"""Keys that take any value of their type, and why."""


def value_of(config: Any, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), config)


def check_values(config: Any) -> None:
    """Every key's value of a `Config` against its rule (`RULES`); the first that fails is a ConfigError
    naming the key, what it must be, the value, and why."""
    for key in RULES:
        check_value(key, value_of(config, key))


def check_value(key: str, value: Any) -> None:
    """`value` of `key` against its rule, if it has one (None: the default, not checked)."""
    rule = RULES.get(key)
    if rule is None or value is None:
        return
    if not _passes(rule, value):
        why = f": {rule.why}" if rule.why else ""
        if key == "rollout.openai.url":
            why = f": {http_url_problem(value)}"
        raise ConfigError(f"{key} must be {rule.must}, got {shown(value)}{why}")
    if rule.most is not None and value > rule.most:
        raise ConfigError(f"{key} must be at most {rule.most:,}, got {shown(value)}: {rule.most_why}")
    if rule.problem is not None and (problem := rule.problem(value)) is not None:
        raise ConfigError(f"{key}: {problem}")


def _passes(rule: Rule, value: Any) -> bool:
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison's `not`
        return False
    try:
        return bool(rule.test(value))
    except TypeError:  # a value of a type the rule cannot compare: the type check missed it
        return False
