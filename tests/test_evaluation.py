"""Evaluation (gspo.training.evaluation) and `gspo eval` / `gspo export --format hf` end to end on the tiny model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gspo.config import load_config
from gspo.models import tiny_tokenizer
from gspo.rollout.data import Example
from gspo.rollout.samplers import Rollouts
from gspo.run.metrics import read_metrics
from gspo.training.evaluation import evaluate, pass_at_k, pass_ks
from gspo.training.launch import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}


# ---- pass@k ------------------------------------------------------------------------------------------------
def test_pass_at_k_hand_computed_values() -> None:
    # 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction that passed
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5)=21, C(10,5)=252
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(3, 2, 2) == 1.0 and pass_at_k(8, 8, 1) == 1.0
    for n in range(1, 12):  # the product form equals the binomial form everywhere
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                # float64: <= 11 factors in [0, 1], each rounding by <= 2^-53, leave ~1e-15 of the exact value
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    assert pass_ks(1) == [1] and pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6]


# ---- evaluate() on scripted completions ---------------------------------------------------------------------
class ScriptedSampler:
    """Returns the given completions (sample-major) and records how it was called."""

    def __init__(self, completions: list[str]) -> None:
        self.tokenizer = tiny_tokenizer()
        self.completions = completions
        self.calls: list[dict] = []

    def generate(self, prompts: list[str], *, group_size: int, **kwargs) -> Rollouts:
        self.calls.append({"prompts": prompts, "group_size": group_size, **kwargs})
        assert len(prompts) * group_size == len(self.completions)
        ids = [self.tokenizer(c, add_special_tokens=False).input_ids for c in self.completions]
        prompt_ids = [self.tokenizer(p).input_ids for p in prompts for _ in range(group_size)]
        n = len(ids)
        return Rollouts(prompt_ids, ids, [[0.0] * len(i) for i in ids], [False] * n, list(self.completions))


def _rewards() -> list:
    def right(prompts, completions, *, answer, **_):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    def short(prompts, completions, **_):
        return [1.0 / len(c) for c in completions]

    return [("right", right, 1.0), ("short", short, 0.5)]


PROBLEMS = [Example("What is 1 + 1?", {"answer": "2"}), Example("What is 2 + 2?", {"answer": "4"})]


def test_greedy_evaluation_metrics_and_report_by_hand() -> None:
    sampler = ScriptedSampler(["2", "five"])
    result = evaluate(sampler, PROBLEMS, _rewards(), max_new_tokens=5)
    assert sampler.calls[0]["greedy"] is True and sampler.calls[0]["group_size"] == 1
    assert sampler.calls[0]["max_new_tokens"] == 5
    # accuracy: mean of the first function (1, 0); reward: 1*right + 0.5*short = (1 + 0.5) and (0 + 0.125)
    assert result.metrics == pytest.approx(
        {"accuracy": 0.5, "reward_mean": (1.5 + 0.125) / 2, "completion_len_mean": 2.5}
    )
    first = result.problems[0]
    assert first["prompt"] == "What is 1 + 1?" and first["fields"] == {"answer": "2"}
    assert first["completions"] == ["2"] and first["passed"] == 1 and first["rewards"]["short"] == [1.0]
    assert result.problems[1]["passed"] == 0 and result.problems[1]["reward"] == [0.125]


def test_sampled_evaluation_gives_pass_at_k_and_mean_at_k_by_hand() -> None:
    # problem 0: 1 of 4 right; problem 1: 0 of 4 right
    sampler = ScriptedSampler(["2", "3", "x", "y", "1", "1", "1", "1"])
    result = evaluate(sampler, PROBLEMS, _rewards(), max_new_tokens=3, samples=4, temperature=0.7)
    call = sampler.calls[0]
    assert call["greedy"] is False and call["group_size"] == 4 and call["temperature"] == 0.7
    m = result.metrics
    assert m["mean@4"] == pytest.approx(1 / 8)
    assert m["pass@1"] == pytest.approx((1 / 4 + 0) / 2)
    assert m["pass@2"] == pytest.approx((1 - 3 / 6 + 0) / 2)  # 1 - C(3,2)/C(4,2)
    assert m["pass@4"] == pytest.approx((1 + 0) / 2)
    assert m["reward_mean"] == pytest.approx((1 + 0.5 * 8 * 1.0) / 8)  # every completion is 1 char
    assert [p["passed"] for p in result.problems] == [1, 0]
    assert result.problems[0]["completions"] == ["2", "3", "x", "y"]


# ---- end to end on the tiny model -----------------------------------------------------------------------------
def _gspo(*args: str, cwd: Path) -> str:
    """`gspo ARGS` in this process (one test runs it as a subprocess); its stdout."""
    import contextlib
    import io

    from gspo.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
    assert code == 0, err.getvalue()[-3000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """Two steps of the tiny config, with every checkpoint kept (steps 1 and 2: a run saves no step 0) and the
    trainer's evals at steps 0, 1, 2."""
    run = tmp_path_factory.mktemp("eval") / "run"
    config = load_config(
        TINY,
        [f"output_dir={run}", "report_to=[]", "train.steps=2", "eval.every=1", "checkpoint.keep=3"],
    )
    train(config)
    return run


