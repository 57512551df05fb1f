"""Loading a config: defaults, then a YAML file, then `section.key=value` overrides; saving and describing it.

An unknown key is an error naming the closest valid key; a value of the wrong type names the field and the
expected type. The resolved config is written into the run folder as ``config.yaml``.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import inspect
import itertools
import os
import re
import textwrap
import warnings
from pathlib import Path
from typing import Any

import yaml

from gspo.config.checks import validate
from gspo.config.renamed import RENAMED, DeprecatedKey, note_renamed
from gspo.config.schema import Config
from gspo.config.section import Section, unknown_key
from gspo.config.values import ConfigError, shown
from gspo.files import replace_file


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


def _apply(target: Section, values: dict[str, Any], prefix: str) -> None:
    """`values` set into the section `target`, a mapping into its subsection key by key (a file sets some
    keys of a section, the defaults keep the rest); each value is checked as it is set."""
    names = [f.name for f in dataclasses.fields(target)]
    for key, value in values.items():
        where = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(unknown_key(type(target), key, value))
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping of its fields, got {shown(value)}")
            _apply(current, value, f"{where}.")
        else:
            setattr(target, key, value)


def _set_entry(config: Section, key: str, value: Any) -> bool:
    """``key`` names one entry of a mapping field (``rewards.number_format=0``, ``rewards.my.py:f=1``): set
    that entry, keep the others, and say so; False for any other key. (A mapping given whole,
    ``rewards={...}``, replaces it.)"""
    parts = key.split(".")
    target: Any = config
    for i, part in enumerate(parts[:-1]):
        current = getattr(target, part, None)
        if isinstance(current, dict):
            setattr(target, part, {**current, ".".join(parts[i + 1 :]): value})
            return True
        if not dataclasses.is_dataclass(current):
            return False
        target = current
    return False


def _nest(key: str, value: Any) -> dict[str, Any]:
    *sections, leaf = key.split(".")
    nested: dict[str, Any] = {leaf: value}
    for part in reversed(sections):
        nested = {part: nested}
    return nested


def _rename_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A nested config mapping with every key of `RENAMED` moved to its new place (a copy)."""
    data = copy.deepcopy(data)
    for old, new in RENAMED.items():
        *sections, leaf = old.split(".")
        parent = data
        for section in sections:
            parent = parent.get(section) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or leaf not in parent:
            continue
        value = parent.pop(leaf)
        if not parent and len(sections) > 1:  # an emptied old section (rollout.server) goes too
            _pop_path(data, sections)
        for target in new:
            *target_sections, target_leaf = target.split(".")
            node = data
            for section in target_sections:
                node = node.setdefault(section, {})
                if not isinstance(node, dict):
                    raise ConfigError(
                        f"{where}{section}: expected a mapping of its fields, got {shown(node)}"
                    )
            if target_leaf in node:
                raise ConfigError(f"{where}: both {old} and {target} are set; keep only {target}")
            node[target_leaf] = value
        note_renamed(old, new, stacklevel=4)
    _migrate_tensorboard(data, where)
    return data


def _migrate_tensorboard(data: dict[str, Any], where: str) -> None:
    """`tensorboard: true/false` of earlier gspo versions is `report_to` now: true keeps the default
    (["tensorboard"]), false is []; in place, with a deprecation note."""
    if "tensorboard" not in data:
        return
    value = data.pop("tensorboard")
    if not isinstance(value, bool):
        raise ConfigError(
            f"{where}: tensorboard: expected true or false, got {shown(value)} (report_to replaces it)"
        )
    if "report_to" in data:
        raise ConfigError(f"{where}: both tensorboard and report_to are set; keep only report_to")
    data["report_to"] = ["tensorboard"] if value else []
    warnings.warn(
        f"config key tensorboard is now report_to: tensorboard: {str(value).lower()} loads as report_to: "
        f"{data['report_to']} (rename it in your config)",
        DeprecatedKey,
        stacklevel=4,
    )


def _pop_path(data: dict[str, Any], sections: list[str]) -> None:
    node = data
    for section in sections[:-1]:
        node = node[section]
    node.pop(sections[-1])


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `section.key=value` overrides (values parsed as YAML)."""
    config = Config()
    if path is not None:
        path = Path(path)
        _check_config_file(path)
        try:
            data = _read_yaml(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(error)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections at the top level")
        data = _rename_keys(data, f"{path}")
        _apply(config, data, "")
        _anchor_paths(config, data, path)
    for override in overrides:
        key, sep, raw = override.partition("=")
        shown = repr(override if len(override) <= 120 else override[:100] + "...")  # messages stay one line
        if not sep or not key:
            raise ConfigError(f"override {shown} is not of the form section.key=value (e.g. train.lr=1e-5)")
        value = None
        try:
            value = _read_yaml(raw) if raw else ""
            if _set_entry(config, key, value):
                continue
            _apply(config, _rename_keys(_nest(key, value), override), "")
        except (ConfigError, yaml.YAMLError) as error:
            if isinstance(error, ConfigError) and isinstance(value, str):  # refused as the text it is
                raise
            # YAML reads some plain strings as other types ("-" is a list, "on" a bool): a string field
            # takes the text as written
            try:
                _apply(config, _rename_keys(_nest(key, raw), override), "")
            except ConfigError:
                if isinstance(error, yaml.YAMLError):
                    raise ConfigError(
                        f"override {shown}: the value is not valid YAML: {_yaml_problem(error)}"
                    ) from None
                raise error from None
        _anchor_paths(config, _nest(key, True), None)
    validate(config)
    return config


CONFIG_MAX_BYTES = 2**20
"""A config file's ceiling: `gspo config`'s every key with its comment is about 20 KB; a larger file is not
a config (a 50 MB one took 68 s to read before it was accepted)."""


def _check_config_file(path: Path) -> None:
    """A config path that is a readable file within `CONFIG_MAX_BYTES`, or a ConfigError saying what it is."""
    if path.is_dir():
        raise ConfigError(
            f"config file {str(path)!r} is a folder, not a YAML file: name the config file in it"
        )
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} is not a regular file (a FIFO or a device?)")
    size = path.stat().st_size
    if size > CONFIG_MAX_BYTES:
        raise ConfigError(
            f"config file {str(path)!r} holds {size:,} bytes, more than a config file's {CONFIG_MAX_BYTES:,} "
            "(every key with its comment is about 20 KB): is it the right file?"
        )


def code_file(name: str) -> Path | None:
    """The file of a reward or objective named "path/to/file.py:function", else None (a built-in,
    "module:function")."""
    source, colon, _ = name.rpartition(":")  # rpartition keeps a Windows drive letter ("C:\\r.py:fn")
    if colon and (source.endswith(".py") or "/" in source or "\\" in source):
        return Path(source)
    return None


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face hub model id, "organisation/name": model.path keeps one as written when no local path of
that name exists (gspo.models.loading.model_location looks it up in the Hugging Face cache)."""


