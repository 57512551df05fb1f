"""User code named in a config: reward functions and objectives given as ``"module:function"`` or
``"path/file.py:function"``, imported the same way for both (and run only under the trust rules of
gspo.training.trust)."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gspo.config.loading import code_file
from gspo.core.surrogates import line_in


class CodeFileError(ValueError):
    """A file of user code that cannot be imported: it raised, or called sys.exit, while being run."""


def raised(error: BaseException, kind: str = "reward") -> str:
    """What a call did: "called sys.exit(3)" or "raised ValueError: ..."."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r}) (a {kind} returns its values; it does not end the process)"
    return f"raised {type(error).__name__}: {error}"


def load_function(name: str, kind: str) -> Callable[..., Any]:
    """The function ``name`` ("package.module:function" or "path/file.py:function") names; ``kind`` ("reward",
    "objective") words the errors. A file is executed afresh on every call, so an edited one is picked up."""
    source, _, attribute = name.rpartition(":")
    file = code_file(name)
    if file is not None:
        module = _import_file(file, kind)
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as error:
            raise ImportError(f"{kind} {name!r}: cannot import module {source!r}: {error}") from error
    function = getattr(module, attribute, None)
    if function is None:
        available = sorted(
            key for key, value in vars(module).items() if callable(value) and not key.startswith("_")
        )
        close = difflib.get_close_matches(attribute, available, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{kind} {name!r}: {source} has no {attribute!r}; callables: {available}{hint}")
    if not callable(function):
        raise TypeError(f"{kind} {name!r} is a {type(function).__name__}, not a callable")
    return function


def _import_file(path: Path, kind: str) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{kind} file not found: {path}")
    module_name = f"gspo_user_{kind}_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[module_name]
        if isinstance(error, KeyboardInterrupt):
            raise
        raise CodeFileError(
            f"{kind} file {path}{line_in(error, path)}: importing it {raised(error, kind)}"
        ) from error
    return module
