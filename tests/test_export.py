"""GGUF export (gspo.models.gguf_export, `gspo export --format gguf`): the layout against transformers' GGUF
loader, and llama.cpp (llama-cpp-python) running the exported files of the tiny model and of the embedded
SmolLM2 (skipped, with the reason, where llama-cpp-python is missing)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gspo.config import load_config
from gspo.models import tiny_model, tiny_tokenizer
from gspo.models.gguf_export import permute_for_llama_cpp, write_gguf
from gspo.rollout.data import format_prompt
from gspo.rollout.samplers import HFSampler
from gspo.training import evaluation
from gspo.training.export import export_run

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def test_q_k_permutation_interleaves_each_heads_halves_and_transformers_undoes_it() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    # one head of dim 6: rows [x0 x1 x2 | x3 x4 x5] (HF rotate_half) -> [x0 x3 x1 x4 x2 x5] (llama.cpp pairs)
    assert permute_for_llama_cpp(torch.arange(6.0)[:, None], 1).flatten().tolist() == [0, 3, 1, 4, 2, 5]
    w = torch.randn(4 * 6, 5)  # 4 heads of dim 6
    permuted = permute_for_llama_cpp(w, 4)
    assert not torch.equal(permuted, w)
    loader = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 4})
    assert np.array_equal(loader._reverse_permute_weights(permuted.numpy(), 4, 4), w.numpy())


def test_tiny_model_round_trips_through_transformers_gguf_loader(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", len(tokenizer), seed=3)
    path = write_gguf(model, tokenizer, tmp_path / "tiny.gguf", quant="f32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    for key in (
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
    ):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    assert loaded.config.rms_norm_eps == pytest.approx(model.config.rms_norm_eps)
    mine = model.state_dict()
    for name, tensor in loaded.state_dict().items():  # names, Q/K layout and values all come back exactly
        assert torch.equal(tensor, mine[name]), name


def test_tiny_runs_gguf_evaluates_like_its_checkpoint(tmp_path: Path) -> None:
    """`gspo eval FILE.gguf` reads the tiny model's export back (tokenizer included) and completes every
    held-out problem as `gspo eval RUN` does from the checkpoint."""
    from gspo.cli import main
    from gspo.training.launch import train

    run = tmp_path / "run"
    train(load_config(TINY, [f"output_dir={run}", "report_to=[]", "train.steps=6", "eval.every=0"]))
    assert main(["export", str(run), "--format", "gguf", "--quant", "f32"]) == 0
    gguf_file = run / "export" / "step_000006-f32.gguf"
    assert (
        main(["eval", str(gguf_file), str(run / "config.yaml"), "--output", str(tmp_path / "gguf.json")]) == 0
    )
    assert main(["eval", str(run), "--output", str(tmp_path / "run.json")]) == 0
    from_gguf, from_run = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("gguf", "run"))
    completions = [p["completions"] for p in from_run["per_problem"]]
    assert [p["completions"] for p in from_gguf["per_problem"]] == completions
    assert len({c[0] for c in completions}) > 1 or completions[0][0].strip()  # something was generated
    assert from_gguf["metrics"] == from_run["metrics"]


def test_unsupported_models_are_refused_with_the_way_out(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    with pytest.raises(NotImplementedError, match=r"convert_hf_to_gguf\.py"):
        write_gguf(tiny_model("qwen3_moe", len(tokenizer), 0), tokenizer, tmp_path / "moe.gguf")
    with pytest.raises(ValueError, match="choose one of"):
        write_gguf(tiny_model("llama", len(tokenizer), 0), tokenizer, tmp_path / "x.gguf", quant="q3_k")


# ---- llama.cpp on the exported files -------------------------------------------------------------------------
def _llama(path: Path) -> Any:
    import llama_cpp

    # one thread: llama.cpp's OpenMP workers spin, and stall badly on a CPU shared with the test's torch
    return llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, logits_all=True, verbose=False)


def _compare(llm: Any, model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int) -> dict[str, Any]:
    """llama.cpp vs the trainer's in-process sampler on the trainer's greedy completions.

    llama.cpp scores each prompt + the trainer's greedy completion in one pass (teacher forcing; the KV cache
    of the prefix shared with the previous row is kept). Its greedy completion equals the trainer's exactly
    when its argmax is the trainer's token at every completion position (then, token by token, it generates
    the same path and stops at the same EOS). `deltas`: |log p_llama.cpp - log p_trainer| of those tokens;
    `margins`: where the argmax differs first, the trainer's own log-prob margin between the two tokens.
    """
    ours = HFSampler(model, tokenizer).generate(
        prompts, group_size=1, max_new_tokens=max_new_tokens, greedy=True
    )
    same_prompts = all(
        llm.tokenize(p.encode(), add_bos=False, special=True) == ids
        for p, ids in zip(prompts, ours.prompt_ids, strict=True)
    )
    same, deltas, margins, previous = [], [], [], []
    for prompt_ids, completion, logprobs in zip(
        ours.prompt_ids, ours.completion_ids, ours.sampler_logprobs, strict=True
    ):
        row = prompt_ids + completion
        keep = 0
        while keep < min(len(previous), len(row) - 1) and previous[keep] == row[keep]:
            keep += 1
        llm.n_tokens = keep  # eval() drops the cache past n_tokens
        llm.eval(row[keep:])
        previous = row
        start = len(prompt_ids) - 1  # the position that predicts the first completion token
        scores = np.array(llm.scores[start : start + len(completion)], dtype=np.float64)
        theirs = torch.log_softmax(torch.from_numpy(scores), -1)  # (n, V)
        chosen = theirs.argmax(-1).tolist()
        for t, token in enumerate(completion):
            deltas.append(abs(float(theirs[t, token]) - logprobs[t]))
        same.append(chosen == completion)
        if chosen != completion:
            t = next(t for t, (a, b) in enumerate(zip(chosen, completion, strict=True)) if a != b)
            with torch.no_grad():
                mine = torch.log_softmax(model(torch.tensor([row])).logits[0, start + t].double(), -1)
            margins.append(float(mine[completion[t]] - mine[chosen[t]]))
    return {
        "same_prompts": same_prompts,
        "same": same,
        "deltas": torch.tensor(deltas),
        "margins": margins,
        "ours": ours,
    }


@pytest.mark.llama_cpp
def test_gspo_export_gguf_of_a_tiny_run_runs_in_llama_cpp(tmp_path: Path) -> None:
    from gspo.cli import main
    from gspo.training.launch import train

    run = tmp_path / "run"
    config = load_config(TINY, [f"output_dir={run}", "report_to=[]", "train.steps=1", "eval.every=0"])
    train(config)
    assert main(["export", str(run), "--format", "gguf", "--quant", "f32"]) == 0
    path = run / "export" / "step_000001-f32.gguf"
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000001" / "model").eval()
    tokenizer = tiny_tokenizer()
    from gspo.training.inputs import build_examples

    prompts = [format_prompt(tokenizer, ex.prompt) for ex in build_examples(config)[1]]
    llm = _llama(path)
    try:
        result = _compare(llm, model, tokenizer, prompts, max_new_tokens=6)
    finally:
        llm.close()
    assert result["same_prompts"] and all(result["same"]), result["margins"]
    # f32 weights: only the kernels' summation order differs
    assert result["deltas"].max() < 1e-3, result["deltas"].max()


# ---- the embedded model: the acceptance test of `gspo export` --------------------------------------------------
GGUF_TOLERANCE = {"f16": (0.01, 0.05), "q8_0": (0.1, 0.6)}
"""Per quantisation: (mean, max) |log p_llama.cpp - log p_trainer| over the greedy completion tokens.

