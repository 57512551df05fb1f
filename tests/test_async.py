"""Sampling ahead of the updates (rollout.lag, gspo.sampling.schedule; docs/async.md).

- lag 0 is the synchronous loop: the trainer's weights after 3 steps are those of the loop written out by
  hand (sample with the step's seed, reward, learn, sync), for every objective;
- lag 1 and 2 are reproducible from the seed: two runs give the same metrics and weights, and so does a
  run killed at random moments (SIGKILL in a forked process) and resumed, as often as it takes;
- no sample older than the lag trains, and the schedule's staleness is min(lag, step - 1);
- the decoupled objective (the clip against the recomputed proximal policy, the truncated behaviour weight)
  equals the plain loss when the behaviour is the proximal policy, and its gradient is autograd's of the
  formula written by hand;
- a failure on the sampling side stops the run with its one line and exit code, and keeps what was done.
"""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gspo.cli import main
from gspo.config import load_config
from gspo.core.objectives import LossInputs, LossSpec, compute_loss
from gspo.core.registry import OBJECTIVES
from gspo.core.samples import Sample
from gspo.core.seeds import sample_seed, step_seed
from gspo.learning.policy import UpdateSpec, update_choices, with_correction
from gspo.learning.step import learn_from_samples
from gspo.rewards.scoring import compute_rewards
from gspo.rollout.data import batch_fields
from gspo.run.checkpoint import latest_checkpoint, load_trainer_state
from gspo.run.metrics import read_metrics
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def _params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.policy.model.parameters()]


