"""Dynamic sampling with resampling (rollout.dynamic_sampling, gspo.sampling.batches; DAPO's).

- a batch draws further prompts, as whole groups, in place of those whose rewards are all equal, until it
  holds prompts_per_step groups with a spread; at the cap it keeps its size with the earliest flat groups;
- without it, a batch is the groups drawn, in their order (the synchronous loop is unchanged);
- the extra draws are seeded by the batch's seed: a run is reproducible, and one killed in the middle of a
  resample (SIGKILL in a forked process) resumes to the very same weights, at lag 0 and lag 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gspo.config import RolloutConfig
from gspo.rollout.data import Example
from gspo.rollout.samplers import Rollouts
from gspo.run.checkpoint import latest_checkpoint, load_trainer_state
from gspo.run.metrics import read_metrics
from gspo.sampling.batches import Request, Resampling, draw, extra_examples
from gspo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
G = 4


class CountingSampler:
    """Sample k of prompt p is the text "p|k" (one token id per sample): what a group scores is up to the
    reward below. Records every call's prompts and seed."""

    current = True

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int | None]] = []

    def generate(self, prompts, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        self.calls.append((list(prompts), seed))
        out = Rollouts([], [], [], [], [])
        for p in prompts:
            for k in range(group_size):
                out.prompt_ids.append([1, 2])
                out.completion_ids.append([3 + k])
                out.sampler_logprobs.append([-0.5])
                out.truncated.append(False)
                out.completions.append(f"{p}|{k}")
        return out

    def sync_weights(self, model, tokenizer, step) -> None:
        pass


def spread_of(prompts_with_spread: set[str]):
    """A reward under which the groups of ``prompts_with_spread`` have a spread (odd samples score 1), and
    every other group scores 0 throughout."""

    def reward(prompts, completions, **_):
        return [
            float(c.split("|")[0] in prompts_with_spread and int(c.split("|")[1]) % 2) for c in completions
        ]

    return [("spread", reward, 1.0)]


POOL = [Example(f"q{i}", {"answer": str(i)}) for i in range(20)]


def request(prompts: list[str], seed: int = 11) -> Request:
    examples = [next(e for e in POOL if e.prompt == p) for p in prompts]
    return Request(step=1, version=0, examples=examples, prompts=prompts, seed=seed)


def resampling(max_groups: int) -> Resampling:
    return Resampling(POOL, lambda ex: ex.prompt, max_groups)


CFG = RolloutConfig(prompts_per_step=4, group_size=G)


def groups_of(drawn) -> list[str]:
    return [c.split("|")[0] for c in drawn.completions[::G]]


def chat(ex: Example) -> str:
    """A template as the sampling side's tokenizer applies one: the drawn groups hold its output."""
    return f"<|user|>{ex.prompt}<|assistant|>"


def test_extra_examples_are_seeded_and_take_fresh_prompts_first():
    drawn = {chat(POOL[1]), chat(POOL[2])}  # the batch's groups: templated prompts
    a = extra_examples(POOL, 5, seed=3, drawn=drawn, prompt=chat)
    assert a == extra_examples(POOL, 5, seed=3, drawn=drawn, prompt=chat)  # the seed decides
    assert a != extra_examples(POOL, 5, seed=4, drawn=drawn, prompt=chat)
    assert len({e.prompt for e in a}) == 5 and not {"q1", "q2"} & {e.prompt for e in a}
    # fewer fresh prompts than asked: the batch's own come again, after every fresh one
    small = POOL[:3]
    got = [
        e.prompt for e in extra_examples(small, 3, seed=3, drawn={chat(POOL[0]), chat(POOL[1])}, prompt=chat)
    ]
    assert got[0] == "q2" and sorted(got[1:]) == ["q0", "q1"]
    # a pool smaller than the draw: all of it, then again
    assert len(extra_examples(small, 7, seed=3, drawn=set(), prompt=chat)) == 7


def test_extra_examples_of_chat_message_rows_compare_their_templated_prompts():
    """A row whose prompt is a list of messages (unhashable) is compared by its templated text."""
    rows = [Example([{"role": "user", "content": f"q{i}"}], {"answer": str(i)}) for i in range(4)]

    def template(ex: Example) -> str:
        return "".join(f"<|{m['role']}|>{m['content']}" for m in ex.prompt)

    got = extra_examples(rows, 2, seed=0, drawn={template(rows[0]), template(rows[3])}, prompt=template)
    assert sorted(template(e) for e in got) == ["<|user|>q1", "<|user|>q2"]


def test_flat_groups_are_replaced_until_the_batch_has_a_spread_in_every_group():
    sampler = CountingSampler()
    with_spread = {f"q{i}" for i in range(0, 20, 2)}  # the even prompts
    drawn = draw(sampler, spread_of(with_spread), CFG, request(["q0", "q1", "q2", "q3"]), resampling(12))
    groups = groups_of(drawn)
    assert len(groups) == 4 and set(groups) <= with_spread  # every group of the batch has a spread
    assert groups[:2] == ["q0", "q2"]  # the batch's own, in their order, then the extra ones
    assert drawn.groups_kept == 4 and drawn.groups_drawn == 4 + sum(len(p) for p, _ in sampler.calls[1:])
    assert len(drawn.samples) == 4 * G and [s.group for s in drawn.samples] == [
        j for j in range(4) for _ in range(G)
    ]
    # each extra round draws only what is still missing, with a seed of its own (not the batch's)
    assert len(sampler.calls[1][0]) == 2
    seeds = [seed for _, seed in sampler.calls]
    assert seeds[0] == 11 and len(set(seeds)) == len(seeds)
    # rewards and completions stay aligned with their samples
    assert [s.reward for s in drawn.samples] == [float(k % 2) for _ in range(4) for k in range(G)]
    assert drawn.per_function["spread"] == [s.reward for s in drawn.samples]


def test_at_the_cap_the_batch_keeps_its_size_with_its_earliest_flat_groups():
    sampler = CountingSampler()
    drawn = draw(sampler, spread_of({"q2"}), CFG, request(["q0", "q1", "q2", "q3"]), resampling(3))
    # q2 alone has a spread; 3 extra groups (the cap) found none: the earliest flat ones fill the batch
    assert groups_of(drawn) == ["q0", "q1", "q2", "q3"]
    assert drawn.groups_kept == 1 and drawn.groups_drawn == 7
    assert sum(len(p) for p, _ in sampler.calls[1:]) == 3


@pytest.mark.parametrize("keep_solved", [False, True])
def test_a_solved_group_is_replaced_unless_keep_solved_groups_keeps_it(keep_solved: bool) -> None:
    """q1's group all at the reward's best (solved), q3's all below it (stuck), every other with a spread: by
    default both flat groups are replaced; with rollout.keep_solved_groups only the stuck one."""
    import gspo

    @gspo.reward(best=1.0)
    def right(prompts, completions, **_):
        def value(c: str) -> float:
            prompt, k = c.split("|")
            return {"q1": 1.0, "q3": 0.0}.get(prompt, float(int(k) % 2))  # the others: a spread

        return [value(c) for c in completions]

    sampler = CountingSampler()
    pool = Resampling(POOL, lambda ex: ex.prompt, 8, keep_solved=keep_solved)
    drawn = draw(sampler, [("right", right, 1.0)], CFG, request(["q0", "q1", "q2", "q3"]), pool)
    assert [len(prompts) for prompts, _ in sampler.calls] == [4, 1 if keep_solved else 2]  # one round
    assert ("q1" in groups_of(drawn)) == keep_solved and "q3" not in groups_of(drawn)


def test_without_resampling_the_batch_is_what_was_drawn_in_its_order():
    sampler = CountingSampler()
    drawn = draw(sampler, spread_of({"q1"}), CFG, request(["q3", "q1", "q0", "q2"]))
    assert groups_of(drawn) == ["q3", "q1", "q0", "q2"] and len(sampler.calls) == 1
    assert drawn.groups_drawn == 4 and drawn.groups_kept == 1


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")


def _train_lines(run_dir: Path) -> list[dict]:
    drop = ("time_",)
    return [
        {k: v for k, v in r.items() if not k.startswith(drop)}
        for r in read_metrics(run_dir)
        if r["kind"] == "train"
    ]


DYNAMIC = ["rollout.dynamic_sampling=true", "train.steps=4", "eval.every=0", "report_to=[]", "progress=false"]


@pytest.mark.parametrize("lag", [0, 1])
def test_a_dynamic_run_is_reproducible_and_reports_its_draws(tmp_path, lag):
    overrides = [*DYNAMIC, f"rollout.lag={lag}", "checkpoint.every=0"]
    runs = []
    for name in ("a", "b"):
        Trainer(tiny_config(tmp_path / name, *overrides)).run()
        runs.append(tmp_path / name)
    a, b = runs
    assert _train_lines(a) == _train_lines(b)
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    lines = _train_lines(a)
    assert all(r["groups_drawn"] == 4 + r["extra_groups"] for r in lines)
    assert all(0 <= r["groups_kept"] <= 4 and r["zero_std_groups"] == 4 - r["groups_kept"] for r in lines)
    assert any(r["extra_groups"] > 0 for r in lines)  # the tiny model's flat groups were drawn again


KILL_IN_RESAMPLE = """
import os, signal
import gspo.sampling.batches as batches
real, calls = batches.extra_examples, []
def extra_examples(*args, **kwargs):
    calls.append(1)
    if len(calls) == {at}:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
batches.extra_examples = extra_examples
"""


@pytest.mark.parametrize("lag", [0, 1])
def test_a_run_killed_in_the_middle_of_a_resample_resumes_exactly(tmp_path, forkserver, lag):
    common = [*DYNAMIC, "train.steps=5", f"rollout.lag={lag}", "checkpoint.every=1", "checkpoint.keep=2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert forkserver(tmp_path / "ref.log", argv=["train", str(TINY), *common, f"output_dir={ref}"]) == 0
    rounds = sum(r["extra_groups"] > 0 for r in _train_lines(ref))
    assert rounds >= 2  # there is a resample to kill in, twice
    codes = []
    for i, at in enumerate((2, 2)):  # the second extra draw of the run, then of the resumed run
        started = (run / "checkpoints").is_dir()
        argv = ["train", *common, "--resume", str(run)] if started else ["train", str(TINY), *common]
        argv += [] if started else [f"output_dir={run}"]
        job = f"import gspo.cli, sys\nsys.exit(gspo.cli.main({argv!r}))\n"
        codes.append(forkserver(tmp_path / f"kill{i}.log", code=KILL_IN_RESAMPLE.format(at=at) + job))
    assert codes == [-9, -9]  # each kill landed inside a resample
    argv = ["train", *common, "--resume", str(run)]
    assert forkserver(tmp_path / "last.log", argv=argv) == 0, (tmp_path / "last.log").read_text()[-2000:]
    assert _train_lines(run) == _train_lines(ref)
    assert load_trainer_state(latest_checkpoint(run))["step"] == 5
    wa, wb = _weights(ref), _weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.numerics
def test_a_plain_resume_at_lag_0_equals_the_uninterrupted_run_through_one_group_rounds(tmp_path) -> None:
    """Seed 13 at temperature 1: a batch that draws one extra group, a prefill of one prompt, whose logits
    are a one-row product (step 8, when it was found). The uninterrupted run built its model in fresh memory, the resumed one
    loaded it from the checkpoint, its tensors wherever the file's header put them; MKL's one-row product
    rounds with the weight's alignment, so the resumed run's sampler log-probs were 1e-7 off from step 8 on
    (the loss and ratios with them, the final weights' sha256 too). Parameters are aligned as loaded
    (gspo.models.loading.align_parameters)."""
    from gspo.cli import main

    common = ["seed=13", "rollout.temperature=1.0", "rollout.dynamic_sampling=true", "train.steps=8"]
    common += ["checkpoint.every=1", "checkpoint.keep=10", "eval.every=0", "report_to=[]", "progress=false"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(["train", str(TINY), *common, f"output_dir={ref}"]) == 0
    lines = _train_lines(ref)
    assert any(r["step"] == 8 and r["extra_groups"] == 1 for r in lines)  # the one-group round is there
    import shutil

    shutil.copytree(ref, run)
    for step in (8,):
        shutil.rmtree(run / "checkpoints" / f"step_{step:06d}")
    metrics = run / "metrics.jsonl"
    metrics.write_text(
        "".join(line + "\n" for line in metrics.read_text().splitlines() if '"step": 8' not in line)
    )
    assert main(["train", "--resume", str(run), "--from-step", "7"]) == 0
    assert _train_lines(run) == lines
    wa, wb = _weights(ref), _weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_parameters_are_aligned_however_the_model_arrives(tmp_path) -> None:
    """Built in fresh memory or loaded from a file: every parameter starts on a 64-byte boundary, so a
    one-row product computes the same numbers either way."""
    from gspo.config import ModelConfig
    from gspo.models import load_model, save_model, tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    built = tiny_model("llama", len(tokenizer), 0)
    save_model(built, tokenizer, tmp_path / "model")
    loaded, _ = load_model(ModelConfig(path=str(tmp_path / "model")))
    assert {p.data_ptr() % 64 for p in loaded.parameters()} == {0}
    row = torch.randn(1, built.config.hidden_size)
    assert torch.equal(row @ built.lm_head.weight.T, row @ loaded.lm_head.weight.T)