f16 rounds each weight to 11 significant bits (relative 2^-11) and llama.cpp rounds activations to f16 before
its f16 matmuls; q8_0 rounds weights (and llama.cpp the activations) to 8 bits per 32-value block, an error of
up to 1/254 of each block's largest value, which adds up over SmolLM2's 30 layers. The trainer's reference
is the fp32 model (the embedded Q4_1 weights de-quantised): the export re-rounds those values. Measured on
the 40 held-out problems' greedy completion tokens: f16 mean 0.0016, max 0.010 (40/40 greedy completions
equal); q8_0 mean 0.029, max 0.28 (35/40 equal, the 5 others near-ties with trainer margins 0.018-0.19). The
bounds leave 2-6x room."""


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory, smollm2_trainer) -> Iterator[tuple[Path, Any]]:
    """A run of the default config on the embedded model, checkpointed at step 0 (no update: cheap)."""
    from gspo.training.trainer import Trainer

    run = tmp_path_factory.mktemp("smollm2") / "run"
    with smollm2_trainer():
        trainer = Trainer(load_config(None, [f"output_dir={run}", "report_to=[]", "progress=false"]))
    trainer.checkpoint()
    yield run, trainer
    trainer.logger.close()


@pytest.mark.slow
def test_vocabulary_built_from_the_hf_tokenizer_equals_the_source_ggufs(smollm2_run, tmp_path: Path) -> None:
    import gguf

    from gspo.models import default_model_file

    _, trainer = smollm2_run
    model = trainer.policy.model
    write_gguf(model, trainer.tokenizer, tmp_path / "built.gguf", quant="q8_0", source=None)
    built = gguf.GGUFReader(tmp_path / "built.gguf").fields
    source = gguf.GGUFReader(default_model_file()).fields
    for key in (
        "tokens",
        "token_type",
        "merges",
        "model",
        "bos_token_id",
        "eos_token_id",
        "padding_token_id",
        "unknown_token_id",
        "add_bos_token",
    ):
        assert built[f"tokenizer.ggml.{key}"].contents() == source[f"tokenizer.ggml.{key}"].contents(), key
    assert built["tokenizer.chat_template"].contents() == source["tokenizer.chat_template"].contents()
    for key in ("block_count", "embedding_length", "attention.head_count_kv", "rope.freq_base"):
        assert built[f"llama.{key}"].contents() == pytest.approx(source[f"llama.{key}"].contents()), key
    # transformers builds this tokenizer from the GGUF without SmolLM's digit split: the export follows
    # the trainer's tokenizer ("gpt-2"), the carried-over metadata keeps llama.cpp's original ("smollm")
    assert built["tokenizer.ggml.pre"].contents() == "gpt-2"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes on a CPU shared with other jobs (llama.cpp's threads stall there)
@pytest.mark.llama_cpp
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_exported_gguf_in_llama_cpp_matches_the_trainer(smollm2_run, quant: str) -> None:
    """Greedy completions of the held-out problems equal; token log-probs within GGUF_TOLERANCE[quant]."""
    run, trainer = smollm2_run
    path = export_run(run, format="gguf", quant=quant, step=0)
    assert path == run / "export" / f"step_000000-{quant}.gguf"
    config = trainer.config
    prompts = trainer.rollouts.prompts(trainer.eval_examples)
    llm = _llama(path)
    try:
        result = _compare(llm, trainer.policy.model, trainer.tokenizer, prompts, config.eval.max_new_tokens)
    finally:
        llm.close()
    assert result["same_prompts"]  # the carried-over tokenizer splits every prompt as the trainer does
    deltas, margins = result["deltas"], result["margins"]
    mean_tol, max_tol = GGUF_TOLERANCE[quant]
    print(
        f"{quant}: {sum(result['same'])}/{len(prompts)} greedy completions equal; |delta log p| mean "
        f"{deltas.mean():.4f} max {deltas.max():.4f} over {len(deltas)} tokens; margins at flips {margins}"
    )
    assert deltas.mean() < mean_tol and deltas.max() < max_tol, (deltas.mean(), deltas.max())
    if quant == "f16":
        assert all(result["same"])
    else:  # a flip needs a near-tie: errors of at most max_tol on each of the two tokens
        assert all(m < 2 * max_tol for m in margins) and sum(result["same"]) >= 0.8 * len(prompts)
    # the trainer's evaluation saw these very completions
    scored = evaluation.evaluate(
        HFSampler(trainer.policy.model, trainer.tokenizer),
        trainer.eval_examples,
        trainer.rewards,
        max_new_tokens=config.eval.max_new_tokens,
    )
    assert [p["completions"][0] for p in scored.problems] == result["ours"].completions
