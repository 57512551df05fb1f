"""gspo.trl: TRL's quick start runs with one change, its import; GRPOConfig translates TRL's names
faithfully, and every refusal names keywords that work."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import plant_hub_dataset, plant_hub_model
from gspo.config import Config, ConfigError
from gspo.config.trl import LACKING, TrlValueError
from gspo.models import tiny_tokenizer
from gspo.run.checkpoint import latest_checkpoint
from gspo.run.metrics import read_metrics
from gspo.trl import GRPOConfig, GRPOTrainer

datasets = pytest.importorskip("datasets", reason="the train extra installs datasets")
ROOT = Path(__file__).resolve().parents[1]

TRL_QUICK_START = """\
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")

# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO", logging_steps=10)
trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
"""
"""TRL's GRPOTrainer quick start, as TRL's documentation gives it (the GRPO trainer page, TRL 0.14 on)."""

QUICK_START = TRL_QUICK_START.replace("from trl import", "from gspo.trl import")
POSTS = [
    f"SUBREDDIT: r/days\n\nPOST: Day {i}: I went out, it rained, I came back.\n\nTL;DR:" for i in range(4)
]


def test_the_quick_start_differs_from_trls_in_its_import_alone() -> None:
    changed = [
        (a, b) for a, b in zip(TRL_QUICK_START.splitlines(), QUICK_START.splitlines(), strict=True) if a != b
    ]
    assert changed == [
        ("from trl import GRPOConfig, GRPOTrainer", "from gspo.trl import GRPOConfig, GRPOTrainer")
    ]


def run_quick_start(tmp_path: Path, code: str) -> Path:
    """`code` run as a user runs it, offline, with a Hugging Face cache holding what its hub ids name: the
    tiny random Llama as Qwen/Qwen2-0.5B-Instruct and 4 Reddit-style posts as trl-lib/tldr. Returns the
    run folder it wrote."""
    home = tmp_path / "hf"
    plant_hub_model(home / "hub", "Qwen/Qwen2-0.5B-Instruct")
    rows = [{"prompt": post, "completion": " It rained."} for post in POSTS]
    plant_hub_dataset(home / "datasets", "trl-lib/tldr", rows, tmp_path / "build")
    (tmp_path / "train_grpo.py").write_text(code)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_DATASETS_CACHE", None)
    done = subprocess.run(
        [sys.executable, "train_grpo.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp_path / "Qwen2-0.5B-GRPO"


def rewards_by_step(run: Path) -> list[float]:
    return [m["reward_mean"] for m in read_metrics(run) if m["kind"] == "train"]


@pytest.mark.slow
def test_trls_quick_start_trains_with_its_import_changed(tmp_path: Path) -> None:
    """TRL's defaults translated: 3 epochs of the 4 posts, each rollout batch one prompt's 8 completions
    (per_device_train_batch_size 8, num_generations 8) and one update, learning rate 1e-6, the linear
    schedule, 256-token completions, seed 42, no trackers; reward_len, called with keywords, scored each
    completion as TRL's trainer would; the weights moved."""
    run = run_quick_start(tmp_path, QUICK_START)
    saved = json.loads(json.dumps(__import__("yaml").safe_load((run / "config.yaml").read_text())))
    assert saved["seed"] == 42 and saved["report_to"] == []
    assert (saved["rollout"]["prompts_per_step"], saved["rollout"]["group_size"]) == (1, 8)
    assert saved["rollout"]["max_new_tokens"] == 256
    train = saved["train"]
    assert (train["objective"], train["aggregation"]) == ("gspo", "seq-mean-token-mean")  # TRL's GSPO recipe
    assert (train["lr"], train["schedule"], train["minibatches"], train["steps"]) == (1e-6, "linear", 1, 12)
    assert train["adam_betas"] == [0.9, 0.999]
    assert len(rewards_by_step(run)) == 12
    completions = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 12 * 8
    assert all(c["reward"] == -abs(20 - len(c["completion"])) for c in completions)
    planted = load_file(tmp_path / "hf" / "hub" / "models--Qwen--Qwen2-0.5B-Instruct" / "snapshots" / ("0" * 40)
                        / "model.safetensors")  # fmt: skip
    trained = load_file(latest_checkpoint(run) / "model" / "model.safetensors")
    assert any(not torch.equal(planted[name], trained[name]) for name in planted)


