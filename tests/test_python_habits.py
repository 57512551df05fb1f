"""A TRL user's first attempts in Python, each met: a config from keyword arguments, checked as values are
set; rewards as a list of functions; a `datasets.Dataset` as the data; `Trainer.train()`. Each misuse is one
line that names the fix."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml

import gspo.config.rules
from gspo import Config, Trainer, train
from gspo.config import ConfigError, load_config
from gspo.rewards.builtins import correct_number, number_format
from gspo.rewards.resolve import resolve_rewards
from gspo.rollout.data import DataError
from gspo.run.metrics import read_metrics
from gspo.training.inputs import build_examples

datasets = pytest.importorskip("datasets", reason="the dev extra installs datasets")

ROWS = [
    {"prompt": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b), "id": i}
    for i, (a, b) in enumerate((a, b) for a in range(6) for b in range(4))
]


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ---- a config from keyword arguments, checked as it is set --------------------------------------------
def test_a_config_is_built_from_keyword_arguments_and_sections_as_mappings() -> None:
    config = Config(seed=3, train={"lr": 3e-6, "objective": "grpo"}, rollout={"openai": {"concurrency": 2}})
    assert (config.seed, config.train.lr, config.train.objective) == (3, 3e-6, "grpo")
    assert config.rollout.openai.concurrency == 2 and config.rollout.group_size == 8  # the rest: defaults
    assert load_config(None, ["seed=3", "train.lr=3e-6", "train.objective=grpo"]).train == config.train


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: Config(learning_rate=1e-5),
            "unknown config key 'learning_rate': TRL's learning_rate=1e-05 is gspo's train.lr: "
            "Config(train={'lr': 1e-05})",
        ),
        (
            lambda: Config(num_generations=16),
            "TRL's num_generations=16 is gspo's rollout.group_size: Config(rollout={'group_size': 16})",
        ),
        (  # checked as it is set: a TRL value where gspo's name goes stops here, not at train time
            lambda: Config(train={"objective": "sequence"}),
            "train.objective: 'sequence' is not one of 'gspo', 'gspo_token', 'grpo',",
        ),
        (lambda: Config(rollout={"engine": "vlm"}), "rollout.engine: 'vlm' is not one of 'hf', 'openai', "),
        (lambda: Config(report_to="all"), "report_to='all': name the trackers gspo should send to"),
        (
            lambda: Config(group_size=4),
            "did you mean 'rollout.group_size'? Config(rollout={'group_size': 4})",
        ),
        (lambda: Config(train={"lrr": 1e-5}), "unknown config key 'train.lrr'; did you mean 'lr'?"),
        (lambda: Config(train={"lr": "fast"}), "train.lr: expected a number, got 'fast'"),
        (lambda: Config(rollout={"group_size": 1}), "rollout.group_size must be at least 2, got 1"),
        (lambda: Config(train=5), "train: expected a mapping of its fields, got 5"),
    ],
)
def test_a_wrong_keyword_argument_is_one_line_naming_the_key_to_use(build, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        build()
    assert message in one_line(error)


def test_an_assignment_is_checked_at_once_naming_the_field() -> None:
    """`c.train.lr = "abc"` was taken, and failed deep inside the run."""
    config = Config()
    config.train.lr = 3e-6
    config.train.steps = 5
    assert (config.train.lr, config.train.steps) == (3e-6, 5)
    config.train.lr = 1  # an integer where a number goes: widened, as a YAML file's
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    refusals = [
        (("train", "lr", "abc"), "train.lr: expected a number, got 'abc'"),
        (("train", "lr", -1.0), "train.lr must be > 0, got -1.0"),
        (("rollout.openai", "url", "ftp://x"), "rollout.openai.url must be an http:// or https:// address"),
        (("train", "learning_rate", 1e-5), "unknown config key 'train.learning_rate'; did you mean 'lr'"),
        (("", "seed", "1"), "seed: expected an integer, got '1'"),
        (("train", "objective", "sequence"), "train.objective: 'sequence' is not one of 'gspo'"),
        (("task", "data_path", datasets.Dataset.from_list(ROWS)), "go to train(config, data=rows)"),
    ]
    for (section, name, value), message in refusals:
        target = config
        for part in filter(None, section.split(".")):
            target = getattr(target, part)
        with pytest.raises(ConfigError) as error:
            setattr(target, name, value)
        assert message in one_line(error), (name, value)
    assert config.train.lr == 1.0 and config.seed == 0  # a refused value leaves the old one


def test_report_to_takes_trls_spellings() -> None:
    """TRL (transformers) writes report_to="none" and report_to="wandb"; gspo's list takes both."""
    assert Config(report_to="none").report_to == []
    assert Config(report_to="tensorboard").report_to == ["tensorboard"]
    assert load_config(None, ["report_to=none"]).report_to == []


