"""Data parallelism on CPU/gloo with 2 processes: N ranks make the one-process update, exactly.

Starting processes is most of the cost (each imports torch and transformers), so one pair of workers,
spawned once for the module (``distributed_runs``), runs every scenario in turn on one process group
and saves what it saw; the tests compare that with one-process references computed here. A scenario
that fails records its traceback instead of stopping the others; a hung collective hits the group's
60 s timeout and the spawn's deadline. One more test launches the real CLI under torchrun.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce
from transformers import AutoModelForCausalLM

from bounds import U32, assert_adam_close, sum_rtol, tiny_gradient_rtol
from conftest import tiny_config
from gloo_ranks import result, run_ranks
from gspo.config import ConfigError, load_config, validate_setup
from gspo.core.layout import TokenSequence
from gspo.core.objectives import LossInputs, LossSpec, compute_loss
from gspo.core.seeds import step_seed
from gspo.learning.batch import Batch
from gspo.learning.learner import learn, minibatches
from gspo.parallel import clipping, group, wrap
from gspo.rewards.calling import RewardError
from gspo.run.checkpoint import latest_checkpoint, load_trainer_state
from gspo.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
WORLD = 2
DEADLINE_S = 240

# ---- sequence split: raw tensors --------------------------------------------------------------------
SPLIT_AT = 17  # rank 0 holds tokens [0, 17), rank 1 the rest: segment 2 straddles the two
CASES = [
    (objective, aggregation, beta)
    for objective in ("gspo", "gspo_token", "grpo")
    for aggregation, beta in (("seq-mean-token-mean", 0.0), ("token-mean", 0.1))
]


def _split_inputs() -> dict[str, torch.Tensor]:
    """A packed stream of 40 tokens in 5 segments (some tokens outside any), the same on every rank."""
    g = torch.Generator().manual_seed(7)
    segment_ids = torch.tensor([0] * 6 + [-1] * 2 + [1] * 5 + [2] * 9 + [-1] + [3] * 7 + [4] * 10)
    features = torch.randn(40, 3, generator=g)  # token t's input x_t
    targets = torch.randint(0, 5, (40,), generator=g)  # token t's sampled id y_t
    weight = torch.randn(5, 3, generator=g)  # the "model": logp_t = log_softmax(W x_t)[y_t]
    with torch.no_grad():
        logp = torch.log_softmax(features @ weight.T, -1).gather(1, targets[:, None]).squeeze(1)
    return {
        "segment_ids": segment_ids,
        "features": features,
        "targets": targets,
        "weight": weight,
        # off-policy by a few percent per token: clipping happens, on both sides, for every objective
        "old_logp": logp + 0.08 * torch.randn(40, generator=g),
        "ref_logp": logp + 0.05 * torch.randn(40, generator=g),
        "advantages": torch.tensor([1.0, -0.5, 0.8, -1.2, 0.0]),
    }


def _split_loss(
    inputs: dict[str, torch.Tensor], objective: str, aggregation: str, beta: float, part: slice | None
):
    """(loss, metrics, d loss / d logp, d loss / d W) on the tokens `part` (None: all, one process)."""
    weight = inputs["weight"].clone().requires_grad_(True)
    tokens = slice(None) if part is None else part
    logits = inputs["features"][tokens] @ weight.T
    logp = torch.log_softmax(logits, -1).gather(1, inputs["targets"][tokens, None]).squeeze(1)
    logp.retain_grad()
    spec = LossSpec(objective, eps_low=0.03, eps_high=0.04, aggregation=aggregation, beta=beta)
    packed = LossInputs(
        logp,
        inputs["old_logp"][tokens],
        inputs["advantages"],
        inputs["segment_ids"][tokens],
        5,
        ref_logp=inputs["ref_logp"][tokens] if beta else None,
    )
    reduce = None
    if part is not None:  # the per-segment sums are all-reduced, differentiably, before any ratio
        reduce = functools.partial(all_reduce, op=dist.ReduceOp.SUM)
    loss, metrics = compute_loss(spec, packed, segment_sum_reduce=reduce)
    loss.backward()
    return loss.detach(), metrics, logp.grad, weight.grad


def _scenario_split(rank: int, out: Path) -> dict[str, Any]:
    inputs = _split_inputs()
    part = slice(0, SPLIT_AT) if rank == 0 else slice(SPLIT_AT, None)
    return {case: _split_loss(inputs, *case, part) for case in CASES}


# ---- Trainer.learn on fixed sequences ---------------------------------------------------------------
LEARN_OVERRIDES = {
    "ddp": ["train.objective=gspo"],
    "fsdp2": ["train.objective=grpo", "train.aggregation=token-mean"],
}
RANK_SIZES = (10, 6)  # uneven on purpose: ranks hold different numbers of micro-batches


def _learn_config(run_dir: Path, wrapper: str, precision: str = "none", *more: str):
    return tiny_config(
        run_dir,
        "eval.every=0",
        f"distributed.wrapper={wrapper}",
        "train.micro_batch_tokens=40",
        "train.pack_length=20",
        "train.old_logprobs=recompute",
        f"train.mixed_precision={precision}",
        *LEARN_OVERRIDES[wrapper],
        *more,
    )


# whole groups on each rank (10 sequences, then 6), as in gspo train
GROUPS = [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 4, 4, 4, 5, 5, 5]


def _fixed_batch() -> tuple[list[TokenSequence], torch.Tensor, list[list[float]]]:
    """Groups of 1 to 4 sequences sharing a prompt, the prompts a common 2-token start, so the shared-prefix
    layout shares within groups and across them."""
    g = torch.Generator().manual_seed(3)
    sequences = []
    prompts = {}
    system = [7, 8]
    for owner in GROUPS:
        if owner not in prompts:
            prompts[owner] = (
                system
                + torch.randint(3, 90, (int(torch.randint(2, 6, (), generator=g)),), generator=g).tolist()
            )
        prompt = prompts[owner]
        completion = torch.randint(3, 90, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
        mask = [True] * len(completion)
        mask[-1] = len(completion) < 6  # long ones have an untrained last token (a truncation mask)
        sequences.append(TokenSequence(prompt, completion, mask))
    advantages = torch.randn(len(sequences), generator=g)
    advantages[::5] = 0.0
    sampler = [[-4.0] * len(s.completion_ids) for s in sequences]
    return sequences, advantages, sampler


def _learn(trainer, sequences, advantages, sampler, groups) -> list[dict[str, float]]:
    """Two rollout batches' worth of updates (learn() twice, as steps 0 and 1)."""
    history = []
    batch = Batch(sequences, advantages, sampler, groups)
    for step in range(2):
        trainer.step = step
        history.append(
            learn(trainer.policy, trainer.spec, batch, seed=step_seed(trainer.config.seed, trainer.step))
        )
    return history


