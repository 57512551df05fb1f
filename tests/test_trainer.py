"""End-to-end training on tiny random models: updates, determinism, exact resume after SIGKILL, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bounds import TINY_CHAIN, assert_sums_close, sum_rtol
from conftest import tiny_config
from gspo.cli import main
from gspo.core.layout import TokenSequence, make_micro_batches
from gspo.core.objectives import LossInputs, LossSpec, compute_loss
from gspo.learning import learner
from gspo.learning.policy import score
from gspo.rewards.calling import RewardError
from gspo.run import lock
from gspo.run.checkpoint import latest_checkpoint, load_trainer_state
from gspo.run.metrics import read_metrics
from gspo.training.launch import train
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}


def _train_metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in read_metrics(run_dir)]


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(latest_checkpoint(run_dir) / "model")
    return {k: v.clone() for k, v in model.state_dict().items()}


OBJECTIVE_RUNS = [
    ["train.objective=gspo"],
    ["train.objective=gspo_token"],
    ["train.objective=grpo"],
    ["train.objective=gmpo", "train.sampler_correction=sequence_mask", "train.opsm_delta=0.5"],
    ["train.objective=sapo", "train.sampler_correction=token_truncate"],
    ["train.objective=sapo_seq", "train.tau_neg=2.0"],
    ["train.objective=cispo", "train.aggregation=token-mean"],
    [
        "train.objective=grpo",
        "train.aggregation=seq-mean-token-sum-norm",
        "train.advantage_scale=none",
    ],  # Dr. GRPO
    ["train.objective=gspo", "train.aggregation=seq-mean-token-sum"],  # LUSPO
]


@pytest.mark.parametrize("objective", OBJECTIVE_RUNS, ids=lambda o: "-".join(x.split("=")[1] for x in o))
def test_one_step_changes_parameters_with_finite_metrics(
    tmp_path: Path, objective: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rollout batch, 2 minibatches: the first update is on-policy (every ratio 1 up to the sampler's
    rounding: nothing clipped), the second is not (the first moved the policy); the step reports each
    metric over both updates (mean; min / max of the extremes)."""
    updates: list[dict] = []  # each optimizer update's metrics, as learner.update returns them
    update = learner.update
    monkeypatch.setattr(learner, "update", lambda *a: updates.append(update(*a)) or updates[-1])
    trainer = Trainer(tiny_config(tmp_path / "run", *objective, "train.steps=1", "checkpoint.every=0"))
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    metrics = trainer.train_step()
    after = trainer.policy.model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])], "no parameter moved"
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values()), metrics
    # fp32: the sampler's KV-cache steps and the trainer's scoring round differently, by <= n*u with n ~ 1e3
    # along the 2-layer width-64 path (6e-5) plus ulp(5) = 5e-7 per log-prob; one update moves them by ~0.1
    assert metrics["sampler_logprob_abs_diff"] < 1e-4
    on, off = updates
    # on-policy up to that rounding: ratios within 1e-4 of 1, inside every objective's clip band (>= 3e-4)
    assert on["ratio_token_min"] == pytest.approx(1.0, abs=1e-4) and on["clip_frac_token"] == 0.0
    assert on["ratio_token_max"] == pytest.approx(1.0, abs=1e-4)
    assert max(off["ratio_token_max"] - 1, 1 - off["ratio_token_min"]) > 1e-3  # the policy moved
    assert metrics["ratio_token_min"] == min(on["ratio_token_min"], off["ratio_token_min"])
    assert metrics["ratio_token_max"] == max(on["ratio_token_max"], off["ratio_token_max"])
    assert metrics["clip_frac_token"] == pytest.approx((on["clip_frac_token"] + off["clip_frac_token"]) / 2)


