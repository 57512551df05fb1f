"""gspo.trl's GRPOTrainer as TRL code uses it: async rewards, TRL's keywords, multi-task None rewards, a
reward model by folder or hub id beside gspo's named rewards, resuming from TRL's and gspo's checkpoint
paths with a new GRPOConfig, eval_dataset, callbacks, trainer.state, trainer.model, a model object, and
train()'s TrainOutput. Each run is the tiny random Llama for 2 to 6 rollout batches of 3 tokens."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from conftest import HUB_REVISION
from gspo.config import ConfigError, load_config
from gspo.models import tiny_model, tiny_tokenizer
from gspo.run.checkpoint import latest_checkpoint
from gspo.run.metrics import read_metrics
from gspo.trl import GRPOConfig, GRPOTrainer

datasets = pytest.importorskip("datasets", reason="the train extra installs datasets")


def tiny_args(out: Path, **settings) -> GRPOConfig:
    """A run of 2 rollout batches (one prompt x 4 completions of up to 3 tokens) into `out`, each batch's
    groups its own (no dynamic sampling: the rewards score each batch once)."""
    defaults = dict(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=3, learning_rate=1e-2,
    )  # fmt: skip
    gspo = {"rollout": {"dynamic_sampling": False}} | settings.pop("gspo", {})
    return GRPOConfig(**(defaults | settings), gspo=gspo)


def rows(n: int = 4, **columns) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [
            {"prompt": f"Say something about row {i}.", **{k: v[i] for k, v in columns.items()}}
            for i in range(n)
        ]
    )


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def char_codes(completions, **kwargs):
    """The completion's character codes summed, mod 7: a spread within every group of random tokens
    (reward_len gives each 3-character completion of the tiny model -17)."""
    return [float(sum(map(ord, completion)) % 7) for completion in completions]


def trained(run: Path, kind: str = "train") -> list[dict]:
    return [m for m in read_metrics(run) if m["kind"] == kind]


def completions(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]


class Steps(TrainerCallback):
    """The optimizer updates (state.global_step) at each on_step_end."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


# ---- reward functions ----------------------------------------------------------------------------------
def test_an_async_reward_function_is_awaited_and_keeps_its_attributes(
    tiny_folder: str, tmp_path: Path
) -> None:
    """An `async def` reward stays one through TRL's calling convention (it was wrapped in a plain def,
    whose coroutine the run refused), and keeps its attributes: gspo calls its validate_example on every
    row at start-up. Each completion's reward is the function's value."""
    checked: list[dict] = []

    async def brevity(completions, **kwargs):
        await asyncio.sleep(0)
        return [-float(len(c)) for c in completions]

    brevity.validate_example = checked.append
    trainer = GRPOTrainer(tiny_folder, brevity, tiny_args(tmp_path / "run"), rows(answer=list("abcd")))
    wrapped = trainer.reward_funcs[0]
    assert inspect.iscoroutinefunction(wrapped) and wrapped.__name__ == "brevity"
    assert wrapped.validate_example is brevity.validate_example
    trainer.train()
    assert sorted(f["answer"] for f in checked) == list("abcd")  # each training row, at start-up
    done = completions(tmp_path / "run")
    assert len(done) == 2 * 4 and all(c["reward"] == -len(c["completion"]) for c in done)


def test_reward_functions_get_trls_keywords_and_may_score_some_samples(
    tiny_folder: str, tmp_path: Path
) -> None:
    """TRL's keywords where a function takes them: completion_ids (each completion's token ids),
    trainer_state (global_step: the optimizer updates before the rollout batch, 2 per batch here),
    log_metric (logged with the step's metrics), log_extra (taken), the columns; none of gspo's own
    (group_ids, example_prompts). Two multi-task rewards each score their task's rows and return None for
    the others: each completion's reward is its own task's."""
    seen: list[dict] = []

    def spy(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, task, **kwargs):
        seen.append({"ids": completion_ids, "step": trainer_state.global_step, "others": sorted(kwargs)})
        log_metric("spy_tokens", sum(map(len, completion_ids)) / len(completion_ids))
        log_extra("task", task)
        return [0.0] * len(completions)

    def task_a(completions, task, **kwargs):
        return [1.0 if t == "a" else None for t in task]

    def task_b(completions, task, **kwargs):
        return [0.5 if t == "b" else None for t in task]

    # 8 completions (2 prompts x 4) per rollout batch, 2 updates on it: TRL's max_steps=4 is 2 batches
    args = tiny_args(tmp_path / "run", max_steps=4, steps_per_generation=2)
    data = rows(8, task=list("abababab"))
    GRPOTrainer(tiny_folder, [spy, task_a, task_b], args, data).train()
    assert [s["step"] for s in seen] == [0, 2]
    assert all(s["others"] == [] for s in seen)  # the columns are named; no group_ids, no example_prompts
    tokenizer = tiny_tokenizer()
    done = completions(tmp_path / "run")
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for s in seen for ids in s["ids"]]
    assert texts == [c["completion"] for c in done]
    assert all(1 <= len(ids) <= 3 for s in seen for ids in s["ids"])
    for c in done:  # rows 0, 2, 4, 6 are task a's
        assert c["reward"] == (1.0 if int(re.search(r"row (\d)", c["prompt"])[1]) % 2 == 0 else 0.5)
    logged = trained(tmp_path / "run")
    assert [m["spy_tokens"] for m in logged] == [sum(map(len, s["ids"])) / 8 for s in seen]