def _full_parameters(model) -> dict[str, torch.Tensor]:
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in full.items()}


def _scenario_learn(rank: int, out: Path, wrapper: str, precision: str = "none") -> dict[str, Any]:
    from gspo.training.trainer import Trainer

    trainer = Trainer(_learn_config(out / f"learn_{wrapper}_{precision}", wrapper, precision))
    sequences, advantages, sampler = _fixed_batch()
    start = sum(RANK_SIZES[:rank])
    mine = slice(start, start + RANK_SIZES[rank])
    layout = minibatches(
        trainer.spec,
        sequences[mine],
        seed=step_seed(trainer.config.seed, trainer.step),
        device=trainer.device,
        groups=GROUPS[mine],
    )
    idle = sum(1 for _, micro, *_ in layout for mb in micro if not mb.indices)
    history = _learn(trainer, sequences[mine], advantages[mine], sampler[mine], GROUPS[mine])
    return {"params": _full_parameters(trainer.policy.model), "history": history, "idle": idle}


# the groups whose samples all have advantage 0: rank 1's two, and one of rank 0's
SKIPPED_GROUPS = (0, 4, 5)
SKIP_OVERRIDES = ["train.minibatch_split=group", "train.minibatches=6", "train.weight_decay=0.1"]


def _skip_batch() -> tuple[list[TokenSequence], torch.Tensor, list[list[float]]]:
    sequences, advantages, sampler = _fixed_batch()
    advantages[[g in SKIPPED_GROUPS for g in GROUPS]] = 0.0
    return sequences, advantages, sampler