# ---- TRL's names: every hint names values that work ---------------------------------------------------
TRL_VALUES = {  # a value a TRL user writes for each name the table knows (TRL's default where it has one)
    "learning_rate": 1e-6, "num_generations": 4, "max_completion_length": 64, "beta": 0.04,
    "epsilon_high": 4e-4, "temperature": 0.7, "top_p": 0.95, "mask_truncated_completions": True,
    "weight_decay": 0.01, "max_grad_norm": 0.5, "warmup_steps": 5, "save_steps": 20, "save_total_limit": 2,
    "eval_steps": 5, "per_device_eval_batch_size": 16, "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05, "off_policy_mask_threshold": 0.5, "model_name_or_path": "Qwen/Qwen2-0.5B",
    "importance_sampling_level": "sequence", "loss_type": "dr_grpo", "epsilon": 3e-4, "scale_rewards": False,
    "bf16": True, "use_vllm": True, "vllm_mode": "server", "lr_scheduler_type": "linear", "max_steps": 100,
    "num_train_epochs": 3.0, "save_only_model": True, "reward_weights": [1.0, 0.5],
    "per_device_train_batch_size": 12, "gradient_accumulation_steps": 4, "steps_per_generation": 4,
    "generation_batch_size": 20, "num_iterations": 2, "logging_steps": 10, "gradient_checkpointing": True,
    "log_completions": True, "top_k": 50, "min_p": 0.1, "repetition_penalty": 1.1, "fp16": True,
    "delta": 1.5, "num_generations_eval": 2, "top_entropy_quantile": 0.2, "entropy_coef": 0.01,
    "sync_ref_model": True, "multi_objective_aggregation": "normalize_then_sum", "use_liger_kernel": True,
    "warmup_ratio": 0.1, "eval_strategy": "steps", "do_eval": True, "vllm_server_base_url": "http://x:8000",
    "use_transformers_continuous_batching": True, "vllm_importance_sampling_correction": False,
    "entropy_coef_max": 0.5, "entropy_coef_delta": 0.01, "use_adaptive_entropy": True, "entropy_target": 0.3,
    "save_strategy": "no", "generation_kwargs": {"temperature": 0.7},
    "model_init_kwargs": {"torch_dtype": "bfloat16"}, "optim": "adamw_torch_fused", "disable_tqdm": True,
    "ddp_find_unused_parameters": True, "logging_strategy": "steps", "logging_first_step": True,
    "logging_dir": "logs", "run_name": "x", "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "num_completions_to_print": 4, "max_prompt_length": 512, "remove_unused_columns": False,
    "dataloader_num_workers": 2, "disable_dropout": True, "cast_lm_head_to_fp32": True, "hub_model_id": "me/model",
    "chat_template_kwargs": {"enable_thinking": False}, "entropy_coef_min": 0.01,
    "vllm_gpu_memory_utilization": 0.9, "vllm_tensor_parallel_size": 2, "adam_epsilon": 1e-6,
    "lr_scheduler_kwargs": {"num_cycles": 2}, "torch_compile": True, "deepspeed": "ds.json", "fsdp": "full_shard",
    "trust_remote_code": True, "push_to_hub": True, "overwrite_output_dir": True,
    "resume_from_checkpoint": "out/checkpoint-10", "load_best_model_at_end": True, "shuffle_dataset": False,
    "data_seed": 1, "save_safetensors": False, "tools": ["search"], "max_tool_calling_iterations": 3,
}  # fmt: skip


def test_every_trl_name_has_a_value_to_try() -> None:
    from gspo.config.trl import TRL_NAMES

    assert set(TRL_VALUES) == TRL_NAMES


