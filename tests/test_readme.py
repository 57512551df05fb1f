"""CI runs exactly the README's test command; the docs quote pyproject's transformers range."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("bash scripts/setup.sh dev"))
    assert "pytest" in command
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci_lines


def test_the_transformers_range_in_the_docs_is_pyprojects() -> None:
    """docs/reliability.md says which transformers releases are supported and why; scripts/transformers_range.sh
    tests the lower bound it reads from pyproject.toml: the three agree."""
    spec = re.search(r'"(transformers>=[0-9.]+,<[0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert spec is not None
    assert f"pyproject.toml declares `{spec[1]}`" in (ROOT / "docs" / "reliability.md").read_text()
    assert '"transformers>=' in (ROOT / "scripts" / "transformers_range.sh").read_text()