# ---- resume -------------------------------------------------------------------------------------------
def test_a_new_grpo_config_resumes_the_run_for_its_new_length(
    tiny_folder: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After 4 steps, GRPOTrainer(args=GRPOConfig(max_steps=6)).train(resume_from_checkpoint=True) trains
    steps 5 and 6 and says what changed; a change the checkpoint was trained with (learning_rate) is
    refused, naming it."""
    run, data = tmp_path / "run", rows()
    first = GRPOTrainer(tiny_folder, reward_len, tiny_args(run, max_steps=4), data).train()
    assert first.global_step == 4
    with pytest.raises(ConfigError) as error:
        GRPOTrainer(tiny_folder, reward_len, tiny_args(run, max_steps=6, learning_rate=2e-2), data).train(
            resume_from_checkpoint=True
        )
    assert "this GRPOConfig changes learning_rate (train.lr: 0.01 -> 0.02)" in str(error.value)
    steps = Steps()
    trainer = GRPOTrainer(tiny_folder, reward_len, tiny_args(run, max_steps=6), data, callbacks=[steps])
    out = trainer.train(resume_from_checkpoint=True)
    assert steps.steps == [5, 6] and out.global_step == 6
    assert [m["step"] for m in trained(run)] == [1, 2, 3, 4, 5, 6]
    assert load_config(run / "config.yaml").train.steps == 6
    assert f"note: resuming {run} with train.steps 4 -> 6" in capsys.readouterr().err


def test_trls_and_gspos_checkpoint_paths_resume_that_step(tiny_folder: str, tmp_path: Path) -> None:
    """OUTPUT_DIR/checkpoint-2 (TRL's form) and OUTPUT_DIR/checkpoints/step_000002 (gspo's) resume step 2
    of a run whose latest checkpoint is step 4: steps 3 and 4 train again. Another path, or a step the
    run does not hold, is one line naming what works."""
    run, data = tmp_path / "run", rows()
    args = tiny_args(run, max_steps=4, save_steps=2, save_total_limit=2)
    GRPOTrainer(tiny_folder, reward_len, args, data).train()
    for path in (run / "checkpoint-2", run / "checkpoints" / "step_000002"):
        steps = Steps()
        out = GRPOTrainer(tiny_folder, reward_len, args, data, callbacks=[steps]).train(
            resume_from_checkpoint=str(path)
        )
        assert steps.steps == [3, 4] and out.global_step == 4, path
        assert [m["step"] for m in trained(run)] == [1, 2, 3, 4]
    trainer = GRPOTrainer(tiny_folder, reward_len, args, data)
    for path, said in (
        (run / "checkpoint-3", "holds no complete checkpoint of gspo's step 3 (its checkpoints: checkpoint-2, checkpoint-4;"),
        (run / "model", "give True (the latest checkpoint of output_dir), TRL's OUTPUT_DIR/checkpoint-N (after N "
         "optimizer updates) or gspo's OUTPUT_DIR/checkpoints/step_NNNNNN"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            trainer.train(resume_from_checkpoint=str(path))
        assert said in str(error.value) and "\n" not in str(error.value)


# ---- TRL's names for what gspo has: a reward model, gspo's named rewards -------------------------------------
@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama sequence classifier (one label) and its tokenizer, as a model folder."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("reward_model")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_reward_model_folder_and_gspos_named_rewards_join_the_functions(
    tiny_folder: str, reward_model: Path, tmp_path: Path
) -> None:
    """reward_funcs=[f, FOLDER] scores with f and gspo's reward_model (named "reward_model");
    gspo={'rewards': {'number_format': 0.5}} adds that built-in: the run's rewards are all three, weighed
    by reward_weights (in reward_funcs' order) and gspo's own."""
    args = tiny_args(tmp_path / "run", reward_weights=[2.0, 1.0], gspo={"rewards": {"number_format": 0.5}})
    trainer = GRPOTrainer(tiny_folder, [reward_len, str(reward_model)], args, rows())
    assert trainer.config.rewards == {"reward_len": 2.0, "reward_model": 1.0, "number_format": 0.5}
    run = Path(trainer.train().metrics["run_dir"])
    saved = load_config(run / "config.yaml")
    assert saved.rewards == trainer.config.rewards and saved.reward_model.path == str(reward_model)
    line = trained(run)[0]
    assert {"reward/reward_len", "reward/reward_model", "reward/number_format"} <= set(line)
    # the weighted sum of the means is the mean of the weighted sums (float32 sums of 4 terms, then a mean)
    total = 2.0 * line["reward/reward_len"] + line["reward/reward_model"] + 0.5 * line["reward/number_format"]
    assert line["reward_mean"] == pytest.approx(total, rel=1e-5, abs=1e-5)


def test_a_reward_models_hub_id_is_found_in_the_local_cache(
    tiny_folder: str, reward_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--me--tiny-rm"
    shutil.copytree(reward_model, repo / "snapshots" / HUB_REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_REVISION)
    trainer = GRPOTrainer(tiny_folder, [reward_len, "me/tiny-rm"], tiny_args(tmp_path / "run"), rows())
    assert trainer.config.reward_model.path == str(repo / "snapshots" / HUB_REVISION)
    with pytest.raises(ConfigError, match=r"holds no model 'me/other-rm': gspo downloads nothing"):
        GRPOTrainer(tiny_folder, [reward_len, "me/other-rm"], tiny_args(tmp_path / "run"), rows())


# ---- eval_dataset, callbacks, state, model, a model object ------------------------------------------------------
class Recorder(TrainerCallback):
    """Every event, with the logs or metrics it got."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, dict | None]] = []

    def on_init_end(self, args, state, control, **kwargs):
        self.events.append(("init_end", state.global_step, None))

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("train_begin", state.global_step, None))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step, None))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, dict(logs)))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", state.global_step, dict(metrics)))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("train_end", state.global_step, None))


