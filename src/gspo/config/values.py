"""A config value against its field's type: the one check every way of setting a key goes through (a YAML
file, a `key=value` override, `Config(...)`'s keyword arguments, an assignment in Python), so each names
the key and what it expected in the same words.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal

from gspo.config.renamed import renamed_in_section

LIST_MAX = 1024
"""Entries of a config list or mapping (LoRA's module names, answer columns, rewards, trackers): checked
before any entry is read, so a list of millions is refused at once (a 5M-entry target_modules took 266 s)."""


class ConfigError(ValueError):
    """A config file or override that cannot be applied; the message names the field and the fix."""


def shown(value: Any, limit: int = 100) -> str:
    """repr(value) on one line (an object's repr may span several: a Dataset's), cut to about `limit`
    characters: a message stays one readable line."""
    text = re.sub(r"\s*\n\s*", " ", repr(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _section(value: Any, tp: Any, where: str) -> Any:
    """A section: the section itself, or a mapping of its keys (a renamed key under its new name)."""
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of its fields, got {shown(value)}")
    try:
        value = renamed_in_section(where, value)  # a key of an earlier version, under its new name
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return tp(**value)  # each key checked as it is set


def _union(value: Any, tp: Any, where: str) -> Any:
    """The first of the union's types that takes ``value`` (None where the union has it)."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, where)
        except ConfigError as error:
            errors.append(str(error))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {shown(value)} is not a {_type_name(tp)}")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats, a mapping of a section's
    keys becomes that section)."""
    if tp is Any:  # free-form values (task.dataset_config), checked where they are used
        return value
    if where in SPELLINGS:
        value = SPELLINGS[where](value)
    if dataclasses.is_dataclass(tp):  # a section: the section itself, or its keys
        return _section(value, tp, where)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(value, tp, where)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where}: {shown(value)} is not one of {choices}")
        return value
    if origin is list:
        _check_entries(value, (list, tuple), "a list", where)
        return [coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _check_entries(value, dict, "a mapping", where)
        return {coerce(k, args[0], where): coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):  # PyYAML reads "1e-5" (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {shown(value)}")
        if not math.isfinite(value):  # NaN passes every `<= 0` check
            raise ConfigError(f"{where}: expected a finite number, got {shown(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {shown(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {shown(value)}{_STRING_HINTS.get(where, '')}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def _check_entries(value: Any, kinds: type | tuple[type, ...], what: str, where: str) -> None:
    """`value` is a list or mapping (`kinds`) of at most `LIST_MAX` entries: checked before its entries are
    read one by one."""
    if not isinstance(value, kinds):
        raise ConfigError(f"{where}: expected {what}, got {shown(value)}")
    if len(value) > LIST_MAX:
        raise ConfigError(
            f"{where} holds {len(value):,} entries, more than the {LIST_MAX:,} any config list may hold "
            "(module names, columns, rewards, trackers)"
        )


_STRING_HINTS = {
    "task.data_path": " (a file's path; rows in memory, a datasets.Dataset, go to train(config, data=rows))",
    "model.path": " (a folder's or .gguf file's path; a model object is not a config value)",
}
"""What a Python user most likely meant by a non-string where a path goes."""


def _trackers(value: Any) -> Any:
    """report_to as TRL (transformers) spells it too: "none" is [], one tracker's name is a list of it."""
    if value == "all":
        raise ConfigError(
            "report_to='all': name the trackers gspo should send to, e.g. report_to=['tensorboard', 'wandb'] "
            "(of tensorboard, wandb, mlflow, trackio)"
        )
    if value == "none" or value is None:
        return []
    return [value] if isinstance(value, str) else value


SPELLINGS = {"report_to": _trackers}
"""Keys that take other spellings of their values, turned into the key's own before the type check."""