def test_gspo_eval_of_a_checkpoint_equals_the_trainers_own_evaluation(tiny_run: Path, tmp_path: Path) -> None:
    logged = {r["step"]: r for r in read_metrics(tiny_run) if r["kind"] == "eval"}
    for step in (1, 2):
        out = _gspo("eval", str(tiny_run), "--step", str(step), cwd=tmp_path)
        assert f"report: {tiny_run / 'evals' / f'step_{step:06d}.json'}" in out
        assert "held-out split of task 'arithmetic', greedy" in out
        report = json.loads((tiny_run / "evals" / f"step_{step:06d}.json").read_text())
        assert report["step"] == step and report["problems"] == 16 == len(report["per_problem"])
        for key in ("accuracy", "reward_mean", "completion_len_mean"):
            # exact by design: the checkpoint's weights are the trainer's bit for bit, so the greedy tokens and
            # per-problem values are the same, summed in the same order by evaluate(); JSON keeps floats exact
            assert report["metrics"][key] == logged[step][key], key
    # the latest checkpoint by default
    assert json.loads((tiny_run / "evals" / "step_000002.json").read_text())["checkpoint"] == str(
        tiny_run / "checkpoints" / "step_000002"
    )


def test_gspo_eval_samples_data_file_and_overrides(tiny_run: Path, tmp_path: Path) -> None:
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    out = _gspo(
        "eval",
        str(tiny_run),
        "--samples",
        "4",
        "--data",
        str(data),
        "--output",
        "r.json",
        "eval.max_new_tokens=3",
        cwd=tmp_path,
    )
    assert (
        "pass@1 " in out and "pass@4 " in out and "mean@4 " in out and "4 samples at temperature 1.0" in out
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["data"] == str(data) and report["max_new_tokens"] == 3 and report["problems"] == 3
    assert [len(p["completions"]) for p in report["per_problem"]] == [4, 4, 4]
    assert all(n <= 3 for p in report["per_problem"] for n in p["completion_tokens"])
    assert report["per_problem"][2]["fields"] == {"answer": "3"}
    assert set(report["metrics"]) == {
        "mean@4",
        "pass@1",
        "pass@2",
        "pass@4",
        "reward_mean",
        "completion_len_mean",
    }
    # a config file's model when there is no target: the tiny random model
    out = _gspo("eval", str(TINY), "task.num_eval=5", "--output", "t.json", cwd=tmp_path)
    assert "5 problems" in out and json.loads((tmp_path / "t.json").read_text())["model"] == "llama"


def test_gspo_eval_errors_name_the_fix(tiny_run: Path, tmp_path: Path, capsys) -> None:
    """Each with its kind's exit code (gspo.cli.EXIT_CODES), not 1, a bug's."""
    from gspo.cli import EXIT_CODES, main

    result = subprocess.run(  # the command itself, once
        [sys.executable, "-m", "gspo", "eval", str(tiny_run), "--step", "7"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert result.returncode == EXIT_CODES["run folder"] and "steps on disk: [1, 2]" in result.stderr
    assert "Traceback" not in result.stderr
    for args, kind, message in [
        ([str(tmp_path / "nothing")], "input", "no run folder, model directory or .gguf file"),
        ([str(TINY), "--step", "1"], "usage", "--step needs a run folder"),
        ([str(TINY), "a.yaml", "b"], "usage", "two targets"),
    ]:
        assert main(["eval", *args]) == EXIT_CODES[kind]
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_gspo_export_hf_then_eval_of_the_directory_gives_the_same_result(
    tiny_run: Path, tmp_path: Path
) -> None:
    out = _gspo("export", str(tiny_run), "--format", "hf", "--output", str(tmp_path / "hf"), cwd=tmp_path)
    assert str(tmp_path / "hf") in out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    saved = AutoModelForCausalLM.from_pretrained(tiny_run / "checkpoints" / "step_000002" / "model")
    for (name, a), (_, b) in zip(exported.state_dict().items(), saved.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    _gspo("eval", str(tmp_path / "hf"), str(TINY), "--output", "hf.json", cwd=tmp_path)
    by_dir = json.loads((tmp_path / "hf.json").read_text())
    by_run = json.loads((tiny_run / "evals" / "step_000002.json").read_text())
    assert [p["completions"] for p in by_dir["per_problem"]] == [
        p["completions"] for p in by_run["per_problem"]
    ]


def test_lora_run_exports_merged_weights_and_evaluates(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    import peft

    run = tmp_path / "lora"
    config = load_config(
        TINY,
        [
            f"output_dir={run}",
            "report_to=[]",
            "train.steps=1",
            "eval.every=0",
            "lora.rank=4",
            "train.lr=0.05",
        ],
    )
    train(config)
    _gspo("export", str(run), "--format", "hf", cwd=tmp_path)
    merged = AutoModelForCausalLM.from_pretrained(run / "export" / "step_000001-hf")
    assert not hasattr(merged, "peft_config")
    from gspo.models import load_model

    base, _ = load_model(config.model, seed=config.seed)
    ids = torch.tensor([[5, 17, 30, 42, 2]])
    with torch.no_grad():
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, run / "checkpoints" / "step_000001" / "model").eval()
        assert not torch.allclose(before, merged(ids).logits)  # the update moved the adapter
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)
    logged = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]
    _gspo("eval", str(run), "--output", "lora.json", cwd=tmp_path)
    report = json.loads((tmp_path / "lora.json").read_text())
    # exact given the same greedy tokens: merging rounds the logits differently (<= 1e-5, above), which
    # changes no argmax here (a flip would move a reward by a whole step, past any tolerance); then the same
    # values are summed by the same evaluate() and JSON keeps floats exact
    assert report["metrics"]["reward_mean"] == logged["reward_mean"]
