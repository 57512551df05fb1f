"""The public surface is a promise (gspo.public): every name it lists imports, gspo.__all__ is its top, and
the import paths of earlier releases keep working with a DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import gspo
from gspo.public import MOVED, PUBLIC

SURFACE = {
    "gspo.rewards.builtins": {
        "correct_number",
        "exact_answer",
        "number_format",
        "digit_fraction",
        "reasoning_gym",
    },
    "gspo.trl": {"GRPOConfig", "GRPOTrainer"},
    "gspo.client": {"Client", "Episode"},
    "gspo.rollout.samplers": {"Sampler", "Rollouts"},
}
"""Names docs have shown, which must stay in PUBLIC (a name dropped from both the code and PUBLIC fails)."""

OPTIONAL = {"gspo.integrations.art": "art", "gspo.integrations.verifiers": "verifiers"}
"""Public modules of an extra: walked where its package is installed."""


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_imports(module: str) -> None:
    if module in OPTIONAL:
        pytest.importorskip(OPTIONAL[module])
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert missing == [], f"{module} lost {missing}, which gspo.public promises"


def test_gspo_all_is_the_public_top_and_the_documented_names_stay_public() -> None:
    assert sorted(gspo.__all__) == sorted(PUBLIC["gspo"])
    for module, names in SURFACE.items():
        assert names <= set(PUBLIC[module]), module


@pytest.mark.parametrize(
    ("old", "name"), [("gspo.rollout.rewards", "correct_number"), ("gspo.rollout.engine", "Engine")]
)
def test_an_import_path_of_an_earlier_release_works_and_warns_with_the_new_one(old: str, name: str) -> None:
    """In a fresh interpreter: the path imports once per process (Python caches the module)."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        f"    from {old} import {name}\n"
        "print(seen[0].category.__name__, seen[0].filename, str(seen[0].message))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    category, filename, message = out.split(" ", 2)
    assert category == "DeprecationWarning" and filename == "<string>"  # points at the user's line
    assert message.startswith(f"{old} moved to {MOVED[old][0]}: import from there")
    new = importlib.import_module(MOVED[old][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert getattr(importlib.import_module(old), name) is getattr(new, name)


def test_an_unknown_name_of_a_moved_module_says_where_it_went() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        moved = importlib.import_module("gspo.rollout.rewards")
    with pytest.raises(
        AttributeError, match=r"gspo.rollout.rewards' \(now gspo.rewards.builtins\) has no attribute 'nope'"
    ):
        moved.nope  # noqa: B018


def test_a_renamed_config_key_given_in_python_loads_under_its_new_name_with_a_note() -> None:
    """As a YAML file or the command line always did: `Config(train={'minibatches_per_rollout': 2})` was
    refused with a hint naming another key."""
    from gspo.config import Config
    from gspo.config.renamed import DeprecatedKey

    with pytest.warns(
        DeprecatedKey, match=r"train\.minibatches_per_rollout is now train\.minibatches"
    ) as seen:
        config = Config(train={"minibatches_per_rollout": 2})
    assert config.train.minibatches == 2
    assert seen[0].filename == __file__  # the user's line
