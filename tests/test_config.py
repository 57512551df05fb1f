"""Config: defaults match configs/default.yaml, YAML + overrides, clear errors naming the field."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path

import pytest

from gspo.config import Config, ConfigError, describe, field_docs, load_config, save_config, to_dict

ROOT = Path(__file__).resolve().parents[1]


def _all_dataclasses(cls: type) -> list[type]:
    out = [cls]
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out.extend(_all_dataclasses(type(value)))
    return out


def test_every_field_has_a_docstring() -> None:
    for cls in _all_dataclasses(Config):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_the_plain_config_is_the_default_run_without_its_three_stability_settings() -> None:
    """configs/plain.yaml's seeds table (docs/performance.md) was measured with exactly these overrides of
    the default config (`scripts/default_run_seeds.py configs/plain.yaml`)."""
    plain = load_config(ROOT / "configs" / "plain.yaml")
    assert (plain.rollout.temperature, plain.train.lr, plain.rollout.dynamic_sampling) == (1.0, 1e-5, False)
    back = dataclasses.replace(
        plain,
        rollout=dataclasses.replace(plain.rollout, temperature=1.2, dynamic_sampling=True),
        train=dataclasses.replace(plain.train, lr=2e-5),
    )
    assert back == Config()


def test_default_yaml_is_gspo_config_output() -> None:
    """configs/default.yaml is `gspo config > configs/default.yaml`, byte for byte (docs included)."""
    text = (ROOT / "configs" / "default.yaml").read_text()
    assert text == describe() + "\n", "regenerate it: gspo config > configs/default.yaml"
    loaded = load_config(ROOT / "configs" / "default.yaml")
    assert to_dict(loaded) == to_dict(Config())
    assert list(loaded.rewards) == list(Config().rewards)  # order matters: the first is the eval accuracy


def test_overrides_are_typed_and_nested(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 2.0e-5\n  objective: grpo\nrollout:\n  group_size: 4\n")
    config = load_config(
        path, ["train.lr=3e-6", "rollout.temperature=0.7", "rewards={correct_number: 2}", "seed=5"]
    )
    assert config.train.lr == 3e-6
    assert config.train.objective == "grpo"
    assert config.rollout.group_size == 4
    assert config.rollout.temperature == 0.7
    assert config.rewards == {"correct_number": 2.0}
    assert config.seed == 5
    assert config.train.eps_low is None  # objective default applies later


def test_a_dotted_override_sets_one_reward_and_keeps_the_others() -> None:
    config = load_config(None, ["rewards.number_format=0", "rewards.my_rewards.py:length=2"])
    assert config.rewards == {
        "exact_answer": 1.0,
        "correct_number": 0.5,
        "number_format": 0.0,
        "my_rewards.py:length": 2.0,  # the entry's name keeps its dots
    }
    with pytest.raises(ConfigError, match=r"rewards\.number_format: expected a number, got 'abc'"):
        load_config(None, ["rewards.number_format=abc"])


def test_string_fields_take_text_that_yaml_would_read_otherwise() -> None:
    config = load_config(None, ["task.operations=-", "task.system_prompt=on"])
    assert config.task.operations == "-"  # YAML alone reads "-" as a list
    assert config.task.system_prompt == "on"  # and "on" as a bool


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = load_config(None, ["train.objective=gspo_token", "lora.rank=4", "train.eps_high=1e-3"])
    save_config(config, tmp_path / "config.yaml")
    assert to_dict(load_config(tmp_path / "config.yaml")) == to_dict(config)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1e-5", "unknown config key 'train.lrr'; did you mean 'lr'"),
        ("trian.lr=1e-5", "unknown config key 'trian'; did you mean 'train'"),
        ("train.lr=fast", "train.lr: expected a number, got 'fast'"),
        (
            "train.objective=ppo",
            "train.objective: 'ppo' is not one of 'gspo', 'gspo_token', 'grpo', 'gmpo', 'sapo', 'sapo_seq', 'cispo'",
        ),
        ("rollout.group_size=2.5", "rollout.group_size: expected an integer, got 2.5"),
        ("rollout.prompts_per_step=0", "rollout.prompts_per_step must be at least 1, got 0"),
        ("train.eps_low=1.5", "train.eps_low must be < 1"),
        ("progress=maybe", "progress: expected true or false, got 'maybe'"),
        ("train", "is not of the form section.key=value"),
        ("train=3", "train: expected a mapping of its fields"),
        ("task.name=file", "task.name=file needs task.data_path"),
        ("device=gpu", 'device must be "auto", "cpu", "cuda" or "cuda:N", got \'gpu\''),
        ("train.mixed_precision=fp8", "train.mixed_precision: 'fp8' is not one of 'auto', 'bf16', 'none'"),
        ("train.lr=.nan", "train.lr: expected a finite number, got nan"),  # NaN passes `lr <= 0`
        ("rewards={correct_number: .inf}", "rewards.correct_number: expected a finite number, got inf"),
        ("rollout.group_size=1", "rollout.group_size must be at least 2, got 1: advantages compare"),
        ("train.lr=[1e-5", "override 'train.lr=[1e-5': the value is not valid YAML: line 1, column 6"),
        (
            "rollout.openai.url=file:///etc/passwd",
            'rollout.openai.url must be an http:// or https:// address, e.g. "http://127.0.0.1:8000/v1", got '
            "'file:///etc/passwd': only http:// and https:// addresses are supported",
        ),
        ("rollout.openai.url=http://me:secret@host/v1", "it holds credentials (user:password@)"),
        ("reward_timeout=-1", "reward_timeout must be at least 0, got -1.0: seconds; 0: no limit"),
    ],
)
def test_bad_input_names_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.objective=sapo", "train.eps_low=0.2"],
            "train.eps_low is a clip range, but train.objective=sapo",
        ),
        (
            ["train.tau_pos=2"],
            "train.tau_pos is SAPO's gate temperature; train.objective=gspo does not",
        ),
        (["train.objective=sapo", "train.tau_neg=0"], "train.tau_neg must be > 0"),
        (["train.objective=cispo", "train.eps_low=1.5"], "train.eps_low must be <= 1 for cispo"),
        (
            ["train.objective=gspo", "train.sampler_correction=token_truncate"],
            "use train.sampler_correction=sequence_truncate",
        ),
        (
            ["train.sampler_correction=sequence_mask", "train.old_logprobs=sampler"],
            "needs train.old_logprobs=recompute",
        ),
        (
            ["train.sampler_correction=none", "train.sampler_correction_max=3"],
            "set train.sampler_correction too",
        ),
        (
            [
                "train.sampler_correction=token_mask",
                "train.objective=grpo",
                "train.sampler_correction_min=2",
                "train.sampler_correction_max=1",
            ],
            "train.sampler_correction_min=2.0 exceeds train.sampler_correction_max=1.0",
        ),
        (["train.opsm_delta=-1"], "train.opsm_delta must be at least 0, got -1.0: null disables it"),
        (["train.sampler_is_cap=2"], "unknown config key 'train.sampler_is_cap'"),
    ],
)
def test_wrong_objective_and_correction_combinations_name_the_fix(overrides, message) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


def test_objective_recipes_load_and_defaults_stay_in_one_place() -> None:
    from gspo.config.checks import SEQUENCE_OBJECTIVES
    from gspo.core import registry
    from gspo.learning.policy import UpdateSpec

    assert SEQUENCE_OBJECTIVES == registry.SEQUENCE_OBJECTIVES
    gmpo = load_config(None, ["train.objective=gmpo", "train.eps_low=1.5"])  # log space: any eps_low
    assert UpdateSpec.from_config(gmpo, layout="padded", pad_id=0).loss.eps_low == 1.5
    dr_grpo = load_config(
        None,
        ["train.objective=grpo", "train.aggregation=seq-mean-token-sum-norm", "train.advantage_scale=none"],
    )
    spec = UpdateSpec.from_config(dr_grpo, layout="padded", pad_id=0)
    assert (
        spec.max_new_tokens == dr_grpo.rollout.max_new_tokens and spec.loss.eps_low is None
    )  # paper default later
    masked = load_config(None, ["train.sampler_correction=sequence_mask", "train.sampler_correction_max=3"])
    spec = UpdateSpec.from_config(masked, layout="padded", pad_id=0)
    correction = spec.loss.correction()
    assert (correction.name, correction.low, correction.high) == (
        "sequence_mask",
        0.5,
        3.0,
    )  # C_min: the default


def test_minibatches_must_fit_the_rollout_batch() -> None:
    with pytest.raises(ConfigError, match="minibatches=8 exceeds the 4 completions"):
        load_config(None, ["rollout.prompts_per_step=1", "rollout.group_size=4", "train.minibatches=8"])


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_describe_is_loadable_yaml_of_the_defaults(tmp_path: Path) -> None:
    text = describe()
    assert "# Lower clip range; None uses the objective's paper default" in text
    (tmp_path / "described.yaml").write_text(text)
    assert to_dict(load_config(tmp_path / "described.yaml")) == to_dict(Config())


def test_a_yaml_syntax_error_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: 1e-5\n  steps: [3\nrollout: {}\n")
    with pytest.raises(
        ConfigError, match=r"broken\.yaml: not valid YAML: line 4, column 8: expected ',' or ']'"
    ):
        load_config(path)


def test_old_keys_load_under_their_new_names_with_a_note(tmp_path: Path) -> None:
    """A config (or a run folder's config.yaml) of an earlier gspo: renamed keys load, each with a note."""
    path = tmp_path / "old.yaml"
    path.write_text(
        "train:\n  packing: padded\n  minibatches_per_rollout: 2\n  objective: sapo\n  sapo_tau_neg: 2.0\n"
        "rollout:\n  server:\n    url: http://127.0.0.1:9/v1\n    timeout: 7\n    sync_every: 3\n"
    )
    with pytest.warns(FutureWarning) as notes:
        config = load_config(path, ["train.sapo_tau_pos=1.5"])
    assert (config.train.layout, config.train.minibatches) == ("padded", 2)
    assert (config.train.tau_pos, config.train.tau_neg) == (1.5, 2.0)
    assert config.rollout.openai.url == "http://127.0.0.1:9/v1"
    assert (config.rollout.openai.timeout, config.rollout.llama_cpp.timeout) == (7.0, 7.0)
    assert config.rollout.llama_cpp.sync_every == 3
    said = " ".join(str(n.message) for n in notes)
    for old, new in [("train.packing", "train.layout"), ("train.sapo_tau_pos", "train.tau_pos")]:
        assert f"config key {old} is now {new}" in said
    assert "server" not in to_dict(config)["rollout"]


def test_an_old_key_beside_its_new_name_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("train:\n  packing: padded\n  layout: packed\n")
    with pytest.raises(ConfigError, match=r"both train\.packing and train\.layout"):
        load_config(path)


def test_input_paths_in_a_config_file_are_relative_to_its_folder(tmp_path: Path, monkeypatch) -> None:
    task = tmp_path / "task"
    task.mkdir()
    (task / "config.yaml").write_text(
        "model: {path: model.gguf}\n"
        "task: {name: file, data_path: data/train.jsonl}\n"
        "rewards: {rewards.py:score: 1.0, correct_number: 0.5, ../shared/r.py:other: 0.25, pkg.mod:fn: 0.1}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config("../task/config.yaml", ["output_dir=runs/x"])
    assert config.model.path == str(task / "model.gguf")
    assert config.task.data_path == str(task / "data" / "train.jsonl")
    assert list(config.rewards) == [
        f"{task / 'rewards.py'}:score",
        "correct_number",
        f"{tmp_path / 'shared' / 'r.py'}:other",
        "pkg.mod:fn",  # a module, not a file
    ]
    assert config.output_dir == "runs/x"  # an output: where the command runs
    # an override names a path relative to the working directory, as command-line paths do
    assert load_config(task / "config.yaml", ["task.data_path=d.jsonl"]).task.data_path == str(
        elsewhere / "d.jsonl"
    )
    assert load_config(None, ["rewards={r.py:f: 1.0}"]).rewards == {f"{elsewhere / 'r.py'}:f": 1.0}
    # the run folder's config.yaml keeps pointing at the same files from anywhere
    save_config(config, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml").rewards == config.rewards


def test_a_path_written_relative_to_the_working_directory_gets_the_fix(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "data.jsonl").write_text("")
    (tmp_path / "configs" / "run.yaml").write_text("task: {name: file, data_path: data.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"task\.data_path: 'data\.jsonl' is read relative to the config "
        r"file's folder.*write '\.\./data\.jsonl' or an absolute path",
    ):
        load_config("configs/run.yaml")


def test_the_names_gspo_exports_import() -> None:
    import gspo

    for name in gspo.__all__:
        assert getattr(gspo, name) is not None, name
    assert gspo.PAPER_DEFAULTS["gspo"]["eps_low"] == 3e-4  # the paper's clip range, README's example


def _leaf_keys(cls: type = Config, prefix: str = "") -> dict[str, object]:
    """Every leaf key of the config (dotted) and its type annotation."""
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(getattr(cls(), f.name)):
            out |= _leaf_keys(type(getattr(cls(), f.name)), f"{prefix}{f.name}.")
        else:
            out[f"{prefix}{f.name}"] = hints[f.name]
    return out


def test_every_key_whose_type_does_not_say_it_all_has_one_rule() -> None:
    """A Literal's choices and a bool's two values need no range; every other key has its rule."""
    from gspo.config.rules import ANY_VALUE, RULES, check_values

    def said_by_type(tp: object) -> bool:
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            return all(said_by_type(a) for a in typing.get_args(tp) if a is not type(None))
        return tp is bool or typing.get_origin(tp) is typing.Literal

    needed = {key for key, tp in _leaf_keys().items() if not said_by_type(tp)}
    ruled = set(RULES) | set(ANY_VALUE)
    assert needed == ruled, f"without a rule: {needed - ruled}; no such key: {ruled - needed}"
    assert not set(RULES) & set(ANY_VALUE)
    check_values(Config())  # the defaults pass


def test_every_integer_key_has_a_ceiling_that_fits_its_use() -> None:
    """`train.steps=99999999999999999999999` and `rollout.group_size=100000` loaded and ran (for minutes);
    every integer key now refuses a value beyond its use, naming the key and the bound."""
    from gspo.config.rules import RULES, check_values

    def integer(tp: object) -> bool:
        return tp is int or int in typing.get_args(tp)

    keys = sorted(key for key, tp in _leaf_keys().items() if integer(tp))
    assert {"train.steps", "rollout.group_size", "serve.max_n"} <= set(keys)
    for key in keys:
        with pytest.raises(ConfigError) as error:
            load_config(None, [f"{key}=99999999999999999999999"])
        message = str(error.value)
        assert message.startswith(f"{key} must be ") and "\n" not in message, message
        ceiling = RULES[key].most
        if ceiling is not None:  # a rule without `most` bounds it with `between`, as the seeds
            assert f"must be at most {ceiling:,}, got 99999999999999999999999: " in message
            config = load_config(None)  # the bound itself passes its rule
            section, _, name = key.rpartition(".")
            setattr(
                functools.reduce(getattr, section.split("."), config) if section else config, name, ceiling
            )
            check_values(config)
    with pytest.raises(ConfigError, match=r"rollout\.group_size must be at most 1,024, got 100000: GSPO"):
        load_config(None, ["rollout.group_size=100000"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("seed=-1", "seed must be in [0, 4294967295], got -1: numpy's and torch's seeds are 32-bit"),
        ("seed=4294967296", "seed must be in [0, 4294967295], got 4294967296"),
        ("train.weight_decay=-0.1", "train.weight_decay must be at least 0, got -0.1"),
        ("train.warmup_updates=-1", "train.warmup_updates must be at least 0, got -1: 0: no warm-up"),
        ("train.max_grad_norm=-1", "train.max_grad_norm must be at least 0, got -1.0: 0: no clipping"),
        ("train.beta=-0.5", "train.beta must be at least 0, got -0.5: 0: no KL term"),
        ("lora.rank=-1", "lora.rank must be at least 0, got -1"),
        ("lora.alpha=0", "lora.alpha must be > 0, got 0.0: the adapters' scale is alpha / rank"),
        ("lora.dropout=1", "lora.dropout must be in [0, 1), got 1.0"),
        (
            "lora.target_modules=[]",
            "lora.target_modules must be a list of distinct non-empty names, at least",
        ),
        ("train.adam_betas=[0.9, 1.0]", "train.adam_betas must be two numbers in [0, 1), got [0.9, 1.0]"),
        ("train.adam_betas=[-0.1, 0.9]", "train.adam_betas must be two numbers in [0, 1)"),
        ("train.adam_betas=[0.9]", "train.adam_betas must be two numbers in [0, 1), got [0.9]"),
        ("rollout.openai.timeout=0", "rollout.openai.timeout must be > 0, got 0.0"),
        ("rollout.llama_cpp.timeout=-1", "rollout.llama_cpp.timeout must be > 0, got -1.0"),
        ("distributed.timeout_minutes=0", "distributed.timeout_minutes must be > 0, got 0.0"),
        (
            "rollout.llama_cpp.gguf_quant=q3_k",
            "rollout.llama_cpp.gguf_quant: 'q3_k' is not one of 'f32', 'f16'",
        ),
        (
            "rollout.openai.url=http://host:99999/v1",
            "got 'http://host:99999/v1': it is not a valid URL (Port out",
        ),
        (
            "rollout.openai.url=http://host:abc/v1",
            "got 'http://host:abc/v1': it is not a valid URL (Port could",
        ),
        ("rollout.openai.url=http://[::1/v1", "it is not a valid URL (Invalid IPv6 URL)"),
        ("rollout.openai.url=http:///v1", "got 'http:///v1': it names no host"),
        ("rollout.openai.url='http://host /v1'", "it holds spaces or control characters"),
        (
            "rollout.openai.api_key_env='MY KEY'",
            "rollout.openai.api_key_env must be an environment variable's",
        ),
        ("output_dir=''", "output_dir must be a non-empty string without control characters, got ''"),
        ("task.operations=x", "task.operations must be a non-empty string of the operators"),
        ("task.num_train=0", "task.num_train must be at least 1, got 0"),
        ("task.answer_fields=[a, a]", "task.answer_fields must be a list of distinct non-empty names, got"),
        ("task.operand_min=10", "task.operand_min=10 exceeds task.operand_max=9"),
        ("rewards={}", "rewards must be at least one reward with a non-empty name, got {}"),
    ],
)
def test_every_value_out_of_its_range_is_refused_at_load_naming_the_key_and_why(
    override: str, message: str
) -> None:
    """These loaded silently (and failed later with a traceback, or trained)."""
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_yaml_nested_past_the_readers_depth_is_an_error_at_its_place(tmp_path: Path) -> None:
    """Deeply nested YAML raised RecursionError."""
    deep = "[" * 3000 + "]" * 3000
    path = tmp_path / "deep.yaml"
    path.write_text(f"train:\n  adam_betas: {deep}\n")
    with pytest.raises(
        ConfigError, match=r"deep\.yaml: not valid YAML: line 2, column 113: nested more than 100"
    ):
        load_config(path)
    with pytest.raises(
        ConfigError,
        match=r"^override 'train\.adam_betas=\[+\.\.\.': the value is not valid YAML: line 1, column 101",
    ):
        load_config(None, [f"train.adam_betas={deep}"])


def test_a_key_set_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    """PyYAML keeps the last of two `train:` sections: the first one's lr was silently lost."""
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  lr: 0.5\nseed: 3\ntrain:\n  steps: 4\n")
    with pytest.raises(
        ConfigError,
        match=r"twice\.yaml: not valid YAML: line 4, column 1: 'train' is set twice \(first on line 1\): YAML "
        r"would keep only the last one; merge them into one",
    ):
        load_config(path)
    with pytest.raises(ConfigError, match=r"'a\.py:f' is set twice"):  # in an override's value too
        load_config(None, ["rewards={a.py:f: 1, a.py:f: 2}"])


def test_a_config_path_says_what_it_is_and_a_config_file_has_a_ceiling(tmp_path: Path) -> None:
    """A folder "did not exist"; a 50 MB file (one comment) was read for 68 s and accepted."""
    from gspo.config.loading import CONFIG_MAX_BYTES

    with pytest.raises(ConfigError, match=r"is a folder, not a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "missing.yaml")
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * CONFIG_MAX_BYTES + "\nseed: 1\n")
    with pytest.raises(ConfigError, match=r"holds 1,048,587 bytes, more than a config file's 1,048,576"):
        load_config(big)


def test_a_list_is_refused_by_its_length_before_its_entries_are_read(tmp_path: Path) -> None:
    """A 5M-entry lora.target_modules took 266 s and 4.2 GB before its refusal: a list or mapping longer
    than LIST_MAX is refused before any entry is checked (or its names compared with the model's)."""
    from gspo.config.values import LIST_MAX

    names = ", ".join(f"m{i}" for i in range(5_000))
    path = tmp_path / "long.yaml"
    path.write_text(f"lora:\n  rank: 4\n  target_modules: [{names}]\n")
    with pytest.raises(ConfigError, match=r"^lora\.target_modules holds 5,000 entries, more than the 1,024"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^rewards holds 1,025 entries"):
        load_config(None, ["rewards={" + ", ".join(f"r{i}: 1" for i in range(LIST_MAX + 1)) + "}"])