@pytest.mark.slow
def test_trls_quick_start_learns_at_a_learning_rate_for_a_random_model(tmp_path: Path) -> None:
    """The same code with one keyword more, learning_rate=1e-2: TRL's 1e-6 moves a tiny random model too
    little to see. reward_len rises: completions of random tokens run to the 256-token limit (about 100
    characters before an end token), and the policy learns to end near 20."""
    code = QUICK_START.replace("logging_steps=10)", "logging_steps=10, learning_rate=1e-2)")
    rewards = rewards_by_step(run_quick_start(tmp_path, code))
    assert len(rewards) == 12
    later = sum(rewards[6:]) / 6
    assert rewards[0] < -80 and later > rewards[0] / 2, rewards  # the distance to 20 characters halves


# ---- GRPOConfig: TRL's names, translated ---------------------------------------------------------------
def test_trls_batch_names_and_counts_become_gspos_rollout_batch() -> None:
    """TRL's GSPO recipe with its batch: 16 completions per device x steps_per_generation 4 = 64 per
    rollout batch (16 prompts x 4), updated on 4 / 2 = 2 shares (optimizer updates); max_steps counts
    updates, gspo's train.steps rollout batches."""
    args = GRPOConfig(
        per_device_train_batch_size=16, num_generations=4, steps_per_generation=4, gradient_accumulation_steps=2,
        max_steps=20, learning_rate=3e-6, importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4,
        epsilon_high=4e-4, beta=0.0, bf16=False, report_to="none", save_only_model=True, save_steps=10,
        warmup_steps=0.1, scale_rewards="batch", max_completion_length=96,
    )  # fmt: skip
    config = args.gspo_config(rows=100, reward_names=["r"])
    rollout, train = config.rollout, config.train
    assert (rollout.prompts_per_step, rollout.group_size, train.minibatches, train.steps) == (16, 4, 2, 10)
    assert (train.objective, train.aggregation, train.eps_low, train.eps_high) == (
        "gspo",
        "seq-mean-token-mean",
        3e-4,
        4e-4,
    )
    assert (train.lr, train.beta, train.mixed_precision, train.advantage_scale) == (
        3e-6,
        0.0,
        "none",
        "batch",
    )
    assert train.warmup_updates == 2  # 10% of the 20 updates
    assert (config.checkpoint.optimizer, config.checkpoint.every, config.report_to) == (False, 5, [])
    assert (rollout.max_new_tokens, config.eval.max_new_tokens) == (96, 96)
    # epochs over the rows instead: 2 epochs of 100 rows, 16 prompts per rollout batch
    assert GRPOConfig(num_train_epochs=2, per_device_train_batch_size=16, num_generations=4,
                      steps_per_generation=4).gspo_config(rows=100, reward_names=[]).train.steps == 13  # fmt: skip
    # TRL's epsilon alone sets both sides; CISPO's epsilon_high is TRL's cap, 1 + gspo's eps_high
    assert (
        GRPOConfig(epsilon=0.2, loss_type="dapo").gspo_config(rows=1, reward_names=[]).train.eps_high == 0.2
    )
    cispo = GRPOConfig(loss_type="cispo", epsilon_high=5.0).gspo_config(rows=1, reward_names=[]).train
    assert (cispo.objective, cispo.eps_low, cispo.eps_high) == ("cispo", 1.0, 4.0)
    weighted = GRPOConfig(reward_weights=[1.0, 0.5]).gspo_config(rows=1, reward_names=["a", "b"])
    assert weighted.rewards == {"a": 1.0, "b": 0.5}


LACKING_VALUES = {  # a value TRL takes for each setting gspo lacks, which GRPOConfig refuses
    "top_k": 50, "min_p": 0.1, "repetition_penalty": 1.1, "chat_template_kwargs": {"enable_thinking": False},
    "fp16": True, "delta": 1.5, "num_generations_eval": 2, "top_entropy_quantile": 0.2, "entropy_coef_min": 0.01,
    "sync_ref_model": True, "multi_objective_aggregation": "normalize_then_sum", "use_liger_kernel": True,
    "warmup_ratio": 0.1, "vllm_server_base_url": "http://x:8000", "vllm_gpu_memory_utilization": 0.9,
    "vllm_tensor_parallel_size": 2, "use_transformers_continuous_batching": True,
    "vllm_importance_sampling_correction": False, "adam_epsilon": 1e-6, "lr_scheduler_kwargs": {"num_cycles": 2},
    "torch_compile": True, "deepspeed": "ds.json", "fsdp": "full_shard", "trust_remote_code": True,
    "push_to_hub": True, "overwrite_output_dir": True, "resume_from_checkpoint": "out/checkpoint-10",
    "load_best_model_at_end": True, "shuffle_dataset": False, "data_seed": 1, "save_safetensors": False,
    "tools": [print], "max_tool_calling_iterations": 3,
}  # fmt: skip

