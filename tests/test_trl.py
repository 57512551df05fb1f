"""gspo.trl: TRL's own GRPO code runs with one change, its import; GRPOConfig translates TRL's names
faithfully, and every refusal names keywords that work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import plant_hub_dataset, plant_hub_model
from gspo.config import ConfigError
from gspo.config.trl import LACKING, TrlValueError
from gspo.models import save_model, tiny_model, tiny_tokenizer
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
    **{name: {name: "x" if isinstance(default, str) else 7 if default in (None, 0, 1.0) else not default}
       for name, (default, _, _) in LACKING.items()},  # TRL takes these values; gspo has no such setting
}  # fmt: skip


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


def test_every_trl_name_of_the_table_is_a_setting_of_grpo_config() -> None:
    from gspo.config.trl import TRL_NAMES

    assert TRL_NAMES - {"model_name_or_path", "eval_steps", "per_device_eval_batch_size"} <= set(
        GRPOConfig.__dataclass_fields__
    )


def test_a_name_grpo_config_does_not_take_is_one_line_naming_the_gspo_escape() -> None:
    with pytest.raises(ConfigError) as error:
        GRPOConfig(learnin_rate=1e-5)
    message = str(error.value)
    assert (
        "(did you mean 'learning_rate'?)" in message
        and "GRPOConfig(gspo={'task': {'num_eval': 20}})" in message
    )
    assert (
        GRPOConfig(gspo={"task": {"num_eval": 20}}).gspo_config(rows=40, reward_names=[]).task.num_eval == 20
    )
    with pytest.raises(ConfigError, match=r"^GRPOConfig\(learning_rate=-1\.0\): train\.lr must be > 0"):
        GRPOConfig(learning_rate=-1.0)


# ---- GRPOTrainer ------------------------------------------------------------------------------------------
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama saved as a model folder (model= takes a folder as well as a hub id)."""
    folder = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = tiny_tokenizer()
    save_model(tiny_model("llama", len(tokenizer), 0), tokenizer, folder)
    return str(folder)


def test_grpo_trainer_refuses_what_gspo_lacks_in_one_line_naming_the_fix(tiny_folder: str, tmp_path) -> None:
    rows = datasets.Dataset.from_list([{"prompt": p} for p in POSTS])
    args = GRPOConfig(output_dir=str(tmp_path / "run"))
    cases = [
        (dict(model=torch.nn.Linear(1, 1)), "gspo loads the model itself, from a hub id in your Hugging Face cache"),
        (dict(reward_funcs="OpenAssistant/reward-model"), "a reward model (an id or a model) is not supported"),
        (dict(reward_funcs=torch.nn.Linear(1, 1)), "gspo's rewards are Python functions"),
        (dict(reward_funcs=lambda completions, **kw: [0.0]), "is a lambda, which has no name of its own"),
        (dict(eval_dataset=rows), "GRPOTrainer(eval_dataset=...): gspo evaluates on rows of train_dataset"),
        (dict(processing_class=tiny_tokenizer()), "gspo loads the model's own tokenizer"),
        (dict(train_dataset=rows.rename_column("prompt", "query")), "train_dataset has no 'prompt' column"),
        (dict(train_dataset=rows.to_iterable_dataset()), "without a length: gspo draws its rollout batches"),
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
        assert message in str(error.value) and "\n" not in str(error.value), change


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
    result = trainer.train()
    prompts, completions, targets, others = seen[0]
    assert len(prompts) == len(completions) == len(targets) == 4  # one prompt x G=4
    assert (
        prompts[0] in [r["prompt"] for r in rows]
        and targets[0] == rows[[r["prompt"] for r in rows].index(prompts[0])]["target"]
    )
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    assert others == []  # no "prompt" and no "completion" among the keywords, as TRL
    metrics = [m for m in read_metrics(result["run_dir"]) if m["kind"] == "train"]
    assert len(metrics) == 2 and "reward/think_format_reward" in metrics[0]
    kept = [json.loads(line) for line in (Path(result["run_dir"]) / "data.jsonl").read_text().splitlines()]
    assert [k["prompt"] for k in kept] == [r["prompt"] for r in rows]
    exported = trainer.save_model()
    assert (exported / "config.json").is_file() and exported.parent == Path(result["run_dir"]) / "export"


def test_the_example_runs_in_its_smoke_mode(tmp_path: Path) -> None:
    """examples/trl_quickstart (SmolLM2 in full: minutes) on the tiny random model, as CI runs it."""
    from conftest import run_example_smoke

    done = run_example_smoke("trl_quickstart", tmp_path / "run")
    assert "reward_len: " in done.stdout and " at the first rollout batch, " in done.stdout
    assert len([m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]) == 2