def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_master_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = ("train.steps=1", "checkpoint.every=0")
    exact = Trainer(tiny_config(tmp_path / "fp32" / "run", *common))
    mixed = Trainer(tiny_config(tmp_path / "bf16" / "run", "train.mixed_precision=bf16", *common))
    sequences = [
        TokenSequence([5, 6, 7, 8], [9, 10, 11], [True] * 3),
        TokenSequence([12, 13], [14, 15], [True] * 2),
    ]
    (mb,) = make_micro_batches(sequences, layout="packed", pack_length=64, micro_batch_tokens=1024, pad_id=0)
    with torch.no_grad():  # the same initial weights, scored in fp32 and in bf16
        gap = (
            (score(exact.policy.scorer, mb, exact.spec) - score(mixed.policy.scorer, mb, mixed.spec))
            .abs()
            .max()
        )
    assert 1e-5 < gap < 0.05, "bf16 rounding shows in the log-probs, and only rounding"
    # old_logprobs=auto: the in-process sampler's log-probs serve in fp32 only; bf16 decoding and scoring
    # round differently, beyond GSPO's clip band, so the bf16 run recomputes
    assert (exact.spec.old_logprobs, mixed.spec.old_logprobs) == ("sampler", "recompute")

    updates: list[dict] = []  # each optimizer update's metrics
    update = learner.update
    monkeypatch.setattr(learner, "update", lambda *a: updates.append(update(*a)) or updates[-1])
    before = {k: v.clone() for k, v in mixed.policy.model.state_dict().items()}
    metrics = mixed.train_step()
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values()), metrics
    # the first minibatch is on-policy and recomputed in bf16 like the update: ratios 1, nothing clipped
    on, off = updates
    assert (on["ratio_token_min"], on["ratio_token_max"], on["clip_frac_token"]) == (1.0, 1.0, 0.0)
    assert max(off["ratio_token_max"] - 1, 1 - off["ratio_token_min"]) > 1e-3  # the policy moved
    assert metrics["old_logprobs_recomputed"] == 1.0
    params = dict(mixed.policy.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}  # master weights
    assert {p.grad.dtype for p in params.values() if p.grad is not None} == {torch.float32}
    assert any(not torch.equal(before[k], p) for k, p in params.items())


def test_two_seeded_runs_give_identical_metrics(tmp_path: Path) -> None:
    train(tiny_config(tmp_path / "a" / "run", "train.steps=2"))
    train(tiny_config(tmp_path / "b" / "run", "train.steps=2"))
    a, b = _train_metrics(tmp_path / "a" / "run"), _train_metrics(tmp_path / "b" / "run")
    assert a == b
    assert len([r for r in a if r["kind"] == "train"]) == 2


def test_every_layout_of_the_trainers_rollouts_gives_the_same_gradients(tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tmp_path / "run"))
    group_size = trainer.config.rollout.group_size
    rollouts = trainer.sampler.generate(
        trainer.rollouts.prompts(trainer.rollouts.stream.next_batch()),
        group_size=group_size,
        max_new_tokens=6,
    )
    sequences = [
        TokenSequence(p, c, [True] * len(c))
        for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids, strict=False)
    ]
    advantages = torch.linspace(-1, 1, len(sequences))
    grads, rows = {}, {}
    for layout in ("shared_prefix", "packed", "padded"):
        trainer.policy.model.zero_grad()
        micro = make_micro_batches(
            sequences, layout=layout, pack_length=256, micro_batch_tokens=256, pad_id=0
        )
        assert len(micro) > 1  # several micro-batches: accumulation is exercised too
        rows[layout] = max(len(mb.indices) for mb in micro)
        for mb in micro:
            logp = score(trainer.policy.model, mb, trainer.spec)
            old = logp.detach() - 0.01  # off-policy, so clipping and ratios matter
            inputs = LossInputs(
                logp, old, advantages[mb.indices], mb.segment_ids, len(mb.indices), normalizer=len(sequences)
            )
            loss, _ = compute_loss(LossSpec("gspo", eps_low=0.2, eps_high=0.2), inputs)
            loss.backward()
        grads[layout] = torch.cat([p.grad.reshape(-1) for p in trainer.policy.model.parameters()])
    assert grads["padded"].abs().sum() > 0
    assert rows["packed"] > 1 and rows["shared_prefix"] > 1  # several sequences share a row
    # Bound: the layouts sum the same terms in other orders: a weight's gradient adds every token's term
    # (16 sequences of 68 tokens) through a chain of the tiny model's sums (bounds.py). A token that attends
    # across a segment boundary moves its log-prob by ~1e-2.
    rho = TINY_CHAIN * sum_rtol(len(sequences) * 68)
    assert_sums_close(grads["packed"], grads["padded"], rho)
    assert_sums_close(grads["shared_prefix"], grads["padded"], rho)