REFUSED = {  # for each name GRPOConfig refuses in some value: such a value, with the settings it needs
    "loss_type": {"loss_type": "vespo"},
    "importance_sampling_level": {"importance_sampling_level": "segment"},
    "vllm_mode": {"vllm_mode": "server", "use_vllm": True},
    "num_iterations": {"num_iterations": 2},
    "per_device_train_batch_size": {"per_device_train_batch_size": 12},
    "gradient_accumulation_steps": {"gradient_accumulation_steps": 3, "steps_per_generation": 4},
    "steps_per_generation": {"steps_per_generation": 3, "gradient_accumulation_steps": 2},
    "generation_batch_size": {"generation_batch_size": 20},
    "lr_scheduler_type": {"lr_scheduler_type": "polynomial"},
    "scale_rewards": {"scale_rewards": "max"},
    "max_steps": {"max_steps": 10, "steps_per_generation": 4},  # 2.5 rollout batches of 4 updates
    "num_train_epochs": {"num_train_epochs": 0},
    "save_strategy": {"save_strategy": "epoch"},
    "eval_strategy": {"eval_strategy": "epoch"},
    "generation_kwargs": {"generation_kwargs": {"top_k": 5, "temperature": 0.7}},
    "model_init_kwargs": {"model_init_kwargs": {"device_map": "auto"}},
    "optim": {"optim": "adafactor"},
    **{name: {name: value} for name, value in LACKING_VALUES.items()},  # TRL takes these; gspo has no such setting
}  # fmt: skip


def test_every_setting_gspo_lacks_has_a_value_to_try() -> None:
    assert set(LACKING_VALUES) == set(LACKING)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_refusal_of_a_trl_setting_names_keywords_that_work(name: str) -> None:
    """GRPOConfig(...) is refused in one line naming GRPOConfig keywords to use in place of the refused
    one, and the settings with those in its place are taken."""
    given = REFUSED[name]
    with pytest.raises(TrlValueError) as error:
        GRPOConfig(**given)
    message = str(error.value)
    assert "\n" not in message and message.startswith("GRPOConfig: ")
    fix = error.value.instead
    assert (f"use {', '.join(f'{k}={v!r}' for k, v in fix.items())}" if fix else "leave it out") in message
    GRPOConfig(**{k: v for k, v in given.items() if k != name} | fix)  # the suggestion, accepted


def test_every_trl_name_of_the_table_is_a_setting_of_grpo_config_and_back() -> None:
    from gspo.config.trl import TRL_NAMES

    own = {"output_dir", "seed", "report_to", "adam_beta1", "adam_beta2", "gspo"}  # one key each, as gspo's
    assert set(GRPOConfig.__dataclass_fields__) == (TRL_NAMES - {"model_name_or_path"}) | own


def gspo_of(**settings) -> Config:
    return GRPOConfig(**settings).gspo_config(rows=40, reward_names=["r"])


def test_trl_names_for_what_gspo_has_translate_to_its_keys() -> None:
    """The entropy bonus and its adaptive control, the sampling keys of generation_kwargs (over
    temperature, top_p and max_completion_length, as TRL applies them), the model's dtype, the progress
    bar, save_strategy='no', TRL's eval_steps and save_steps in optimizer updates; max_prompt_length and
    the logging names change nothing."""
    assert "entropy_coef" not in LACKING
    assert gspo_of(entropy_coef=0.01).train.entropy_coef == 0.01
    adaptive = gspo_of(use_adaptive_entropy=True, entropy_target=0.3, entropy_coef_delta=0.01).train
    assert (adaptive.entropy_target, adaptive.entropy_coef_delta) == (0.3, 0.01)
    assert gspo_of(entropy_target=0.3).train.entropy_target is None  # TRL reads it with the flag alone
    sampled = gspo_of(temperature=0.9, generation_kwargs={"temperature": 0.7, "top_p": 0.8, "max_tokens": 16})
    assert (sampled.rollout.temperature, sampled.rollout.top_p) == (0.7, 0.8)
    assert (sampled.rollout.max_new_tokens, sampled.eval.max_new_tokens) == (16, 16)
    assert gspo_of(model_init_kwargs={"torch_dtype": torch.bfloat16}).model.dtype == "bfloat16"
    assert gspo_of(disable_tqdm=True).progress is False
    assert gspo_of(save_strategy="no").checkpoint.every == 0
    # 4 updates per rollout batch: TRL's 8 updates are 2 rollout batches
    counted = gspo_of(steps_per_generation=4, save_steps=8, eval_strategy="steps", eval_steps=8, max_steps=40)
    assert (counted.train.minibatches, counted.checkpoint.every, counted.eval.every) == (4, 2, 2)
    assert gspo_of(eval_strategy="steps", logging_steps=4, max_steps=8).eval.every == 4  # eval_steps None
    assert gspo_of(max_prompt_length=16, logging_strategy="no", run_name="x") == gspo_of()