def _lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in read_metrics(run_dir)]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_lag_0_is_the_synchronous_loop_written_out(tmp_path, objective):
    overrides = ["eval.every=0", "checkpoint.every=0", f"train.objective={objective}", "train.steps=3"]
    trainer = Trainer(tiny_config(tmp_path / "pipeline", *overrides))
    for _ in range(3):
        trainer.train_step()
    by_hand = Trainer(tiny_config(tmp_path / "by_hand", *overrides))
    cfg = by_hand.config.rollout
    for step in range(1, 4):  # sample with the step's seed, reward, learn, hand the weights over
        examples = by_hand.rollouts.stream.next_batch()
        prompts = by_hand.rollouts.prompts(examples)
        rollouts = by_hand.sampler.generate(
            prompts,
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=sample_seed(by_hand.config.seed, step, 0),
        )
        rewards, _ = compute_rewards(
            by_hand.rewards,
            [p for p in prompts for _ in range(cfg.group_size)],
            rollouts.completions,
            batch_fields(examples, repeat=cfg.group_size),
        )
        samples = [
            Sample(p, c, lp, float(r), group=i // cfg.group_size, truncated=t)
            for i, (p, c, lp, r, t) in enumerate(
                zip(
                    rollouts.prompt_ids,
                    rollouts.completion_ids,
                    rollouts.sampler_logprobs,
                    rewards,
                    rollouts.truncated,
                    strict=True,
                )
            )
        ]
        learn_from_samples(
            by_hand.policy, by_hand.spec, samples, seed=step_seed(by_hand.config.seed, step - 1)
        )
        by_hand.sampler.sync_weights(by_hand.policy.model, by_hand.tokenizer, step)
    for mine, theirs in zip(_params(trainer), _params(by_hand), strict=True):
        # exact by design: the same samples, seeds, kernels and shapes in the same order
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert any(
        not torch.equal(a, b) for a, b in zip(_params(trainer), _initial(tmp_path, overrides), strict=True)
    )
    trainer.finish()
    by_hand.finish()


def _initial(tmp_path: Path, overrides: list[str]) -> list[torch.Tensor]:
    trainer = Trainer(tiny_config(tmp_path / "initial", *overrides))
    params = _params(trainer)
    trainer.finish()
    return params


@pytest.mark.parametrize("lag", [1, 2])
def test_a_lagged_run_is_reproducible_and_trains_nothing_older_than_the_lag(tmp_path, lag):
    overrides = [f"rollout.lag={lag}", "train.steps=5", "eval.every=2", "checkpoint.every=0"]
    runs = []
    for name in ("a", "b"):
        trainer = Trainer(tiny_config(tmp_path / name, *overrides))
        trainer.run()
        runs.append((_lines(tmp_path / name), _params(trainer)))
    (lines, params), (again, params_again) = runs
    assert lines == again
    for x, y in zip(params, params_again, strict=True):
        assert torch.equal(x, y)
    train = [r for r in lines if r["kind"] == "train"]
    assert [r["staleness_max"] for r in train] == [float(min(lag, s - 1)) for s in range(1, 6)]
    assert all(r["staleness_mean"] == r["staleness_max"] for r in train)  # a batch is drawn by one version
    # the first batch, drawn by the weights it trains: the sampler's log-probs are the old policy's, as at
    # lag 0; the stale ones take the decoupled objective: pi_prox recomputed, the behaviour weight
    # truncated per sequence (gspo)
    assert train[0]["old_logprobs_recomputed"] == 0.0 and "sampler_is_weight_mean" not in train[0]
    assert all(r["old_logprobs_recomputed"] == 1.0 for r in train[1:])
    assert all("sampler_is_weight_mean" in r and r["sampler_is_weight_max"] <= 2.0 for r in train[1:])
    assert any(r["sampler_is_weight_mean"] != 1.0 for r in train[1:])  # stale batches are reweighted


KILL_AT = {
    # the sampling side starts drawing batch B (a worker thread, while the trainer evaluates or saves)
    "draw": """
import os, signal
import gspo.sampling.schedule as schedule
real = schedule.draw
def draw(sampler, rewards, cfg, request, *args, **kwargs):
    if request.step == {at}:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(sampler, rewards, cfg, request, *args, **kwargs)
schedule.draw = draw
""",
    # the trainer made version S, before handing the next batch over and before saving step S
    "updated": """
import os, signal
import gspo.sampling.schedule as schedule
real = schedule.Schedule.updated
def updated(self, model, version):
    if version == {at}:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, model, version)
schedule.Schedule.updated = updated
""",
}


def _kill_points(lag: int, steps: int) -> list[tuple[str, int]]:
    """Three random moments of a run, in the order a run reaches them: a batch being drawn, a version just
    made, or the middle of a checkpoint's write (tests/forkrun.py PHASES), at random steps."""
    rng = random.Random(lag)
    at = sorted(rng.sample(range(1, steps), 3))
    # "draw" at step s: batch s + lag + 1, handed over after update s (none past the last step)
    return [(rng.choice(["updated", "mid_write"] + ["draw"] * (s + lag + 1 <= steps)), s) for s in at]


@pytest.mark.parametrize("lag", [1, 2])
def test_a_lagged_run_killed_at_random_moments_resumes_exactly(tmp_path, forkserver, lag):
    steps = 8
    common = [f"rollout.lag={lag}", f"train.steps={steps}", "checkpoint.every=1", "checkpoint.keep=2"]
    common += ["eval.every=3", "report_to=[]", "progress=false"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert forkserver(tmp_path / "ref.log", argv=["train", str(TINY), *common, f"output_dir={ref}"]) == 0
    points, codes = _kill_points(lag, steps), []
    for i, (event, step) in enumerate(points):
        started = (run / "checkpoints").is_dir()
        argv = ["train", *common, "--resume", str(run)] if started else ["train", str(TINY), *common]
        argv += [] if started else [f"output_dir={run}"]
        job = f"import gspo.cli, sys\nsys.exit(gspo.cli.main({argv!r}))\n"
        if event == "mid_write":  # the model written, the training state not yet
            codes.append(
                forkserver(
                    tmp_path / f"kill{i}.log", argv=argv, kill={"phase": event, "name": f"step_{step:06d}"}
                )
            )
        else:
            at = step + lag + 1 if event == "draw" else step
            codes.append(forkserver(tmp_path / f"kill{i}.log", code=KILL_AT[event].format(at=at) + job))
    assert codes == [-9] * len(points), f"{points}: {codes}"  # each kill landed inside the run
    argv = ["train", *common, "--resume", str(run)]
    assert forkserver(tmp_path / "last.log", argv=argv) == 0, (tmp_path / "last.log").read_text()[-2000:]
    assert _lines(run) == _lines(ref), f"killed at {points}"
    a, b = latest_checkpoint(ref), latest_checkpoint(run)
    assert load_trainer_state(a)["step"] == load_trainer_state(b)["step"] == steps
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_decoupled_objective_is_the_plain_one_when_behaviour_is_the_proximal_policy():
    """Zero staleness and matching log-probs: the truncated behaviour weight pi_prox / pi_behav is 1, so the
    decoupled loss and gradient are the plain one's, for the sequence and the token forms."""
    g = torch.Generator().manual_seed(0)
    segment_ids = torch.tensor([0] * 5 + [-1] + [1] * 7 + [2] * 4)
    prox = -torch.rand(len(segment_ids), generator=g) * 3
    for objective, correction in (("gspo", "sequence_truncate"), ("grpo", "token_truncate")):
        grads, losses = [], []
        for spec in (LossSpec(objective), LossSpec(objective, sampler_correction=correction)):
            logp = (prox + torch.linspace(-2e-3, 2e-3, len(segment_ids))).requires_grad_()  # some clipped
            inputs = LossInputs(logp, prox, torch.tensor([1.0, -0.5, 0.8]), segment_ids, 3, sampler_logp=prox)
            loss, _ = compute_loss(spec, inputs)
            loss.backward()
            losses.append(loss.detach())
            grads.append(logp.grad)
        # exact by design: the weight is exp(0) = 1 exactly, and multiplying by 1 changes no float
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
        torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)  # exact: as above


def test_the_decoupled_gradient_is_autograds_of_the_formula():
    """GSPO's decoupled form on hand-made tensors: L = -(1/B) sum_i w_i min(s_i A_i, clip(s_i) A_i), with
    s_i = exp(mean_t (logp - logp_prox)) and w_i = min(exp(mean_t (logp_prox - logp_behav)), 2) constant."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([-1.0001, -2.0002, -0.5, -1.5001, -0.6999], dtype=torch.float64)
    behav = torch.tensor([-2.3, -3.2, -0.9, -1.0, -0.1], dtype=torch.float64)  # a stale sampler's
    segment_ids = torch.tensor([0, 0, 1, 1, 1])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    spec = LossSpec("gspo", sampler_correction="sequence_truncate", eps_low=3e-4, eps_high=4e-4)
    loss, metrics = compute_loss(spec, LossInputs(logp, prox, adv, segment_ids, 2, sampler_logp=behav))
    (grad,) = torch.autograd.grad(loss, logp)
    x = logp.detach().clone().requires_grad_()
    terms = []
    for i, tokens in enumerate(([0, 1], [2, 3, 4])):
        s = torch.exp((x[tokens] - prox[tokens]).mean())
        w = torch.exp((prox[tokens] - behav[tokens]).mean()).clamp(max=2.0)  # a constant (no grad flows)
        clipped = s.detach().clamp(1 - 3e-4, 1 + 4e-4) * adv[i]
        out = (s > 1 + 4e-4) & (adv[i] > 0) | (s < 1 - 3e-4) & (adv[i] < 0)
        terms.append(-w * (clipped if out else s * adv[i]))
    naive = torch.stack(terms).sum() / 2
    (want,) = torch.autograd.grad(naive, x)
    # float64, a handful of operations on O(1) values: ~1e-16 apart
    torch.testing.assert_close(loss, naive, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)  # the same bound
    assert grad.abs().max() > 0.1 and metrics["sampler_is_truncated_frac_seq"] > 0  # one weight truncated


def _train_at_lag_1(run: Path, *overrides: str) -> int:
    """`gspo train` of the tiny config at rollout.lag=1, checkpointing only at step 0 and the end."""
    common = ["progress=false", "report_to=[]", "eval.every=0", "checkpoint.every=0", "rollout.lag=1"]
    return main(["train", str(TINY), f"output_dir={run}", *common, *overrides])


def test_a_reward_that_fails_on_the_sampling_side_stops_the_run_with_its_line(tmp_path, capsys):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        textwrap.dedent(
            """
            calls = []


            def flaky(prompts, completions, **_):
                calls.append(1)
                if len(calls) == 3:  # the third batch drawn: step 3's, drawn ahead at lag 1
                    raise ZeroDivisionError("the judge is down")
                return [0.0] * len(completions)
            """
        )
    )
    # task.num_eval=0: the rewards' calls are the training batches' alone
    code = _train_at_lag_1(tmp_path / "run", "task.num_eval=0", f"rewards={{{rewards}:flaky: 1.0}}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 7 and len(err) == 1, err
    assert "the judge is down" in err[0] and "gspo train --resume" in err[0]
    kept = load_trainer_state(latest_checkpoint(tmp_path / "run"))
    assert kept["step"] == 2  # steps 1 and 2 trained on the batches drawn before the failure
    assert kept["ahead"] == []  # step 3's failed batch is drawn again on resume, from step 2's weights


def test_a_server_that_dies_on_the_sampling_side_stops_the_run_with_its_line(tmp_path, capsys):
    sampler = tmp_path / "sampler.py"
    sampler.write_text(
        textwrap.dedent(
            """
            from gspo.rollout.openai import ServerError
            from gspo.sampling.factories import hf_sampler


            def dies(config, policy, tokenizer, run_dir):
                sampler = hf_sampler(config, policy, tokenizer, run_dir)
                generate, calls = sampler.generate, []

                def once_then_dead(*args, **kwargs):
                    calls.append(1)
                    if len(calls) > 2:
                        raise ServerError("http://127.0.0.1:9/v1 is not answering")
                    return generate(*args, **kwargs)

                sampler.generate = once_then_dead
                return sampler
            """
        )
    )
    code = _train_at_lag_1(tmp_path / "run", f"rollout.engine={sampler}:dies")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 8 and len(err) == 1, err
    assert "is not answering" in err[0] and "gspo train --resume" in err[0]
    assert load_trainer_state(latest_checkpoint(tmp_path / "run"))["step"] == 2


def test_lag_is_refused_where_a_copy_per_rank_cannot_sample(tmp_path):
    from gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"distributed.sequence_parallel=2 does not support rollout.lag=1"):
        load_config(TINY, [f"output_dir={tmp_path}", "rollout.lag=1", "distributed.sequence_parallel=2"])


def test_correction_bounds_apply_where_auto_chooses_a_correction_and_nowhere_else(tmp_path):
    """train.sampler_correction_max with "auto": the bound of the correction chosen for stale samples; with
    fresh samples "auto" is none and the bound is set aside, not an error."""
    config = tiny_config(tmp_path, "train.sampler_correction_max=1.5")
    spec = UpdateSpec.from_config(config, layout="padded", pad_id=0)
    fresh = with_correction(config, spec, *update_choices(config, torch.float32, exact=True, stale=False))
    stale = with_correction(config, spec, *update_choices(config, torch.float32, exact=True, stale=True))
    assert (fresh.loss.sampler_correction, fresh.loss.sampler_correction_max) == ("none", None)
    assert fresh.old_logprobs == "sampler"
    assert (stale.loss.sampler_correction, stale.loss.sampler_correction_max) == ("sequence_truncate", 1.5)
    assert stale.old_logprobs == "recompute"
    assert stale.loss.correction().high == 1.5


def test_at_lag_1_a_batch_is_scored_while_the_next_one_is_sampled(tmp_path):
    """Three stages: each batch's reward waits until the next batch's sampling has begun, which only a
    scoring stage beside the sampling one allows (in series, the first wait would never end); and the
    rewards run in the scoring stage's thread."""
    import threading

    sampling_began = [threading.Event() for _ in range(4)]
    scored_in: list[str] = []

    def waits_for_the_next_batch(prompts, completions, **_):
        k = len(scored_in)
        scored_in.append(threading.current_thread().name)
        if k + 1 < 3:  # steps 1 and 2: the batch after them is sampled meanwhile
            assert sampling_began[k + 1].wait(60), f"batch {k + 1} was scored before batch {k + 2} sampled"
        return [float(len(c) % 2) for c in completions]

    overrides = ["rollout.lag=1", "train.steps=3", "eval.every=0", "task.num_eval=0", "checkpoint.every=0"]
    overrides.append("reward_timeout=0")  # called in the stage's own thread, not a deadline's
    trainer = Trainer(
        tiny_config(tmp_path / "run", *overrides), reward_functions={"waits": waits_for_the_next_batch}
    )
    generate, calls = trainer.sampler.generate, []

    def counted(*args, **kwargs):
        sampling_began[len(calls)].set()
        calls.append(1)
        return generate(*args, **kwargs)

    trainer.sampler.generate = counted
    trainer.run()
    assert len(scored_in) == 3 and all(name.startswith("gspo-scoring") for name in scored_in), scored_in
