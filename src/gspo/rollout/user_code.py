"""User code named in a config: reward functions and objectives given as ``"module:function"`` or
``"path/file.py:function"``, imported the same way for both (and run only under the trust rules of
gspo.run.trust)."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
import sysconfig
import traceback
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


def raised_where(error: BaseException, function: Callable[..., Any]) -> str:
    """ " in FILE:LINE `source`": the innermost line of the user's code that `error` passed through, or ""
    where it passed through none (a built-in of gspo's, a call refused before it ran). The user's code:
    `function`'s own file, and any file outside gspo and the Python installation's libraries (a helper
    module of theirs)."""
    own = getattr(inspect.unwrap(function), "__code__", None)
    own_file = own.co_filename if own is not None else None
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith(_GSPO)
        and (frame.filename == own_file or not frame.filename.startswith(_LIBRARIES))
    ]
    if not frames:
        return ""
    frame = frames[-1]
    source = f" `{frame.line}`" if frame.line else ""
    return f" in {frame.filename}:{frame.lineno}{source}"


_GSPO = str(Path(__file__).resolve().parents[1])
_LIBRARIES = (
    "<",  # frozen and generated code: <frozen importlib._bootstrap>, <string>
    *{sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")},
)
"""Where code that is not the user's lives (besides gspo): the installation's standard library and
site-packages, where a reward named "package.module:function" may live too (its own file counts)."""


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