TYPES = [  # (setting, what the message names, the value it suggests)
    ({"max_steps": "10"}, "max_steps is an integer", 10),
    ({"save_steps": "1"}, "save_steps is a finite number", 1.0),
    ({"warmup_steps": "x"}, "warmup_steps is a finite number", 0),
    ({"num_train_epochs": "1"}, "num_train_epochs is a finite number", 1.0),
    ({"per_device_train_batch_size": "8"}, "per_device_train_batch_size is an integer", 8),
    ({"gradient_accumulation_steps": "2"}, "gradient_accumulation_steps is an integer", 2),
    ({"num_generations": "4"}, "num_generations is an integer", 4),
    ({"num_generations": 8.5}, "num_generations is an integer", 8),
    ({"num_generations": True}, "num_generations is an integer", 8),
    ({"bf16": "yes"}, "bf16 is True or False or None", True),
    ({"learning_rate": float("nan")}, "learning_rate is a finite number", 1e-6),
    ({"steps_per_generation": 0}, "steps_per_generation is at least 1", None),
    ({"num_generations": 1}, "num_generations is at least 2", 8),
    ({"save_steps": 0}, "save_steps is > 0", 500),
    ({"reward_weights": ["1"]}, "reward_weights is a list of finite numbers or None", None),
    ({"gspo": "train.lr=1e-5"}, "gspo is a dict of gspo's own sections", {"task": {"num_eval": 20}}),
    ({"gspo": ["train.lr=1e-5"]}, "gspo is a dict of gspo's own sections", {"task": {"num_eval": 20}}),
    ({"gspo": None}, "gspo is a dict of gspo's own sections", {"task": {"num_eval": 20}}),
]


@pytest.mark.parametrize(("given", "what", "fix"), TYPES, ids=[str(t[0]) for t in TYPES])
def test_a_value_of_the_wrong_type_or_range_is_one_line_naming_a_value_that_works(given, what, fix) -> None:
    """Checked against the field's annotation as gspo's config checks its own (an int is not a bool, a
    float takes an int, a string is no number) and against TRL's range, in the constructor and in an
    assignment; the suggested value is taken."""
    ((name, value),) = given.items()
    with pytest.raises(ConfigError) as error:
        GRPOConfig(**given)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"GRPOConfig({name}=")
    assert what in message and message.endswith(f"use {name}={fix!r}"), message
    assert "per_device_train_batch_size=8.5" not in message
    args = GRPOConfig(**{name: fix})  # the suggestion, accepted
    with pytest.raises(ConfigError, match=re.escape(what)):
        setattr(args, name, value)  # an assignment is checked as the constructor's keyword
    assert getattr(args, name) == fix