def _scenario_skip(rank: int, out: Path, wrapper: str) -> dict[str, Any]:
    """Skipping zero-advantage samples with rank 1 keeping none: a group per minibatch, so rank 1 computes
    nothing at all and three minibatches compute nothing on either rank (their steps still run)."""
    from gspo.training.trainer import Trainer

    config = _learn_config(out / f"skip_{wrapper}", wrapper, "none", *SKIP_OVERRIDES)
    trainer = Trainer(config)
    assert trainer.spec.skip_zero_advantage
    sequences, advantages, sampler = _skip_batch()
    start = sum(RANK_SIZES[:rank])
    mine = slice(start, start + RANK_SIZES[rank])
    history = _learn(trainer, sequences[mine], advantages[mine], sampler[mine], GROUPS[mine])
    return {"params": _full_parameters(trainer.policy.model), "history": history}


# ---- full runs: resume, and a reward failing on one rank --------------------------------------------
def _scenario_resume(rank: int, out: Path, wrapper: str) -> dict[str, Any]:
    from gspo.training.trainer import Trainer

    common = [f"distributed.wrapper={wrapper}", "eval.every=2", "checkpoint.every=1"]
    Trainer(tiny_config(out / f"full_{wrapper}", "eval.every=0", "train.steps=3", *common)).run()
    Trainer(tiny_config(out / f"stopped_{wrapper}", "eval.every=0", "train.steps=2", *common)).run()
    resumed = out / f"stopped_{wrapper}"
    Trainer(load_config(resumed / "config.yaml", ["train.steps=3"]), resume=resumed).run()
    return {}


def _scenario_reward_failure(rank: int, out: Path) -> dict[str, Any]:
    from gspo.training.trainer import Trainer

    calls = {"n": 0}

    def flaky(prompts, completions, **_):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 3:  # eval at step 0, step 1, then step 2's rollout on rank 1 only
            raise ZeroDivisionError("boom")
        return [0.0] * len(completions)

    config = tiny_config(
        out / "flaky", "eval.every=0", "rewards={flaky: 1.0}", "checkpoint.every=0", "train.steps=3"
    )
    trainer = Trainer(config, reward_functions={"flaky": flaky})
    try:
        trainer.run()
    except RewardError as error:
        return {"error": str(error), "step": load_trainer_state(latest_checkpoint(trainer.run_dir))["step"]}
    return {"error": None}


# ---- dynamic sampling: each rank draws its own extra groups; the normaliser counts what all ranks kept --
DYNAMIC = ["rollout.dynamic_sampling=true", "rollout.max_extra_groups=2", "train.filter_zero_std_groups=true"]
DYNAMIC += ["eval.every=0", "checkpoint.every=0", "train.steps=1", "train.old_logprobs=recompute"]


def _parity_on(rank: int):
    """Rank 0's groups have a spread (odd-length completions score 1); rank 1's never do, so it reaches its
    share of the cap and, filtered, trains nothing: the ranks keep different numbers of groups."""

    def parity(prompts, completions, **_):
        return [float(rank == 0 and len(c) % 2) for c in completions]

    return parity


def _scenario_dynamic(rank: int, out: Path) -> dict[str, Any]:
    from gspo.training.trainer import Trainer

    trainer = Trainer(tiny_config(out / "dynamic", *DYNAMIC), reward_functions={"parity": _parity_on(rank)})
    drawn, real = [], trainer.rollouts.next
    trainer.rollouts.next = lambda step: drawn.append(real(step)) or drawn[-1]
    metrics = trainer.train_step()
    samples = [dataclasses.asdict(s) for s in drawn[0].samples]
    return {"samples": samples, "metrics": metrics, "params": _full_parameters(trainer.policy.model)}


