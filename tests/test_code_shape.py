"""The code's shape (STYLE): no function over ~60 lines, no public function over ~8 parameters, in the
library (src/gspo) and in the experiment scripts (scripts/, scripts/experiments/); and in the tests, no
tolerance tighter than the dtype's default without a comment that says where it comes from.

Counted with `ast`: a function's lines without its docstring; parameters without self / cls. Past these
limits a function wants splitting and a call wants a record (a dataclass). `python tests/test_code_shape.py`
prints every function over the limits, the known ones included.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SRC = ROOT / "src" / "gspo"
SCRIPTS = ROOT / "scripts"
MAX_LINES = 60
MAX_PUBLIC_PARAMETERS = 8
KNOWN = {
    # the chunked log-prob backward passes read as one loop over the chunks (61-63 lines)
    "core/logprobs.py:_backward_chunks",
    "core/triton_logprobs.py:backward",
    # 9: model, input_ids and token_logprobs' seven keyword options it passes on
    "core/logprobs.py:causal_lm_logprobs",
    # 10: the one Python entry point of `gspo train`: the config, the command line's resume options, and
    # the Trainer's inputs (reward functions, data, eval data, log hooks) it passes on
    "training/launch.py:train",
    # 9: the sampler, problems and rewards, and the draw's settings, each a `gspo eval` option
    "training/evaluation.py:evaluate",
}
"""Functions over the limits that stay for now, each with its reason."""


def oversized(root: Path = SRC) -> dict[str, str]:
    """``{"path:function": "N lines, M parameters"}`` for every function over the limits under ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant
            )
            lines = node.end_lineno - node.lineno + 1
            if docstring and isinstance(first.value.value, str):
                lines -= first.end_lineno - first.lineno + 1
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            parameters = len([n for n in names if n not in ("self", "cls")])
            public = not node.name.startswith("_")
            if lines > MAX_LINES or (public and parameters > MAX_PUBLIC_PARAMETERS):
                found[f"{path.relative_to(root).as_posix()}:{node.name}"] = (
                    f"{lines} lines, {parameters} parameters"
                )
    return found


def test_no_new_long_function_or_wide_public_signature() -> None:
    found = oversized() | {f"scripts/{name}": shape for name, shape in oversized(SCRIPTS).items()}
    new = {name: shape for name, shape in found.items() if name not in KNOWN}
    assert not new, (
        f"split these functions or pass a record (limits {MAX_LINES} lines, {MAX_PUBLIC_PARAMETERS} parameters): {new}"
    )


def test_every_known_exception_is_still_over_the_limits() -> None:
    """A function split since it was listed leaves KNOWN, so that the list stays the whole truth."""
    found = oversized() | {f"scripts/{name}": shape for name, shape in oversized(SCRIPTS).items()}
    assert not KNOWN - found.keys(), f"no longer over the limits, remove from KNOWN: {KNOWN - found.keys()}"


def test_the_counting_sees_a_long_function_and_a_wide_signature(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    wide = ", ".join(f"a{i}" for i in range(MAX_PUBLIC_PARAMETERS + 1))
    (tmp_path / "m.py").write_text(
        f'def long():\n    """Docstring lines do not count."""\n{body}\n\n\n'
        f"def wide({wide}):\n    pass\n\n\ndef _private_wide({wide}):\n    pass\n\n\n"
        f'def fits():\n    """Doc."""\n' + "\n".join(f"    y{i} = {i}" for i in range(MAX_LINES - 1)) + "\n",
        encoding="utf-8",
    )
    assert oversized(tmp_path) == {
        "m.py:long": f"{MAX_LINES + 1} lines, 0 parameters",
        "m.py:wide": f"2 lines, {MAX_PUBLIC_PARAMETERS + 1} parameters",
    }


# the comparisons and their default tolerances: (relative name, absolute name, relative, absolute); for
# assert_close those of float32, the loosest dtype most tests compare (bf16's are looser and say so)
DEFAULT_TOLERANCES = {
    "assert_close": ("rtol", "atol", 1.3e-6, 1e-5),
    "allclose": ("rtol", "atol", 1e-5, 1e-8),
    "isclose": ("rtol", "atol", 1e-5, 1e-8),
    "approx": ("rel", "abs", 1e-6, 1e-12),
}


def _constant(node: ast.expr) -> float | None:
    """The value of a number written as a constant expression (``1e-5``, ``2**-7``); None otherwise."""
    allowed = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
    if not all(isinstance(n, allowed) for n in ast.walk(node)):
        return None
    value = eval(compile(ast.Expression(node), "<tolerance>", "eval"), {"__builtins__": {}})
    return float(value) if isinstance(value, (int, float)) else None


def _tight(call: ast.Call) -> bool:
    """Whether a comparison is given a tolerance tighter than its default, or one written as a name."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    rel_name, abs_name, rel_default, abs_default = DEFAULT_TOLERANCES[name]
    defaults = {rel_name: rel_default, abs_name: abs_default}
    for keyword in call.keywords:
        if keyword.arg is None:  # **tolerance: a dict defined elsewhere
            return True
        if keyword.arg in defaults:
            value = _constant(keyword.value)
            if value is None or value < defaults[keyword.arg]:
                return True
    return False


def uncommented_tolerances(root: Path = TESTS) -> list[str]:
    """``path:line`` of every comparison with a tolerance tighter than the default and no comment saying
    why: on the statement's own lines, or in the comment lines right above it."""
    found = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        comments = {
            tok.start[0]
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT
        }
        lines = text.splitlines()
        tree = ast.parse(text)
        for statement in ast.walk(tree):
            if not isinstance(statement, ast.stmt) or isinstance(
                statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.With, ast.If)
            ):
                continue
            calls = [
                n
                for n in ast.walk(statement)
                if isinstance(n, ast.Call)
                and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in DEFAULT_TOLERANCES
            ]
            if not any(_tight(call) for call in calls):
                continue
            own = set(range(statement.lineno, statement.end_lineno + 1))
            above, line = set(), statement.lineno - 1
            while line >= 1 and lines[line - 1].lstrip().startswith("#"):
                above.add(line)
                line -= 1
            if not (own | above) & comments:
                found.append(f"{path.name}:{statement.lineno}")
    return found


def test_every_tight_tolerance_says_where_it_comes_from() -> None:
    """A tolerance is a claim about every CPU: an error bound or an exact-by-design argument, in a comment."""
    found = uncommented_tolerances()
    assert not found, (
        f"say where these tolerances come from (an error bound, or why exact), in a comment: {found}"
    )


def test_the_tolerance_walk_sees_a_bare_tight_tolerance(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(
        "import torch\n"
        "torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)\n"
        "torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)\n"
        "# exact: the same reduction order\n"
        "torch.testing.assert_close(a, b, rtol=0, atol=0)\n"
        "assert torch.allclose(a, b, atol=2**-30)  # bound: ...\n"
        "torch.testing.assert_close(a, b, **TOLERANCE)\n"
        "assert x == pytest.approx(y, rel=1e-4)\n",
        encoding="utf-8",
    )
    assert uncommented_tolerances(tmp_path) == ["t.py:2", "t.py:7"]


if __name__ == "__main__":
    for name, shape in (oversized() | {f"scripts/{n}": s for n, s in oversized(SCRIPTS).items()}).items():
        print(f"{name}: {shape}{'  (known)' if name in KNOWN else ''}")