def test_lora_and_kl_run_and_save_an_adapter(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path / "run",
        "lora.rank=4",
        "lora.target_modules=[q_proj, v_proj]",
        "train.beta=0.1",
        "train.steps=1",
    )
    result = train(config)
    checkpoint = latest_checkpoint(result["run_dir"])
    assert (checkpoint / "model" / "adapter_config.json").is_file()
    line = next(r for r in read_metrics(result["run_dir"]) if r["kind"] == "train")
    assert line["kl"] is not None and line["kl"] >= 0.0


def test_reward_error_names_the_function_and_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    calls = {"n": 0}

    def flaky(prompts, completions, **_):
        calls["n"] += 1
        if calls["n"] == 3:  # calls: the step-0 eval, step 1's rollout, step 2's rollout
            raise ZeroDivisionError("boom")
        return [0.0] * len(completions)

    config = tiny_config(tmp_path / "run", "rewards={flaky: 1.0}", "checkpoint.every=0", "eval.every=0")
    trainer = Trainer(config, reward_functions={"flaky": flaky})
    with pytest.raises(RewardError, match="flaky"):
        trainer.run()
    # checkpoint.every=0 saved only step 0; the error saved the state at the start of step 2
    checkpoint = latest_checkpoint(trainer.run_dir)
    assert load_trainer_state(checkpoint)["step"] == 1
    AutoModelForCausalLM.from_pretrained(checkpoint / "model")