# ---- the workers ------------------------------------------------------------------------------------
SCENARIOS = {
    "split": _scenario_split,
    "learn_ddp": lambda rank, out: _scenario_learn(rank, out, "ddp"),
    "learn_fsdp2": lambda rank, out: _scenario_learn(rank, out, "fsdp2"),
    "learn_ddp_bf16": lambda rank, out: _scenario_learn(rank, out, "ddp", "bf16"),
    "learn_fsdp2_bf16": lambda rank, out: _scenario_learn(rank, out, "fsdp2", "bf16"),
    "skip_ddp": lambda rank, out: _scenario_skip(rank, out, "ddp"),
    "skip_fsdp2": lambda rank, out: _scenario_skip(rank, out, "fsdp2"),
    "resume_ddp": lambda rank, out: _scenario_resume(rank, out, "ddp"),
    "resume_fsdp2": lambda rank, out: _scenario_resume(rank, out, "fsdp2"),
    "reward_failure": _scenario_reward_failure,
    "dynamic": _scenario_dynamic,
}


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("distributed")
    return out, run_ranks(__name__, WORLD, out, DEADLINE_S)


# ---- the tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[f"{o}-{a}-beta{b}" for o, a, b in CASES])
def test_a_sequence_split_across_two_ranks_gives_the_unsplit_loss_and_gradients(distributed_runs, case):
    """Sequence parallelism at the loss: segment_sum_reduce = torch.distributed.nn's all_reduce."""
    per_rank = [r[case] for r in result(distributed_runs[1], "split")]
    loss, metrics, grad_logp, grad_weight = _split_loss(_split_inputs(), *case, part=None)
    assert 0 < metrics["clip_frac_token"] < 1  # clipping is exercised
    # Bound: the split adds each segment's (at most 10) token terms in two parts, then the 5 segments' and
    # the two ranks' parts: sums of at most 40 terms, (n - 1) u = 2.3e-6 of their magnitudes (bounds.py);
    # the loss terms are O(1), the gradients' O(0.1), hence the absolute parts. A segment whose ratio left
    # out a rank's tokens would be off by a few percent.
    torch.testing.assert_close(sum(r[0] for r in per_rank), loss, rtol=sum_rtol(40), atol=1e-7)
    # each gradient passes the segment's ratio (an exp of a sum) and one more product: 4x the sum bound
    torch.testing.assert_close(
        torch.cat([r[2] for r in per_rank]), grad_logp, rtol=4 * sum_rtol(40), atol=1e-7
    )
    # the weight's gradient: those 40 tokens' terms again, summed per rank, then the ranks' parts
    torch.testing.assert_close(sum(r[3] for r in per_rank), grad_weight, rtol=4 * sum_rtol(40), atol=1e-7)
    torch.testing.assert_close(sum(r[1]["num_tokens"] for r in per_rank), metrics["num_tokens"])
    global_keys = ["ratio_seq_mean", "ratio_seq_min", "ratio_seq_max", "num_sequences"]
    global_keys += ["clip_frac_seq"] if case[0] == "gspo" else []  # built from the reduced sums
    for _, rank_metrics, _, _ in per_rank:
        for key in global_keys:
            # ratios: exp of a 10-term mean, the same bound; counts and fractions: exact
            torch.testing.assert_close(
                rank_metrics[key], metrics[key], rtol=4 * sum_rtol(40), atol=1e-7, msg=key
            )