@pytest.mark.parametrize("name", sorted(TRL_VALUES))
def test_every_hint_for_a_trl_name_names_values_that_work(name: str) -> None:
    """Config(**{TRL name: value}) is refused with one line that names gspo's keys and the translated
    values, which Config then takes, or, where gspo lacks the setting, what to use instead."""
    from gspo.config.trl import TrlValueError, as_code, nested, translate

    value = TRL_VALUES[name]
    with pytest.raises(ConfigError) as error:
        Config(**{name: value})
    message = one_line(error)
    assert message.startswith(f"unknown config key '{name}': TRL's {name}=")
    try:
        translation = translate(name, value)
    except TrlValueError as refusal:
        assert str(refusal) in message  # its GRPOConfig keywords: tests/test_trl.py tries each
        return
    if not translation.keys:
        assert "leave it out" in message
        return
    assert as_code(translation.keys, python=True) in message
    config = Config(**nested(translation.keys))  # the suggestion, accepted
    for key, expected in translation.keys.items():
        assert gspo.config.rules.value_of(config, key) == expected
    assert (
        load_config(None, shlex.split(as_code(translation.keys, python=False))) == config
    )  # the override form


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("importance_sampling_level", "sequence", {"train.objective": "gspo", "train.aggregation": "seq-mean-token-mean"}),
        ("loss_type", "dapo", {"train.objective": "grpo", "train.aggregation": "token-mean"}),
        ("epsilon", 0.2, {"train.eps_low": 0.2, "train.eps_high": 0.2}),  # TRL's epsilon sets both sides
        ("num_iterations", 1, {"rollout.prompts_per_step": 1, "rollout.group_size": 8, "train.minibatches": 1}),
        ("gradient_accumulation_steps", 4, {"rollout.prompts_per_step": 4, "rollout.group_size": 8, "train.minibatches": 1}),
        ("steps_per_generation", 4, {"rollout.prompts_per_step": 4, "rollout.group_size": 8, "train.minibatches": 4}),
        ("use_vllm", True, {"rollout.engine": "vllm"}),
        ("save_only_model", True, {"checkpoint.optimizer": False}),
    ],
)  # fmt: skip
def test_the_hints_that_led_nowhere_now_translate_faithfully(name: str, value, expected: dict) -> None:
    """The hints that led nowhere: importance_sampling_level -> objective 'sequence', loss_type ->
    aggregation 'dr_grpo', num_iterations -> 'train', gradient_accumulation_steps -> completions_per_step,
    use_vllm -> 'eval', epsilon -> eps_low only."""
    from gspo.config.trl import translate

    assert translate(name, value).keys == expected


# ---- rewards: a mapping, or a list of functions -----------------------------------------------------
def _brevity(prompts, completions, **_):
    return [float(len(c) < 3) for c in completions]


def test_rewards_are_a_mapping_or_a_list_of_functions_named_by_their_names(tmp_path: Path) -> None:
    config = load_config(None, [f"output_dir={tmp_path}", "rewards={number_format: 2.0}"])
    listed = resolve_rewards(config, [number_format, _brevity])
    assert [(name, weight) for name, _, weight in listed] == [("number_format", 2.0), ("_brevity", 1.0)]
    by_name = resolve_rewards(config, {"short": _brevity})
    assert [(name, weight) for name, _, weight in by_name] == [("short", 1.0)]
    assert [name for name, _, _ in resolve_rewards(config, _brevity)] == ["_brevity"]  # one function