def test_trls_trainer_surface_over_a_run(tiny_folder: str, tmp_path: Path) -> None:
    """A model object (saved into output_dir/base_model/ with processing_class, and trained from there),
    eval_dataset's rows evaluated every eval_steps, a TrainerCallback class told each event,
    trainer.state's log_history as metrics.jsonl holds it, trainer.model the latest checkpoint's weights,
    and train()'s TrainOutput."""
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", len(tokenizer), 0)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    run = tmp_path / "run"
    args = tiny_args(run, eval_strategy="steps", eval_steps=1)
    held = datasets.Dataset.from_list([{"prompt": "Held out one."}, {"prompt": "Held out two."}])
    trainer = GRPOTrainer(
        model, char_codes, args, rows(), eval_dataset=held, processing_class=tokenizer, callbacks=[Recorder]
    )
    (recorder,) = trainer.callbacks
    out = trainer.train()
    assert load_config(run / "config.yaml").model.path == os.path.abspath(run / "base_model")
    assert (run / "base_model" / "config.json").is_file() and (run / "eval_data.jsonl").is_file()
    lines = read_metrics(run)
    assert [(m["kind"], m["step"]) for m in lines] == [
        ("eval", 0), ("train", 1), ("eval", 1), ("train", 2), ("eval", 2),
    ]  # fmt: skip
    history = [
        {**{("eval_" if m["kind"] == "eval" else "") + k: v for k, v in m.items() if k not in ("step", "kind")},
         "step": m["step"]}
        for m in lines
    ]  # fmt: skip
    assert trainer.state.log_history == history and trainer.state.global_step == 2
    names = [e[0] for e in recorder.events]
    assert names == ["init_end", "train_begin", "log", "evaluate", "step_end", "log", "log", "evaluate",
                     "step_end", "log", "log", "evaluate", "train_end"]  # fmt: skip
    logged = [e[2] for e in recorder.events if e[0] == "log"]
    assert logged == [{k: v for k, v in h.items() if k != "step"} for h in history]
    assert out.global_step == 2 and out.metrics["run_dir"] == str(run)
    assert out.training_loss == sum(m["loss"] for m in lines if m["kind"] == "train") / 2
    saved = load_file(latest_checkpoint(run) / "model" / "model.safetensors")
    weights = dict(trainer.model.named_parameters())
    assert all(torch.equal(weights[name], saved[name]) for name in saved)
    assert any(not torch.equal(initial[name], saved[name]) for name in saved)  # it trained