# metrics of an update that do not depend on how a minibatch is cut into micro-batches
LAYOUT_FREE = ("loss", "grad_norm", "num_sequences", "num_tokens", "ratio_token_min", "ratio_token_max")
LR = 1e-3  # conftest.TINY_NUMERICS


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_two_ranks_make_the_one_process_updates(distributed_runs, tmp_path, wrapper):
    from gspo.training.trainer import Trainer

    ranks = result(distributed_runs[1], f"learn_{wrapper}")
    assert sum(r["idle"] for r in ranks) > 0  # the ranks' micro-batch counts differed: padding was used
    single = Trainer(_learn_config(tmp_path / "single", wrapper))
    history = _learn(single, *_fixed_batch(), GROUPS)
    expected = _full_parameters(single.policy.model)
    # Bound: the ranks lay their sequences out in other micro-batches than one process, so every sum runs in
    # another order: gradients within rho = tiny_gradient_rtol() (1.2e-4), and AdamW turns that into at most
    # adam_drift (1e-6 here, 2 steps of 2 updates at lr 1e-3) on a weight whose gradient is not itself at
    # rounding level (bounds.assert_adam_close). A sequence trained twice or not at all moves weights by ~lr.
    rho = tiny_gradient_rtol()
    for r in ranks:  # both ranks hold the same (full) parameters, equal to one process's
        assert set(r["params"]) == set(expected)
        for key, value in expected.items():
            assert_adam_close(r["params"][key], value, lr=LR, updates=4, rho=rho, msg=key)
        for got, want in zip(r["history"], history, strict=True):
            for key in LAYOUT_FREE:
                # sums of per-token terms over the minibatch (each within rho) and counts (exact)
                torch.testing.assert_close(got[key], want[key], rtol=rho, atol=1e-7, msg=key)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_rank_that_keeps_no_sample_stays_in_lockstep_and_skipping_changes_nothing(
    distributed_runs, tmp_path, wrapper
):
    """Two ranks skipping zero-advantage samples (rank 1 has none to compute) against one process computing
    every sample: the same weights after two steps of six minibatches, three of them empty everywhere."""
    from gspo.training.trainer import Trainer

    ranks = result(distributed_runs[1], f"skip_{wrapper}")
    config = _learn_config(
        tmp_path / "full", wrapper, "none", *SKIP_OVERRIDES, "train.skip_zero_advantage=false"
    )
    single = Trainer(config)
    history = _learn(single, *_skip_batch(), GROUPS)
    expected = _full_parameters(single.policy.model)
    rho = tiny_gradient_rtol()
    for r in ranks:
        # Bound: the one process lays out every sample, the ranks only those that move: other micro-batches,
        # so sums in another order, as in test_two_ranks_make_the_one_process_updates (12 updates here)
        for key, value in expected.items():
            assert_adam_close(r["params"][key], value, lr=LR, updates=12, rho=rho, msg=key)
        for got, want in zip(r["history"], history, strict=True):
            assert got["skipped_samples_frac"] == pytest.approx(10 / 16)  # groups 0, 4, 5 and sample 5
            assert want["skipped_samples_frac"] == 0.0
            # a sum of per-token terms, each within rho (bounds.py); a wrong normaliser is off by 16/6
            torch.testing.assert_close(got["loss"], want["loss"], rtol=rho, atol=1e-7)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_bf16_mixed_precision_under_two_ranks_matches_one_process(distributed_runs, tmp_path, wrapper):
    """bf16 compute, fp32 master weights and reduction (DDP: autocast; FSDP2: MixedPrecisionPolicy).

    The ranks and the single process round to bf16 on different micro-batch layouts, so the match is
    to bf16 precision, not exact; the fp32 run shows the bf16 one did not silently compute in fp32."""
    from gspo.training.trainer import Trainer

    ranks = result(distributed_runs[1], f"learn_{wrapper}_bf16")
    single = Trainer(_learn_config(tmp_path / "single", wrapper, "bf16"))
    history = _learn(single, *_fixed_batch(), GROUPS)
    expected = _full_parameters(single.policy.model)
    fp32 = result(distributed_runs[1], f"learn_{wrapper}")[0]["params"]
    start = Trainer(_learn_config(tmp_path / "start", wrapper)).policy.model.state_dict()
    moved = sum(float((expected[k] - start[k]).abs().sum()) for k in expected)
    for r in ranks:
        assert {v.dtype for v in r["params"].values()} == {torch.float32}
        off = sum(float((r["params"][k] - expected[k]).abs().sum()) for k in expected)
        assert off < 0.05 * moved, f"{off:.3g} vs an update of {moved:.3g}"
        for got, want in zip(r["history"], history, strict=True):
            torch.testing.assert_close(got["loss"], want["loss"], rtol=0.05, atol=1e-3)
    assert any(not torch.equal(fp32[k], ranks[0]["params"][k]) for k in fp32)


