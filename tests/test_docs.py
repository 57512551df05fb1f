"""Docs are tests: README.md runs top to bottom, and every command and snippet in docs/ runs or says why not.

A snippet is a fenced block tagged ```bash or ```python; an untagged block is output and is not run.
`<!-- illustrative: REASON -->` on the line before a block marks it as not run, with the reason (it needs a
GPU, a server, several machines, or minutes of SmolLM2). An illustrative block is still checked: a Python
one compiles and its gspo imports resolve; the `key=value` overrides of a `gspo train` command load.

Everything runs in a fresh copy of the repository (the files git tracks plus untracked ones it does not
ignore: what a clone of this working tree holds), on the tiny random model. `.venv/` there is a stand-in
for the one `scripts/setup.sh` makes: `python`, `gspo` (the interpreter running the tests, on the copy's
src/) and an `activate` script, so that the blocks run as written. The only other differences from what a
user types are these substitutions, applied line by line to bash blocks (`SUBSTITUTIONS`):

| written | run as | why |
|---|---|---|
| `bash scripts/setup.sh X && ...` | `...` | the stand-in .venv: no second install, no network |
| `gspo train` without a config (the default SmolLM2 run) | `gspo train configs/tiny.yaml train.steps=2` | 9 minutes |
| `gspo train CONFIG ...` for another config | `... model.tiny=llama train.steps=2` | minutes of SmolLM2 |
| `bash examples/...` or `python examples/...` | `... --smoke` | the example's own tiny mode |

README.md runs as one bash session, in order (a python block as `python - <<'EOF'`), so `source` and
`export` carry over as for a user. In docs/*.md, a file's python blocks share one namespace in this process
(as cells of a notebook) and its bash blocks run as in README.md, in order; `PRELUDES` defines the inputs
that a file's text describes but its snippets do not build (random tensors of the stated shapes).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gspo.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
ILLUSTRATIVE = re.compile(r"<!--\s*illustrative:\s*(.*?)\s*-->")
SUBSTITUTIONS = [
    (re.compile(r"bash scripts/setup\.sh \w+ && "), ""),
    (re.compile(r"(gspo train)$"), r"\1 configs/tiny.yaml train.steps=2"),
    # before a trailing comment, which would swallow them
    (
        re.compile(r"(gspo train (?!configs/tiny\.yaml)\S+\.yaml[^#]*?)(\s+#.*)?$"),
        r"\1 model.tiny=llama train.steps=2\2",
    ),
    (re.compile(r"^((?:bash|python) examples/\S+.*)$"), r"\1 --smoke"),
]
PRELUDES = {
    "logprobs.md": (
        "import torch\n"
        "from gspo.models import tiny_model\n"
        "hidden, weight, targets = torch.randn(8, 16), torch.randn(50, 16), torch.randint(50, (8,))\n"
        "model, input_ids = tiny_model('llama', 99, seed=0), torch.randint(99, (2, 7))\n"
    ),
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str  # "bash", "python" or "" (output)
    code: str
    illustrative: str | None  # the reason, when marked

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, in order."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, language = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            mark = ILLUSTRATIVE.fullmatch(previous.strip())
            code = "\n".join(lines[start + 1 : end]) + "\n"
            found.append(Block(path, start + 1, language, code, mark.group(1) if mark else None))
            i = end
        i += 1
    return found


def substitute(command: str) -> str:
    out = []
    for line in command.splitlines():
        for pattern, replacement in SUBSTITUTIONS:
            line = pattern.sub(replacement, line)
        out.append(line)
    return "\n".join(out) + "\n"


def fresh_copy(destination: Path) -> Path:
    """The repository's files as a new clone of this working tree has them, and the stand-in .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=False
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the fresh copy needs `git ls-files`")
    for name in listed.stdout.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    venv_bin = destination / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    # scripts, not symlinks: a symlinked venv interpreter would look for its venv beside the link
    for name, command in (("python", f'"{sys.executable}"'), ("gspo", f'"{sys.executable}" -m gspo')):
        (venv_bin / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (venv_bin / name).chmod(0o755)
    real_bin = Path(sys.executable).parent  # torchrun, ruff: the environment running the tests
    (venv_bin / "activate").write_text(f'export PATH="{venv_bin}:{real_bin}:$PATH"\n')
    return destination


def environment(copy: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "PYTHONUNBUFFERED": "1"}
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE", "VIRTUAL_ENV"):  # as a new user has them
        env.pop(name, None)
    return env


def bash_session(parts: list[Block]) -> str:
    """One bash script running the blocks in order, each announced (a failure names the block it was in)."""
    script = ["set -euo pipefail"]
    for block in parts:
        script.append(f"echo '### {block.where()}'")
        if block.language == "python":
            script.append(f"python - <<'GSPO_DOCS_EOF'\n{block.code}GSPO_DOCS_EOF")
        else:
            script.append(substitute(block.code))
    return "\n".join(script) + "\n"


def run_bash(script: str, copy: Path) -> str:
    result = subprocess.run(
        ["bash", "-c", script], cwd=copy, env=environment(copy), capture_output=True, text=True, timeout=1200
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        f"exit code {result.returncode}; the last block announced failed:\n{output[-6000:]}"
    )
    return output


def runnable(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.language in ("bash", "python") and b.illustrative is None]


# ---- every block runs or says why not ------------------------------------------------------------------------
def test_every_block_is_bash_python_or_output_and_every_mark_has_a_reason() -> None:
    for path in [ROOT / "README.md", *DOCS]:
        for block in blocks(path):
            assert block.language in ("", "bash", "python"), (
                f"{block.where()}: tag it bash or python (or none)"
            )
            assert block.illustrative != "", f"{block.where()}: say why the block is illustrative"
            if block.language == "" and re.match(r"\s*(python|gspo|bash|torchrun|HF_HUB)", block.code):
                pytest.fail(f"{block.where()}: a command in an untagged block: tag it bash")


def _gspo_imports(code: str) -> list[tuple[str, str]]:
    """(module, name) of every `from gspo... import name` in `code`."""
    return [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gspo"
        for alias in node.names
    ]


def _train_overrides(code: str) -> list[tuple[Path | None, list[str]]]:
    """The config file (a repo path, or None) and key=value arguments of each `gspo train` command in
    `code` (`[optional]` parts without quotes inside left out)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        if re.search(r"gspo train\b", line):
            after = re.split(r"gspo train\b", line, maxsplit=1)[1]
            words = shlex.split(
                re.sub(r"(^|\s)\[[^\]'\"]*\]", " ", after), comments=True
            )  # the shell's words
            config = next((ROOT / w for w in words[:1] if w.endswith(".yaml") and (ROOT / w).is_file()), None)
            overrides = [w for w in words if "=" in w and not w.startswith("-") and "$" not in w]
            commands.append((config, overrides))
    return commands


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_illustrative_blocks_still_import_and_load(path: Path) -> None:
    """Illustrative blocks are not run, but what can be checked without running them is."""
    for block in blocks(path):
        if block.language == "python":
            compile(block.code, block.where(), "exec")
            for module, name in _gspo_imports(block.code):
                assert hasattr(importlib.import_module(module), name), f"{block.where()}: {module}.{name}"
        elif block.language == "bash":
            for config, overrides in _train_overrides(block.code):
                load_config(config, overrides)


def test_inline_train_commands_load() -> None:
    """A `gspo train ... key=value` in running text is not run, but its overrides load (a renamed key fails);
    placeholders (`key=value`, `seed=S`) are left out."""
    for path in [ROOT / "README.md", *DOCS]:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S).replace("\n", " ")
        for match in re.finditer(r"`((?:python -m )?gspo train\b[^`]*)`", text):
            for config, overrides in _train_overrides(match.group(1)):
                real = [o for o in overrides if not re.fullmatch(r"key=value|[\w.]+=[A-Z]+", o)]
                try:
                    load_config(config, real)
                except Exception as error:
                    pytest.fail(f"{path.name}: `{match.group(1)}`: {error}")


def test_the_paths_the_docs_name_exist() -> None:
    """Every scripts/, benchmarks/, examples/, docs/ or tests/ file the README and docs name is in the repo."""
    named = re.compile(r"\b((?:scripts|benchmarks|examples|docs|tests)/[\w./-]*\w)")
    for path in [ROOT / "README.md", *DOCS]:
        for match in named.finditer(path.read_text()):
            assert (ROOT / match.group(1)).exists(), (
                f"{path.name} names {match.group(1)}, which does not exist"
            )
    assert "../" not in (ROOT / "README.md").read_text(), "README.md names a path outside the repository"


def test_examples_are_formatted_and_linted() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.is_file():
        pytest.skip("ruff is not installed here (the dev extra has it)")
    for command in (["check", "examples"], ["format", "--check", "examples"]):
        result = subprocess.run([str(ruff), *command], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


# ---- running them ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_readme_runs_top_to_bottom_on_the_tiny_model(tmp_path: Path) -> None:
    """A new user's first hour: every README command and snippet, in order, as written (module docstring)."""
    copy = fresh_copy(tmp_path / "gspo")
    output = run_bash(bash_session(runnable(ROOT / "README.md")), copy)
    assert "held-out accuracy: 0.000 -> 1.000" in output  # the tiny run learns the answer's format
    runs = copy / "runs"
    for name in ("config.yaml", "metrics.jsonl", "summary.md", "plots/reward.png"):
        assert (runs / "tiny" / name).is_file(), name
    assert (runs / "capitals" / "capitals-q8_0.gguf").is_file() and (
        runs / "capitals" / "eval_gguf.json"
    ).is_file()
    assert "weights for your engine:" in output  # examples/trajectories/agent.py finished
    # the end of a run says what to do next; each rollout batch's completions are kept
    assert "next:\n" in output and "gspo export runs/tiny " in output
    assert (runs / "tiny" / "completions.jsonl").read_text().count("\n") == 12 * 16  # resumed to 12
    # both Python examples learn (a reward with spread; rows in memory, kept in the run folder)
    assert output.count("\n0.0 1.0\n") == 2
    assert (runs / "rows" / "data.jsonl").read_text().count("\n") == 100
    # the reasoning-gym command ran, after the same set-up
    configs = [yaml.safe_load(p.read_text()) for p in runs.glob("gspo-*/config.yaml")]
    assert any(c["task"]["name"] == "reasoning_gym" for c in configs), configs
    if importlib.util.find_spec("llama_cpp") is not None:
        assert "llama.cpp: 'What is 3 + 4?" in output  # examples/lora_gguf read its GGUF through llama.cpp
    else:  # not skipped silently: the line says why, and how to get it
        assert (
            "llama.cpp: not asked, llama-cpp-python is not installed (bash scripts/setup.sh server" in output
        )


@pytest.fixture(scope="session")
def docs_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_copy(tmp_path_factory.mktemp("docs") / "gspo")


@pytest.mark.parametrize("path", [p for p in DOCS if runnable(p)], ids=lambda p: p.name)
def test_docs_snippets_run(path: Path, docs_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(docs_copy)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    exec(PRELUDES.get(path.name, ""), namespace)
    for block in runnable(path):
        if block.language == "python":
            exec(compile(block.code, block.where(), "exec"), namespace)
        else:
            run_bash(bash_session([block]), docs_copy)
