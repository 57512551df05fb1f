"""The base of the config's sections: every value is checked when it is set, by keyword argument or by
assignment, so a mistake in Python (`config.train.lr = "abc"`, `Config(learning_rate=1e-5)`) stops at that
line with one message naming the key, instead of deep inside a run.

A section checks each key's type (gspo.config.values) and its own range (gspo.config.rules); what relates
several keys waits for `validate` (gspo.config.checks), since a user may set them one at a time.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, ClassVar

from gspo.config.rules import check_value
from gspo.config.trl import RENAMED, TRL_NAMES, trl_hint
from gspo.config.values import ConfigError, coerce, shown


class Section:
    """A config dataclass whose values are checked as they are set (module docstring). ``key``, given in
    the class statement, is its dotted place in the config ("rollout.openai"; "" for the top)."""

    _key: ClassVar[str] = ""

    def __init_subclass__(cls, key: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._key = key

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # before the dataclass's __init__, whose TypeError for an unknown keyword names no fix
        for name, value in kwargs.items():
            if name not in _fields(cls):
                raise ConfigError(unknown_key(cls, name, value, python=True))
        return super().__new__(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        fields = _fields(type(self))
        if name not in fields:
            raise ConfigError(unknown_key(type(self), name, value))
        key = f"{self._key}.{name}" if self._key else name
        value = coerce(value, fields[name], key)
        check_value(key, value)
        object.__setattr__(self, name, value)


@functools.cache
def _fields(cls: type) -> dict[str, Any]:
    """A section's fields and their types (resolved once per class)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _leaves(cls: type, prefix: str = "") -> list[str]:
    """Every key below `cls`, dotted relative to it."""
    out = []
    for name, tp in _fields(cls).items():
        if dataclasses.is_dataclass(tp):
            out.extend(_leaves(tp, f"{prefix}{name}."))
        else:
            out.append(f"{prefix}{name}")
    return out


def suggestion(cls: type, name: str) -> str | None:
    """The key below `cls` (dotted relative to it) that an unknown `name` most likely meant: TRL's name for
    it, a key of that name in a subsection, or a close spelling; None if none is close."""
    place = f"{cls._key}." if getattr(cls, "_key", "") else ""  # type: ignore[attr-defined]
    trl = RENAMED.get(name)
    if trl is not None and trl.startswith(place):
        return trl.removeprefix(place)
    leaves = _leaves(cls)
    same = [leaf for leaf in leaves if leaf.rpartition(".")[2] == name]
    if same:
        return same[0]
    close = difflib.get_close_matches(name, list(_fields(cls)), n=1, cutoff=0.5)
    return close[0] if close else None


def unknown_key(cls: type, name: str, value: Any = None, *, python: bool = False) -> str:
    """The message for key `name`, which section `cls` does not have: the key it most likely meant, and with
    ``python`` (keyword arguments) how to write it there."""
    place = getattr(cls, "_key", "")
    if not place and name in TRL_NAMES:  # at the top, where TRL's flat names land: its value translated
        return trl_hint(name, value, python=python)
    where = f"{place}.{name}" if place else name
    guess = suggestion(cls, str(name)[:100])
    if guess is None:
        return f"unknown config key {shown(where)}; valid keys: {', '.join(_fields(cls))}"
    from_trl = f" (TRL's {name})" if name in RENAMED else ""
    message = f"unknown config key {shown(where)}; did you mean {guess!r}{from_trl}?"
    if python:
        message += f" {cls.__name__}({_keyword(guess, value)})"
    return message


def _keyword(key: str, value: Any) -> str:
    """`key` (dotted) as a keyword argument: "train.lr", 1e-5 -> `train={'lr': 1e-05}`."""
    *sections, leaf = key.split(".")
    text = f"{leaf!r}: {shown(value)}" if sections else f"{leaf}={shown(value)}"
    for depth, section in enumerate(reversed(sections)):
        text = f"{{{text}}}"
        text = f"{section}={text}" if depth == len(sections) - 1 else f"{section!r}: {text}"
    return text