def _train_lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in read_metrics(run_dir)]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_resume_under_distribution_reproduces_the_uninterrupted_run(distributed_runs, wrapper):
    out, runs = distributed_runs
    result(runs, f"resume_{wrapper}")
    full, resumed = out / f"full_{wrapper}", out / f"stopped_{wrapper}"
    lines = _train_lines(full)
    assert [r["step"] for r in lines if r["kind"] == "train"] == [1, 2, 3]  # rank 0 alone wrote them
    assert _train_lines(resumed) == lines
    state = load_trainer_state(latest_checkpoint(resumed))
    assert len(state["ranks"]) == WORLD  # each rank's own RNG streams and data position
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])
    a = AutoModelForCausalLM.from_pretrained(latest_checkpoint(full) / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(latest_checkpoint(resumed) / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_on_another_number_of_processes_names_the_fix(distributed_runs):
    from gspo.training.trainer import Trainer

    resumed = distributed_runs[0] / "stopped_ddp"
    with pytest.raises(ConfigError, match="written by 2 process"):
        Trainer(load_config(resumed / "config.yaml"), resume=resumed)


def test_a_reward_failing_on_one_rank_stops_every_rank_at_a_checkpoint(distributed_runs):
    ranks = result(distributed_runs[1], "reward_failure")
    assert "flaky" in ranks[1]["error"] and "boom" in ranks[1]["error"]
    assert "on rank 1" in ranks[0]["error"]
    assert ranks[0]["step"] == ranks[1]["step"] == 1  # the start of the failing step 2


def test_a_batch_that_does_not_divide_across_ranks_names_the_fix():
    config = load_config(TINY, ["rollout.prompts_per_step=6"])
    validate_setup(config, num_processes=2, is_moe=False)  # 6 prompts on 2 ranks: fine
    with pytest.raises(
        ConfigError,
        match=r"rollout.prompts_per_step=6 does not divide across 4 processes.*"
        r"set rollout.prompts_per_step=8",
    ):
        validate_setup(config, num_processes=4, is_moe=False)
    lora = dataclasses.replace(config, lora=dataclasses.replace(config.lora, rank=4))
    lora.distributed.wrapper = "fsdp2"
    with pytest.raises(ConfigError, match=r"distributed\.wrapper=ddp"):
        validate_setup(lora, num_processes=2, is_moe=False)


@pytest.mark.parametrize("refused", ["lora.rank=4", "rollout.lag=1"])
def test_a_launch_that_fsdp2_refuses_writes_nothing_in_the_run_folder(tmp_path, monkeypatch, refused):
    """Refused after the folder was claimed, they left config.yaml and .gspo_run behind. Two processes as
    the run's start sees them: the refusal needs no process group."""
    from gspo.run import start
    from gspo.training.trainer import Trainer

    monkeypatch.setattr(start, "world_size", lambda: 2)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"set distributed\.wrapper=ddp|use distributed\.wrapper=ddp"):
        Trainer(tiny_config(run, "distributed.wrapper=fsdp2", refused))
    assert not run.exists()


def test_torchrun_runs_the_cli_on_two_processes(tmp_path):
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(WORLD),
        "-m",
        "gspo",
        "train",
        str(TINY),
        f"output_dir={run}",
        "train.steps=2",
        "distributed.wrapper=fsdp2",
        "report_to=[]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("run folder:") == 1 and done.stdout.count("held-out accuracy:") == 1  # rank 0's
    lines = read_metrics(run)
    assert [r["step"] for r in lines if r["kind"] == "train"] == [1, 2]  # one writer: rank 0
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [0, 2]
    assert (run / "summary.md").is_file()
    AutoModelForCausalLM.from_pretrained(latest_checkpoint(run) / "model")


def test_device_resolution_picks_the_rank_gpu_and_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert group.resolve_device("auto") == torch.device("cpu")
    assert group.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"device=cuda but torch sees no CUDA GPU.*set device=cpu"):
        group.resolve_device("cuda")
    # a machine with 2 GPUs, seen by torchrun's rank with LOCAL_RANK=1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert group.resolve_device("auto") == torch.device("cuda", 1)
    assert group.resolve_device("cuda") == torch.device("cuda", 1)
    assert group.resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="this machine has 2 GPU"):
        group.resolve_device("cuda:2")
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun a fixed index would put every rank on it
    with pytest.raises(ConfigError, match="every torchrun rank on the same GPU: set device=cuda"):
        group.resolve_device("cuda:0")


def test_mixed_precision_is_bf16_on_gpus_by_default_and_on_request_elsewhere():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert wrap.compute_dtype("auto", cpu) is None
    assert wrap.compute_dtype("bf16", cpu) is torch.bfloat16
    assert wrap.compute_dtype("none", gpu) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [0.5, 1e3, float("inf")])