def _anchor_paths(config: Config, given: dict[str, Any], config_file: Path | None) -> None:
    """Make the input paths set in `given` (model.path, task.data_path, reward_model.path, judge.template, reward and
    objective files) absolute: relative to
    the folder of the config file that names them, or for an override (`config_file` None) to the working
    directory, as any command-line path. A task's config, data and rewards then travel together and work
    from any directory, and the run folder's config.yaml keeps pointing at them when resumed elsewhere."""
    base = config_file.parent if config_file is not None else Path.cwd()

    def anchored(value: str, key: str) -> str:
        written = Path(value).expanduser()
        if written.is_absolute():
            return str(written)
        target = base / written
        if key == "model.path" and HUB_ID.fullmatch(value) and not target.exists() and not written.exists():
            return value  # a hub id ("org/name"): the loader finds it in the Hugging Face cache
        if config_file is not None and not target.exists() and written.exists():
            raise ConfigError(
                f"{config_file}: {key}: {value!r} is read relative to the config file's folder, where "
                f"{target} does not exist (it exists relative to the working directory): write "
                f"{os.path.relpath(written, base)!r} or an absolute path"
            )
        return os.path.abspath(target)

    sections = {
        name: given.get(name) if isinstance(given.get(name), dict) else {}
        for name in ("model", "task", "reward_model", "judge")
    }
    if sections["model"].get("path") is not None and config.model.path:
        config.model.path = anchored(config.model.path, "model.path")
    for section, key in (
        ("task", "data_path"),
        ("task", "eval_data_path"),
        ("reward_model", "path"),
        ("judge", "template"),
    ):
        obj = getattr(config, section)
        if sections[section].get(key) is not None and getattr(obj, key):
            setattr(obj, key, anchored(getattr(obj, key), f"{section}.{key}"))
    for section_name, key in (("train", "objective"), ("rollout", "engine")):
        section = given.get(section_name) if isinstance(given.get(section_name), dict) else {}
        obj = getattr(config, section_name)
        file = code_file(getattr(obj, key))
        if section.get(key) is not None and file is not None:
            function = getattr(obj, key).rpartition(":")[2]
            setattr(obj, key, f"{anchored(str(file), f'{section_name}.{key}')}:{function}")
    if given.get("rewards") is not None:
        rewards = {}
        for name, weight in config.rewards.items():
            file = code_file(name)
            if file is not None:
                name = f"{anchored(str(file), f'rewards.{name}')}:{name.rpartition(':')[2]}"
            rewards[name] = weight
        config.rewards = rewards


class _TooDeep(yaml.YAMLError):
    """YAML nested deeper than the reader can follow; `problem_mark` is where."""

    def __init__(self, mark: Any) -> None:
        super().__init__(f"nested more than {YAML_MAX_DEPTH} levels deep")
        self.problem, self.problem_mark = str(self), mark


YAML_MAX_DEPTH = 100
"""No config nests more than a few levels; PyYAML's reader recurses per level and fails near 1000."""


_OPENS = (
    yaml.BlockMappingStartToken,
    yaml.BlockSequenceStartToken,
    yaml.FlowMappingStartToken,
    yaml.FlowSequenceStartToken,
)
_CLOSES = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a mapping that names a key twice: PyYAML keeps the last one, so a
    second `train:` section silently dropped the first (its lr among them)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            with contextlib.suppress(TypeError):  # an unhashable key: the constructor below says so
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        f"in the mapping from line {seen[key].line + 1}",
                        seen[key],
                        f"{shown(key)} is set twice (first on line {seen[key].line + 1}): YAML would keep only "
                        "the last one; merge them into one",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _read_yaml(text: str) -> Any:
    """yaml.safe_load, with a key set twice in one mapping, and nesting that would exhaust Python's
    recursion, YAML errors at their place."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
    except RecursionError:
        pass
    depth = 0  # scanning is iterative: find where the nesting passes the limit
    for token in yaml.scan(text):
        if isinstance(token, _OPENS):
            depth += 1
            if depth > YAML_MAX_DEPTH:
                raise _TooDeep(token.start_mark)
        elif isinstance(token, _CLOSES):
            depth -= 1
    raise _TooDeep(None)


def _yaml_problem(error: Exception) -> str:
    """A YAML error on one line: what is wrong and where."""
    if not isinstance(error, yaml.YAMLError):
        return f"not UTF-8 text ({error})"
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML, by replacement (gspo.files): a kill leaves the old file or the new
    one, whole."""
    replace_file(path, yaml.safe_dump(to_dict(config), sort_keys=False))


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
