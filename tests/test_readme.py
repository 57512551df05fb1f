"""CI runs exactly the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("bash scripts/setup.sh dev"))
    assert "pytest" in command
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci_lines
