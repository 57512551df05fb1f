"""Property-based fuzzing of config values through `gspo train`: random keys, extreme values and
wrong types, as overrides of configs/tiny.yaml. Whatever they are, gspo answers with an exit code of the
documented table for `train` (gspo.cli.COMMAND_ERRORS), one line and no traceback, and writes nothing
outside the run folder.

In-process for speed: the CLI's whole path (parsing, loading, classification, exit code) and the Trainer's
set-up (run folder, lock, rewards, data, model) run for real; only the training loop is skipped, and
configs that would load something large (the real SmolLM2, a huge LoRA, a server) stop before the set-up.
The `config-fuzz` Hypothesis profile bounds the examples: the suite runs a fixed, seeded sample of
`SUITE_EXAMPLES`; CI's fuzz stage the full sweep, `GSPO_FUZZ_EXAMPLES=150` (.ci/run), derandomised too (the
same cases every run: CI is never red by chance); GSPO_FUZZ_RANDOM=1 hunts with fresh random cases. A few
cases run as real subprocesses at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gspo.training.trainer as trainer_module
from gspo.cli import COMMAND_ERRORS, EXIT_CODES, main
from gspo.config import Config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
ALLOWED = {0} | {EXIT_CODES[kind] for kind in COMMAND_ERRORS["train"]}

SUITE_EXAMPLES = 30
"""The suite's sample of cases (each a config set up for real: about 0.7 s on 2 cores)."""

settings.register_profile(
    "config-fuzz",
    max_examples=int(os.environ.get("GSPO_FUZZ_EXAMPLES", str(SUITE_EXAMPLES))),
    deadline=None,
    derandomize=os.environ.get("GSPO_FUZZ_RANDOM") is None,  # the same cases every run, unless hunting
    suppress_health_check=[HealthCheck.too_slow],
)


def _keys(cls: type = Config, prefix: str = "") -> dict[str, typing.Any]:
    """Every key (sections too) and its type annotation (a section's: its class)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, typing.Any] = {}
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        out[prefix + f.name] = hints[f.name]
        if dataclasses.is_dataclass(value):
            out |= _keys(type(value), f"{prefix}{f.name}.")
    return out


KEYS = _keys()
EXTREMES = [0, 1, -1, 2, 2**31, 2**32, 2**63, -(2**63), 10**30]
ODD_TEXT = ["", " ", "\x00", "../outside", "/", "http://[::1", "http://h:99999/v1", "q3_k", "gspo", "a:b"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EXTREMES),
    st.integers(min_value=-1000, max_value=1000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(ODD_TEXT),
    st.text(max_size=12),
)
anything = st.one_of(
    scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=8), scalars, max_size=3)
)


def of_type(tp: typing.Any) -> st.SearchStrategy:
    """Values of the key's own type, small, extreme and out of range: they pass the type check and reach
    the range checks and the set-up."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(of_type(a) for a in args if a is not type(None)), st.none())
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(of_type(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(
            st.one_of(st.sampled_from(["correct_number", "x:y", ""]), st.text(max_size=6)),
            of_type(args[1]),
            max_size=3,
        )
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(st.integers(min_value=-3, max_value=70), st.sampled_from(EXTREMES))
    if tp is float:
        return st.one_of(
            st.floats(min_value=-2.0, max_value=2.0),
            st.sampled_from([0.0, -0.0, 1e-300, 1e300, 0.999999, 1.0]),
            st.floats(allow_nan=True, allow_infinity=True),
        )
    if tp is str:
        return st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=12))
    return anything  # a section: a value where a mapping of its fields belongs


def _text(value: typing.Any) -> str:
    """An override's value as a user would type it: YAML flow style (NaN as .nan)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()


key_values = st.one_of(
    st.sampled_from(sorted(KEYS)).flatmap(lambda key: st.tuples(st.just(key), of_type(KEYS[key]))),
    st.tuples(st.one_of(st.sampled_from(sorted(KEYS)), st.text(max_size=10)), anything),  # any key, anything
)
overrides = st.lists(key_values.map(lambda kv: f"{kv[0]}={_text(kv[1])}"), min_size=1, max_size=3)


class _Large(Exception):
    """A config that would load more than the fuzz affords; it is not a finding."""


class BoundedTrainer(trainer_module.Trainer):
    """The real set-up on small configs; no training loop."""

    def __init__(self, config: Config, **kwargs: typing.Any) -> None:
        task, rollout = config.task, config.rollout
        if (
            config.model.tiny is None  # the real SmolLM2 (or a model.path) takes seconds to load
            or config.lora.rank > 64
            or rollout.engine != "hf"  # starts a server at set-up
            or task.num_train + task.num_eval > 2000
            or (task.name == "arithmetic" and task.num_operands > 50)
        ):
            raise _Large
        super().__init__(config, **kwargs)

    def run(self) -> dict[str, typing.Any]:
        return {"run_dir": str(self.run_dir), "eval_accuracy_first": None, "eval_accuracy_last": None}


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@settings(settings.get_profile("config-fuzz"))
@given(overrides)
def test_any_config_values_give_an_exit_code_of_the_table_no_traceback_and_no_stray_files(
    fuzzed: list[str],
) -> None:
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        root = Path(tmp)
        run = root / "run"
        patch.chdir(root)
        patch.setattr(trainer_module, "Trainer", BoundedTrainer)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = main(["train", TINY, *fuzzed, f"output_dir={run}", "progress=false", "report_to=[]"])
        except _Large:
            event("skipped: a large config")
            return
        except SystemExit as exit:  # argparse: an override that starts with "-" reads as an option
            assert exit.code == EXIT_CODES["usage"] and "error:" in err.getvalue(), (fuzzed, err.getvalue())
            event("argparse's usage error")
            return
        message = err.getvalue()
        event(f"exit {code}")
        assert code in ALLOWED, (fuzzed, code, message)
        assert "Traceback" not in message, (fuzzed, message)
        errors = [line for line in message.splitlines() if line.startswith("error: ")]
        assert (code == 0) == (not errors) and len(errors) <= 1, (fuzzed, message)
        stray = {p for p in _files(root) if p != run and run not in p.parents}
        assert not stray, (fuzzed, stray)


def test_real_processes_exit_with_a_code_of_the_table_and_write_nothing(tmp_path: Path) -> None:
    """Two whole processes (each imports torch: seconds): an error found at load, and one found at set-up
    with an output_dir outside the working folder."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    for fuzzed, kind in (
        (["seed=-1", "rollout.openai.url=http://[::1"], "config"),
        (["task.name=file", "task.data_path=/", "output_dir=../outside"], "input"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "gspo", "train", TINY, *fuzzed],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == EXIT_CODES[kind], result.stderr
        assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "outside").exists()