def test_clipping_folded_into_the_fused_step_equals_clip_then_step(max_norm, dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40, 30, dtype=dtype)) for _ in range(3)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW(params, lr=1e-2, fused=True)
    folded = torch.optim.AdamW(copies, lr=1e-2, fused=True)
    for _ in range(3):
        grads = [10 * torch.randn(40, 30, dtype=dtype) for _ in params]
        for p, q, g in zip(params, copies, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        # the reference clips by the same norm (gspo's), so the two differ only in how the factor is applied
        expected_norm = clipping.total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, expected_norm)
        reference.step()
        norm = clipping.clip_grad_norm(copies, max_norm, folded)
        assert all(torch.equal(q.grad, g) for q, g in zip(copies, grads, strict=True))  # not rescaled here
        folded.step()
        clipping.release_grad_scale(folded)
        assert not hasattr(folded, "grad_scale")  # a later step of the user's is not rescaled
        assert torch.equal(norm, expected_norm)
        # torch's own norm (what clip_grad_norm_ takes) sums the 3600 squares in fp32: (n - 1) u of the sum
        torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(grads), rtol=sum_rtol(3600), atol=0)
        # fp32: the gradient multiplied by the factor, then read by AdamW, against divided inside the fused
        # kernel: 2 roundings apart, and each weight a few ulps (u |w|, |w| < 5) per step: 3 steps, 16u.
        # bf16: the reference rounds the rescaled gradient to bf16, the fused kernel divides in fp32,
        # so after 3 steps they may differ by a few bf16 ulps (2^-8 each)
        tolerance = (
            {"rtol": 16 * U32, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-9}
        )
        for p, q in zip(params, copies, strict=True):
            torch.testing.assert_close(q, p, **tolerance)  # the bounds above


def test_total_norm_of_float32_cpu_gradients_is_the_float64_norm():
    """The clipping norm of fp32 CPU gradients (float32 sums of 1024-value blocks, added in float64) against
    the float64 norm: a 4M-element tensor, a transposed (non-contiguous) one and small ones. Other dtypes:
    torch's."""
    torch.manual_seed(0)
    grads = [torch.randn(2**22) * 3, torch.randn(300, 200).t(), torch.randn(7), torch.zeros(5)]
    exact = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt()
    norm = clipping.total_norm(grads)
    assert norm.dtype == torch.float32 and norm.shape == ()
    # Bound, for any summation order inside a block: with independent rounding errors (|d| <= u = 2^-24),
    # the sum of squares is off by at most lam * u * sqrt(sum_b K * S_b^2) with probability 1 - 2 exp(-lam^2
    # / 2) (Azuma; K = 1024 values per block, S_b a block's sum); for the 4096 near-equal blocks here that is
    # lam * u * sqrt(K / 4096) = 0.5 * lam * u relative: 3u at lam = 6 (p > 1 - 3e-8); half of it on the
    # norm, plus the norm's own float32 rounding (u). 3e-7 > 2.5u. One BLAS dot over the 4M values
    # (sqrt(K) = 2048): up to 6e3 u = 3.7e-4, seen 1.2e-5 on an AVX2-only EPYC and 1 thread here.
    torch.testing.assert_close(norm.double(), exact, rtol=3e-7, atol=0)
    assert clipping.total_norm([torch.zeros(3)]) == 0
    bf16 = [g.bfloat16() for g in grads[1:]]
    assert torch.equal(clipping.total_norm(bf16), torch.nn.utils.get_total_norm(bf16))


