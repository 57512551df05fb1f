"""What GRPOConfig says of a value its field's annotation refuses, and of a name it does not take: one line
naming the setting and a value that works (gspo's config says the same of its own keys)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, Literal

from gspo.config import Config
from gspo.config.trl import RENAMED, TrlValueError, check_range, nested
from gspo.config.values import shown


def check_type(name: str, value: Any, tp: Any, default: Any) -> None:
    """One line naming `name`, what it takes and a value that works (the one meant, else `default`), for a
    value its annotation `tp` refuses (as gspo's config checks its own: an int is not a bool, a float takes
    an int, a string is no number)."""
    if _fits(value, tp):
        return
    kinds = [a for a in _union(tp) if a is not type(None)]
    what = " or ".join(_kind(a) for a in kinds) + (" or None" if type(None) in _union(tp) else "")
    if name == "gspo":
        what = "a dict of gspo's own sections, as Config's keyword arguments"
        example: Any = {"task": {"num_eval": 20}}
    else:
        example = _example(value, kinds, default)
        try:
            check_range(name, example, None)
        except TrlValueError:
            example = default
    raise TrlValueError(f"GRPOConfig({name}={shown(value)}): {name} is {what}", {name: example})


def _union(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _fits(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if typing.get_origin(tp) is Literal:
        return value in typing.get_args(tp)
    if typing.get_origin(tp) is list:
        return isinstance(value, (list, tuple)) and all(_fits(v, typing.get_args(tp)[0]) for v in value)
    if typing.get_origin(tp) is dict:
        return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, tp)


def _kind(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return f"a list of {_kind(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if typing.get_origin(tp) is dict:
        return "a dict"
    kinds = {bool: "True or False", int: "an integer", float: "a finite number", str: "a string"}
    return kinds.get(tp, getattr(tp, "__name__", str(tp)))


def _example(value: Any, kinds: list[Any], default: Any) -> Any:
    """A value of one of `kinds` that the user most likely meant by `value` ("10" -> 10, 8.5 -> 8, "yes"
    -> True), else the field's default."""
    text = value.strip().lower() if isinstance(value, str) else None
    if bool in kinds and text in ("yes", "true", "1", "on", "no", "false", "0", "off"):
        return text in ("yes", "true", "1", "on")
    for kind in (int, float):
        if kind not in kinds or isinstance(value, bool):
            continue
        try:
            number = kind(float(value)) if kind is int else float(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(number):
            return number
    return default


# ---- a name GRPOConfig does not take ----------------------------------------------------------------------
CLOSE = 0.85
"""How alike a name must be to one GRPOConfig takes to be suggested (difflib's ratio): a typo, not another
setting that shares words with it (max_prompt_length is not max_completion_length)."""


def unknown_name(name: str, value: Any, names: Collection[str]) -> str:
    """The message for a keyword GRPOConfig does not take (it takes `names`): the setting it most likely
    meant (a typo of one of `names`, or a gspo key of that name, in gspo={...} with the user's value), else
    how to give gspo's own keys."""
    said = f"GRPOConfig({name}={shown(value)})"
    gspo_keys = _gspo_keys()
    if name in {key.partition(".")[0] for key in gspo_keys}:  # a section (train={...}) or a top key
        return f"{said}: gspo's {name} goes in gspo=: GRPOConfig(gspo={{{name!r}: {shown(value)}}})"
    leaves: dict[str, str] = {}
    for key in gspo_keys:  # a leaf's first key ("every": eval.every)
        leaves.setdefault(key.rpartition(".")[2], key)
    trl = {key: trl for trl, key in RENAMED.items() if trl in names}
    if name in leaves and leaves[name] in trl:  # gspo's name of a TRL setting GRPOConfig takes
        fix = trl[leaves[name]]
        return f"{said}: gspo's {leaves[name]} is TRL's {fix}: GRPOConfig({fix}={shown(value)})"
    if name in leaves:
        return (
            f"{said}: GRPOConfig has no TRL setting {name!r}; gspo's key {leaves[name]} goes in gspo=: "
            f"GRPOConfig(gspo={_as_gspo(leaves[name], value)})"
        )
    close = difflib.get_close_matches(name, [*names, *leaves], n=1, cutoff=CLOSE)
    if close and close[0] in names:
        fix = f"GRPOConfig({close[0]}={shown(value)})"
        return f"{said}: GRPOConfig has no setting {name!r}; did you mean {close[0]!r}? {fix}"
    if close:  # a misspelt gspo key
        key = leaves[close[0]]
        return f"{said}: GRPOConfig has no setting {name!r}; did you mean gspo's {key}? GRPOConfig(gspo={_as_gspo(key, value)})"
    return (
        f"{said}: GRPOConfig has no setting {name!r}, TRL's or gspo's: gspo's own keys go in gspo={{...}}, as "
        "Config's keyword arguments (`gspo config` lists them): e.g. GRPOConfig(gspo={'task': {'num_eval': 20}})"
    )


@functools.cache
def _gspo_keys() -> list[str]:
    """Every key of gspo's Config, dotted ("train.micro_batch_tokens")."""

    def leaves(cls: type, prefix: str) -> list[str]:
        out = []
        for name, tp in typing.get_type_hints(cls).items():
            if name.startswith("_"):
                continue
            out += leaves(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [f"{prefix}{name}"]
        return out

    return leaves(Config, "")


def _as_gspo(key: str, value: Any) -> str:
    """A dotted gspo key and its value as gspo='s dict: "train.lr", 1e-5 -> {'train': {'lr': 1e-05}}."""
    return shown(nested({key: value}), 200)