@pytest.mark.parametrize("where", ["sampling", "weight_sync"])
def test_a_server_failure_keeps_the_run_and_its_resume_ends_where_an_unbroken_run_does(
    tmp_path: Path, where: str
) -> None:
    """The sampling server fails at step 2 (checkpoint.every=0: only step 0 saved): while drawing, the
    state at the step's start is kept; after the update, when the engine refuses the new weights, the
    update is kept. Either way `--resume` ends with the weights of a run that never failed."""
    from gspo.rollout.openai import ServerError

    overrides = ("train.steps=3", "checkpoint.every=0", "eval.every=0")
    train(tiny_config(tmp_path / "unbroken", *overrides))
    trainer = Trainer(tiny_config(tmp_path / "run", *overrides))
    sample, sync = trainer.sample, trainer.sampler.sync_weights

    def failing_sample():
        if trainer.step == 1 and where == "sampling":
            raise ServerError("http://127.0.0.1:1/v1: connection refused")
        return sample()

    def failing_sync(model, tokenizer, step):
        if step == 2 and where == "weight_sync":
            raise ServerError("the weight sync failed")
        sync(model, tokenizer, step)

    trainer.sample, trainer.sampler.sync_weights = failing_sample, failing_sync
    with pytest.raises(ServerError, match=r"the run is kept up to step (\d).*gspo train --resume") as error:
        trainer.run()
    lock.release(trainer.run_dir)
    kept = {"sampling": "1", "weight_sync": "2"}[where]
    assert error.value.args[0].split("kept up to step ")[1].startswith(kept)
    assert load_trainer_state(latest_checkpoint(trainer.run_dir))["step"] == int(kept)
    train(resume=trainer.run_dir)
    unbroken, resumed = _final_params(tmp_path / "unbroken"), _final_params(trainer.run_dir)
    assert all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gspo", *args],
        cwd=cwd,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_reports_config_errors_clearly(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # in-process: test_cli_runs_the_tiny_config_end_to_end starts the process
    assert main(["train", str(TINY), "train.lrr=1"]) == 3  # EXIT_CODES["config"]
    assert "unknown config key 'train.lrr'; did you mean 'lr'" in capsys.readouterr().err
    assert main(["train", str(TINY), "rollout.group_size=many"]) == 3
    assert "rollout.group_size: expected an integer, got 'many'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing was started


KILLER = """
import os, signal, time
from pathlib import Path
from gspo.rewards.builtins import correct_number

def reward(prompts, completions, **fields):
    counter = Path(os.environ["KILL_COUNTER"])
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    if n == int(os.environ.get("KILL_AT", "0")):
        # the previous step's checkpoint is written in the background while this batch is drawn: the kill
        # waits for it to be the latest, so the run always dies with it in place (a loaded machine lagged)
        latest, deadline = Path(os.environ["KILL_AFTER"]), time.monotonic() + 120
        while time.monotonic() < deadline and not (latest.is_file() and latest.read_text() == "step_000002"):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)  # a real SIGKILL in the middle of a step
    return correct_number(prompts, completions, **fields)
"""


def test_sigkill_and_resume_equals_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "killer.py").write_text(KILLER)
    common = [
        "train.steps=4",
        "eval.every=2",
        "checkpoint.every=1",
        "report_to=[]",
        f"rewards={{{tmp_path / 'killer.py'}:reward: 1.0}}",
    ]
    monkeypatch.setenv("KILL_COUNTER", str(tmp_path / "count_full"))  # the uninterrupted run: in-process
    assert main(["train", str(TINY), f"output_dir={tmp_path / 'full'}", *common]) == 0

    env_kill = {
        "KILL_COUNTER": str(tmp_path / "count"),
        "KILL_AT": "5",
        "KILL_AFTER": str(tmp_path / "resumed" / "checkpoints" / "latest"),
    }  # reward calls: eval 0, steps 1-2, eval 2, step 3
    killed = _cli(
        "train", str(TINY), f"output_dir={tmp_path / 'resumed'}", *common, cwd=tmp_path, env=env_kill
    )
    assert killed.returncode == -9, killed.stderr
    assert load_trainer_state(latest_checkpoint(tmp_path / "resumed"))["step"] == 2
    resumed = _cli(  # our own reward file: trusted (a run folder's code is not, by default)
        "train", "--resume", str(tmp_path / "resumed"), "--trust-run-folder", cwd=tmp_path, env=env_kill
    )  # counter > 3 now
    assert resumed.returncode == 0, resumed.stderr

    assert _train_metrics(tmp_path / "resumed") == _train_metrics(tmp_path / "full")
    a, b = _final_params(tmp_path / "full"), _final_params(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_runs_the_tiny_config_end_to_end(tmp_path: Path, capsys) -> None:
    result = _cli("train", str(TINY), "output_dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    assert "held-out accuracy:" in result.stdout
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "summary.md",
        "plots/reward.png",
        "plots/clip_fractions.png",
    ):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").iterdir())
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, 11))
    evals = [r for r in lines if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4, 6, 8, 10]
    # the smoke run shows learning: the answer's format (a bare number), which the first reward scores,
    # greedy (the held-out accuracy) and sampled alike (the share of bare numbers among the training
    # completions: 0.06 -> 0.62 at seed 0; it fell from 0.06 to 0 when the two disagreed)
    assert evals[0]["accuracy"] == 0.0 and evals[-1]["accuracy"] == 1.0
    sampled = [r["reward/number_format"] for r in lines if r["kind"] == "train"]
    assert sampled[0] <= 0.1 and sampled[-1] >= 0.5, sampled
    assert "held-out accuracy: 0.000 -> 1.000" in result.stdout
    AutoModelForCausalLM.from_pretrained(latest_checkpoint(run) / "model")
    capsys.readouterr()
    assert main(["plot", str(run)]) == 0 and "reward.png" in capsys.readouterr().out


def test_how_often_a_run_evaluates_changes_nothing_it_trains_on(tmp_path: Path) -> None:
    """Evaluations draw from a seed stream of their own (gspo.core.seeds.evaluation_seed)."""
    params, lines = {}, {}
    for every in (0, 1):
        trainer = Trainer(tiny_config(tmp_path / f"every{every}", "train.steps=3", f"eval.every={every}"))
        trainer.run()
        params[every] = [p.detach().clone() for p in trainer.policy.model.parameters()]
        lines[every] = [r for r in _train_metrics(tmp_path / f"every{every}") if r["kind"] == "train"]
    assert lines[0] == lines[1]
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[1], strict=True))
    evals = [r for r in read_metrics(tmp_path / "every1") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2, 3]