UNKNOWN = [  # (name, value, what the message says): a close name only when it is really close
    ("learnin_rate", 1e-5, "did you mean 'learning_rate'? GRPOConfig(learning_rate=1e-05)"),
    ("micro_batch_tokens", 2048, "gspo's key train.micro_batch_tokens goes in gspo=: "
     "GRPOConfig(gspo={'train': {'micro_batch_tokens': 2048}})"),
    ("micro_batch_token", 2048, "did you mean gspo's train.micro_batch_tokens? "
     "GRPOConfig(gspo={'train': {'micro_batch_tokens': 2048}})"),
    ("lr", 1e-5, "gspo's train.lr is TRL's learning_rate: GRPOConfig(learning_rate=1e-05)"),
    ("train", {"lr": 1e-5}, "gspo's train goes in gspo=: GRPOConfig(gspo={'train': {'lr': 1e-05}})"),
    ("eval_accumulation_steps", 2, "GRPOConfig has no setting 'eval_accumulation_steps', TRL's or gspo's"),
    ("max_seq_length", 512, "GRPOConfig has no setting 'max_seq_length', TRL's or gspo's"),
    ("generation_config", {}, "GRPOConfig has no setting 'generation_config', TRL's or gspo's"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value", "said"), UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_a_name_grpo_config_does_not_take_is_one_line_naming_what_fits(name, value, said) -> None:
    """A typo of a setting suggests it; a gspo key goes in gspo= with the user's value; a name that only
    shares words with a setting (max_seq_length, max_prompt_length) suggests none of them, but the gspo
    escape."""
    with pytest.raises(ConfigError) as error:
        GRPOConfig(**{name: value})
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"GRPOConfig({name}=") and said in message, message
    assert ("did you mean" in message) == ("did you mean" in said)


def test_trls_names_that_mislead_today_are_known() -> None:
    """The names whose closest spelling misled (max_prompt_length -> max_completion_length, save_strategy
    -> eval_strategy, generation_kwargs -> num_generations) are GRPOConfig's own: translated or ignored."""
    for name, value in (("max_prompt_length", 512), ("save_strategy", "steps"), ("generation_kwargs", {})):
        GRPOConfig(**{name: value})
    with pytest.raises(ConfigError) as error:
        GRPOConfig(chat_template_kwargs={"enable_thinking": False})
    assert "chat_template_kwargs={'enable_thinking': False}: gspo has no such setting" in str(error.value)
    with pytest.raises(ConfigError) as error:
        GRPOConfig(generation_kwargs={"repetition_penalty": 1.1, "temperature": 0.7})
    assert "generation_kwargs holds 'repetition_penalty'" in str(error.value)
    assert str(error.value).endswith("use generation_kwargs={'temperature': 0.7}")
    with pytest.raises(
        ConfigError, match=r"tools=\[<built-in function print>\]: gspo has no such .*docs/agents"
    ):
        GRPOConfig(tools=[print])


def test_gspos_own_keys_apply_last_and_errors_name_the_setting() -> None:
    assert (
        GRPOConfig(gspo={"task": {"num_eval": 20}}).gspo_config(rows=40, reward_names=[]).task.num_eval == 20
    )
    with pytest.raises(ConfigError, match=r"^GRPOConfig\(learning_rate=-1\.0\): train\.lr must be > 0"):
        GRPOConfig(learning_rate=-1.0)


# ---- GRPOTrainer ------------------------------------------------------------------------------------------
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def test_grpo_trainer_refuses_what_gspo_lacks_in_one_line_naming_the_fix(tiny_folder: str, tmp_path) -> None:
    rows = datasets.Dataset.from_list([{"prompt": p, "answer": "1"} for p in POSTS])
    args = GRPOConfig(output_dir=str(tmp_path / "run"))
    other_tokenizer = tiny_tokenizer()
    other_tokenizer.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    cases = [
        (dict(model=torch.nn.Linear(1, 1)), "give a hub id in your Hugging Face cache, a model folder, or a transformers model"),
        (dict(reward_funcs="no-such/reward-model"), "the Hugging Face cache holds no model 'no-such/reward-model': gspo downloads nothing"),
        (dict(reward_funcs=torch.nn.Linear(1, 1)), "reward_funcs is a model object (Linear): gspo loads a reward model from its folder"),
        (dict(reward_funcs=lambda completions, **kw: [0.0]), "is a lambda, which has no name of its own: TRL names each"),
        (dict(reward_funcs=[reward_len, reward_len]), "reward_funcs[1]: two rewards are named 'reward_len'"),
        (dict(processing_class=other_tokenizer), "gspo trains with the model's own tokenizer, which it loads with the model"),
        (dict(train_dataset=rows.rename_column("prompt", "query")), "train_dataset has no 'prompt' column"),
        (dict(train_dataset=rows.to_iterable_dataset()), "without a length: gspo draws its rollout batches"),
        (dict(train_dataset=rows.select([])), "train_dataset has no rows: give at least one"),
        (dict(train_dataset=datasets.DatasetDict({"train": rows})), "give one split, e.g. train_dataset=dataset['train']"),
        (dict(eval_dataset=rows.remove_columns("answer")), "eval_dataset has no column 'answer', which train_dataset has"),
        (dict(args={"max_steps": 2}), "GRPOTrainer(args={'max_steps': 2}): args is a GRPOConfig (from gspo.trl): args=GRPOConfig(**{'max_steps': 2})"),
        (dict(args="runs/x"), "args is a GRPOConfig (from gspo.trl): args=GRPOConfig(output_dir='runs/x')"),
        (dict(tools=[print]), "GRPOTrainer(tools=...): gspo trains tool-using agents through `gspo serve`"),
        (dict(optimizers=(object(), None)), "GRPOTrainer(optimizers=...): gspo trains with AdamW"),
        (dict(rollout_func=print), "GRPOTrainer(rollout_func=...): gspo has no such argument"),
        (dict(callbacks=[print]), "callbacks[0] is a builtin_function_or_method: give transformers.TrainerCallback"),
    ]  # fmt: skip
    for change, message in cases:
        call = {
            "model": tiny_folder,
            "reward_funcs": reward_len,
            "args": args,
            "train_dataset": rows,
            **change,
        }
        with pytest.raises(ConfigError) as error:
            GRPOTrainer(**call)
        assert message in str(error.value) and "\n" not in str(error.value), (change, str(error.value))
    from transformers import AutoTokenizer  # the model's own tokenizer is taken

    GRPOTrainer(
        tiny_folder, reward_len, args, rows, processing_class=AutoTokenizer.from_pretrained(tiny_folder)
    )


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's own config
def test_trls_own_config_is_named_with_the_import_to_change(tiny_folder: str) -> None:
    trl = pytest.importorskip("trl", reason="the dev extra installs TRL")
    rows = datasets.Dataset.from_list([{"prompt": p} for p in POSTS])
    with pytest.raises(ConfigError) as error:
        GRPOTrainer(
            tiny_folder, reward_len, trl.GRPOConfig(output_dir="x", report_to="none", bf16=False), rows
        )
    assert "TRL's own config; import gspo's as well: from gspo.trl import GRPOConfig, GRPOTrainer" in str(
        error.value
    )


def test_a_conversational_dataset_trains_and_rewards_get_trls_arguments(tiny_folder: str, tmp_path) -> None:
    """Chat-message prompts (a system prompt per row), a reward column, TRL's own think_format_reward: reward
    functions get the dataset's prompts, assistant-message completions and the other columns, as TRL
    passes them; the run trains and keeps the rows."""
    trl_rewards = pytest.importorskip("trl.rewards", reason="the dev extra installs TRL")
    rows = [
        {"prompt": [{"role": "system", "content": f"You are bot {i}."}, {"role": "user", "content": "Hi"}],
         "target": str(i), "completion": "unused"}
        for i in range(4)
    ]  # fmt: skip
    seen: list[tuple] = []

    def spy(prompts, completions, target, **kwargs):
        seen.append((prompts, completions, target, sorted(kwargs)))
        return [float(len(c[0]["content"])) for c in completions]

    # dynamic sampling on (the default): a flat group's replacement is drawn among message-list prompts
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=3, learning_rate=1e-2,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=tiny_folder,
        reward_funcs=[spy, trl_rewards.think_format_reward],
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
    )
    run = Path(trainer.train().metrics["run_dir"])
    prompts, completions, targets, others = seen[0]
    assert len(prompts) == len(completions) == len(targets) == 4  # one prompt x G=4
    assert (
        prompts[0] in [r["prompt"] for r in rows]
        and targets[0] == rows[[r["prompt"] for r in rows].index(prompts[0])]["target"]
    )
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    # TRL's keywords, no "prompt" and no "completion" among them, as TRL; none of gspo's own
    assert others == ["completion_ids", "log_extra", "log_metric", "trainer_state"]
    metrics = [m for m in read_metrics(run) if m["kind"] == "train"]
    assert len(metrics) == 2 and "reward/think_format_reward" in metrics[0]
    kept = [json.loads(line) for line in (run / "data.jsonl").read_text().splitlines()]
    assert [k["prompt"] for k in kept] == [r["prompt"] for r in rows]
    exported = trainer.save_model()
    assert (exported / "config.json").is_file() and exported.parent == run / "export"


def test_the_example_runs_in_its_smoke_mode(tmp_path: Path) -> None:
    """examples/trl_quickstart (SmolLM2 in full: minutes) on the tiny random model, as CI runs it."""
    from conftest import run_example_smoke

    done = run_example_smoke("trl_quickstart", tmp_path / "run")
    assert "reward_len: " in done.stdout and " at the first rollout batch, " in done.stdout
    assert len([m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]) == 2