def test_optimizer_state_round_trip_changes_nothing_and_keeps_missing_state_missing():
    """Saving reads the state without initialising it; loading restores exactly what was saved, and a
    parameter that never had a gradient (an unused expert) still has no state, as in the run that saved."""
    from gspo.parallel.state import load_optimizer_state, optimizer_state

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    model, optimizer = make()
    assert optimizer_state(model, optimizer)["state"] == {} and not optimizer.state  # fresh: untouched
    x = torch.randn(8, 4)
    for _ in range(2):  # the middle layer gets no gradient: like an expert no token reached
        optimizer.zero_grad()
        model[2](model[0](x)).sum().backward()
        optimizer.step()
    file = io.BytesIO()  # through a file, as checkpoints do (the state dict shares the optimizer's tensors)
    torch.save(optimizer_state(model, optimizer), file)
    saved = torch.load(io.BytesIO(file.getvalue()))
    assert sorted(saved["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    resumed_model, resumed = make()
    resumed_model.load_state_dict(model.state_dict())
    load_optimizer_state(resumed_model, resumed, saved)
    assert len(resumed.state) == 4  # the unused layer has no state
    for m, opt in ((model, optimizer), (resumed_model, resumed)):  # one more step, all layers used
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_error_on_rank_0_alone_stops_both_ranks_and_the_launcher_exits_with_its_code(tmp_path):
    """A tampered trackers.json, read by rank 0 alone: the other rank waited in its next collective, and
    torchrun printed its own traceback and exited 1. gspo.torchrun exits with the documented code, and the
    error is one line."""
    run = tmp_path / "run"
    launch = [
        sys.executable,
        "-m",
        "gspo.torchrun",
        "--standalone",
        "--nproc_per_node",
        str(WORLD),
        "-m",
        "gspo",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    train = [
        *launch,
        "train",
        str(TINY),
        f"output_dir={run}",
        "train.steps=1",
        "report_to=[]",
        "eval.every=0",
    ]
    done = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (run / "trackers.json").write_text("{not json")
    resume = [*launch, "train", "--resume", str(run), "train.steps=2"]
    done = subprocess.run(resume, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 5, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trackers.json is not the trackers file gspo writes" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_dynamic_sampling_on_two_ranks_makes_the_one_process_update_of_what_they_kept(
    distributed_runs, tmp_path
):
    """Each rank resamples its own groups (its share of the cap: 1 extra group): rank 1 keeps none, rank 0 its
    own. Their update equals one process learning from both ranks' batches, whose loss normaliser counts
    rank 0's sequences alone; the metrics add the ranks' draws."""
    from gspo.core.samples import Sample
    from gspo.learning.step import learn_from_samples
    from gspo.training.trainer import Trainer

    ranks = result(distributed_runs[1], "dynamic")
    batches = [[Sample(**s) for s in r["samples"]] for r in ranks]
    assert all(s.reward == 0.0 for s in batches[1]) and len(batches[1]) == len(batches[0]) == 2 * 4
    metrics = ranks[0]["metrics"]
    kept = len(
        {s.group for s in batches[0] if any(t.reward != s.reward for t in batches[0] if t.group == s.group)}
    )
    assert metrics["groups_kept"] == kept >= 1  # rank 1 kept none
    assert metrics["groups_drawn"] == 4 + metrics["extra_groups"]
    assert 1 <= metrics["extra_groups"] <= 2  # the cap is the batch's: a share of 1 per rank
    assert metrics["num_trained"] == 4 * kept  # the filtered flat groups count nowhere
    offset = max(s.group for s in batches[0]) + 1
    union = batches[0] + [dataclasses.replace(s, group=s.group + offset) for s in batches[1]]
    config = tiny_config(tmp_path / "one", *DYNAMIC)
    single = Trainer(config, reward_functions={"parity": _parity_on(0)})
    want = learn_from_samples(single.policy, single.spec, union, seed=step_seed(config.seed, 0))
    expected = _full_parameters(single.policy.model)
    # Bound: as test_two_ranks_make_the_one_process_updates (another micro-batch layout; the tiny config's 2
    # updates at its lr). AdamW's step barely sees a gradient's scale: the loss and the gradient norm do, and
    # a normaliser that counted rank 1's filtered sequences would halve both
    rho, lr = tiny_gradient_rtol(), config.train.lr
    for r in ranks:
        for key in ("loss", "grad_norm", "num_trained"):
            # sums of per-token terms in another order (rho, above); the count is exact
            torch.testing.assert_close(r["metrics"][key], want[key], rtol=rho, atol=1e-7, msg=key)
        for key, value in expected.items():
            assert_adam_close(r["params"][key], value, lr=lr, updates=2, rho=rho, msg=key)
    single.finish()