@pytest.mark.parametrize(
    ("functions", "message"),
    [
        ([lambda p, c, **_: [0.0] * len(c)], "reward_functions[0] is a lambda, which has no name of its own"),
        ([_brevity, _brevity], "reward_functions[1]: two functions are named '_brevity'"),
        (
            ["exact_answer"],
            "reward_functions[0]='exact_answer' is a name: reward_functions takes the functions",
        ),
        ({"exact": "exact_answer"}, "config.rewards (e.g. rewards={'exact_answer': 1.0})"),
        ("exact_answer", "reward_functions='exact_answer' is a name"),
        # a raw TypeError (42), and a silent fall back to config.rewards ([]: "exactly the functions given")
        (42, "reward_functions=42 (int) is not a function, a list of functions, or a dict of them"),
        ([], "reward_functions=[] is empty: a run needs a reward"),
        ({}, "reward_functions={} is empty: a run needs a reward"),
        ("OpenAssistant/reward-model", "reward_functions='OpenAssistant/reward-model' names a model: gspo's"),
        ([torch.nn.Linear(2, 1)], "reward_functions[0] is a model (Linear): gspo's rewards are functions"),
    ],
)
def test_a_reward_that_is_not_a_named_function_is_one_line_naming_the_fix(functions, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_rewards(Config(), functions)
    assert message in one_line(error)


# ---- a datasets.Dataset as the data; Trainer.train() ------------------------------------------------
def _small(run_dir: Path, **keys) -> Config:
    """A run of seconds, written in Python: the tiny model, 2 steps of 4 prompts x 4 completions."""
    config = Config(model={"tiny": "llama"}, output_dir=str(run_dir), report_to=[], progress=False, **keys)
    config.task.num_eval = 6
    config.rollout = {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 2}
    config.train = {"steps": 2, "minibatches": 2, "lr": 1e-2}
    config.eval = {"every": 0, "max_new_tokens": 2}
    return config


@pytest.mark.slow
def test_a_dataset_trains_and_the_run_folder_keeps_its_rows_for_resume_and_eval(tmp_path: Path) -> None:
    """The rows of an in-memory Dataset train, and go into RUN/data.jsonl, which the run's config names:
    `gspo eval RUN` and `--resume` read the same examples, in the same split. Trainer.train() is run().
    The sampled completions of each step are in RUN/completions.jsonl."""
    run = tmp_path / "run"
    dataset = datasets.Dataset.from_list(ROWS)
    trainer = Trainer(_small(run), reward_functions=[number_format, correct_number], data=dataset)
    result = trainer.train()
    assert result["run_dir"] == str(run) and trainer.step == 2
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["task"]["name"] == "file" and saved["task"]["data_path"] == str(
        (run / "data.jsonl").resolve()
    )
    assert list(saved["rewards"]) == ["number_format", "correct_number"]
    kept = [json.loads(line) for line in (run / "data.jsonl").read_text().splitlines()]
    assert kept == [{"prompt": r["prompt"], "answer": r["answer"]} for r in ROWS]  # the columns used
    reloaded = build_examples(load_config(run / "config.yaml"))
    assert [e.prompt for e in reloaded[0]] == [e.prompt for e in trainer.train_examples]
    assert [e.fields for e in reloaded[1]] == [e.fields for e in trainer.eval_examples]
    # completions: every one of each step (16 <= completions_per_step), their rewards the step's mean
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 16 + [2] * 16
    assert set(rows[0]) == {"step", "prompt", "completion", "reward"}
    for step in (1, 2):
        (metrics,) = [m for m in read_metrics(run) if m["kind"] == "train" and m["step"] == step]
        rewards = [r["reward"] for r in rows if r["step"] == step]
        # exact by design: each reward is 0, 1 or 2 (two 0/1 functions, weight 1), so every sum and the
        # division by 16 are exact in float32 and float64 alike; abs=1e-6 only allows JSON's formatting
        assert sum(rewards) / 16 == pytest.approx(metrics["reward_mean"], abs=1e-6)
    assert all("What is" in r["prompt"] for r in rows)


def test_data_misuses_are_one_line_naming_the_fix(tmp_path: Path) -> None:
    dataset = datasets.Dataset.from_list(ROWS)
    cases = [
        (lambda: train(dataset), ConfigError, "train's first argument is the config"),
        (
            lambda: train(_small(tmp_path / "a"), data="rows.jsonl"),
            DataError,
            "a file goes in task.data_path",
        ),
        (
            lambda: train(_small(tmp_path / "c", task={"name": "count_letter"}), data=dataset),
            ConfigError,
            "data= gives the task's rows, and task.name='count_letter' names others",
        ),
        (
            lambda: train(_small(tmp_path / "b"), data=dataset.rename_column("prompt", "question")),
            DataError,
            "data: row 1 has no field 'prompt' (or it is null); the row has fields ['answer', 'id', "
            "'question'] (set task.prompt_field",
        ),
        (
            lambda: train(Config(), overrides=["train.lr=1e-5"]),
            ConfigError,
            "overrides= go with a config file's path",
        ),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind) as error:
            call()
        assert message in one_line(error)


def test_a_python_run_stopped_by_its_reward_names_the_python_call_that_continues_it(tmp_path: Path) -> None:
    """Its rewards are functions of the user's script: `gspo train --resume RUN` would look for a built-in
    of that name (no such reward), so the message names train(resume=..., reward_functions=[...]), which
    continues it."""
    from gspo.rewards.calling import RewardError

    calls = []

    def flaky(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 3:  # the first evaluation, step 1, then step 2 fails
            raise ConnectionError("the judge is down")
        return [float(c[:1].isdigit()) for c in completions]

    run = tmp_path / "run"
    with pytest.raises(RewardError) as error:
        train(_small(run), reward_functions=[flaky], data=ROWS)
    assert f"`train(resume={str(run)!r}, reward_functions=[flaky])`" in one_line(error)
    assert "gspo train --resume" not in str(error.value)
    result = train(resume=run, reward_functions=[flaky])  # as the message says; the judge is back
    assert len(calls) > 3 and result["run_dir"] == str(run)
    assert [m["step"] for m in read_metrics(run) if m["kind"] == "train"] == [1, 2]
