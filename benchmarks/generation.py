"""Generation throughput on the CPU: gspo's sampling engine vs transformers' `generate` vs llama.cpp vs vLLM.

Cases, on the embedded SmolLM2-135M-Instruct and --prompts held-out prompts of the default task:
- fixed: --prompts x --group-size samples (8 x 8 = 64), each exactly N new tokens for N in --tokens (64
  and 256): gspo's engine (64 slots, each prompt computed once; no stop token, so every sample runs its
  N tokens, the work of barring EOS), transformers' `generate` (the same 64 rows, do_sample at
  temperature 1 with top-k and top-p off, min_new_tokens=N: EOS barred) and llama.cpp's batched decoding
  (llama-cpp-python's low-level API: one llama_decode of the 64 sequences per token, each prompt's cells
  shared by its group's sequences, llama.cpp's own dist sampler; a --quant GGUF of the same weights), and
  with --vllm a `vllm.LLM` in this process (rollout.engine=vllm's settings: eager, prefix caching, 64
  sequences at once, each token's log-prob returned; `ignore_eos` with min_tokens = max_tokens = N).
- mixed: 4 x 64 samples whose lengths are drawn from [8, 256] (--mixed), each its own request (prompts
  shared): the engine with refill (all queued at once, 64 slots refilled as samples end) vs the same
  engine without refill (64 at a time, the next 64 when all have ended: what the old sampler did), and
  with --vllm the same requests submitted to vLLM at once (its scheduler refills as they end).
gspo and `generate` run in fp32 and in bf16 (autocast over the fp32 weights, as gspo train's
mixed_precision=bf16); vLLM in each dtype is its own engine, started once, on the weights cast to it (vLLM
has no autocast). Everything alternates within each of --rounds rounds; the table gives the median
tokens/s (generated tokens per second of wall time, prompts included) and the min-max.

    HF_HUB_OFFLINE=1 python benchmarks/generation.py [--rounds 2] [--quick] [--threads N]
        [--dtypes fp32 bf16] [--quant f16] [--no-llama-cpp]
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/generation.py --vllm --no-llama-cpp [...]

(vLLM lives in a venv of its own, scripts/setup.sh vllm, which has no llama-cpp-python.)

--quick: 16 and 32 new tokens, mixed lengths from [4, 32], one round (a smoke run of every path).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.config import load_config
from gspo.models import default_model_file, load_model
from gspo.rollout.data import format_prompt
from gspo.rollout.hf_engine import Engine
from gspo.rollout.requests import SamplingParams
from gspo.rollout.samplers import tokenize_prompts
from gspo.training.inputs import build_examples

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def load_line() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def autocast(dtype: torch.dtype | None) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    return lambda: torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


@dataclass
class Setup:
    model: Any
    tokenizer: Any
    prompts: list[list[int]]
    group: int
    threads: int


def timed(run: Callable[..., int], *args: Any) -> tuple[float, int]:
    """(seconds, generated tokens) of one call."""
    start = time.perf_counter()
    tokens = run(*args)
    return time.perf_counter() - start, tokens


def engine_fixed(setup: Setup, new_tokens: int, dtype: torch.dtype | None) -> int:
    engine = Engine(setup.model, slots=len(setup.prompts) * setup.group, context=autocast(dtype))
    requests = engine.generate(setup.prompts, setup.group, SamplingParams(new_tokens, seed=0))
    return sum(len(s.token_ids) for r in requests for s in r.samples)


def hf_generate(setup: Setup, new_tokens: int, dtype: torch.dtype | None) -> int:
    """transformers' generate on the same rows (each prompt repeated G times, left-padded)."""
    rows = [p for p in setup.prompts for _ in range(setup.group)]
    width = max(len(r) for r in rows)
    pad = setup.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad(), autocast(dtype)():
        out = setup.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=pad,
            use_cache=True,
        )
    return (out.shape[1] - width) * len(rows)


def engine_mixed(setup: Setup, lengths: list[int], dtype: torch.dtype | None, refill: bool) -> int:
    """Each sample its own request of its own length; without refill, one batch of slots at a time."""
    slots = len(setup.prompts) * setup.group
    engine = Engine(setup.model, slots=slots, context=autocast(dtype))
    work = [(setup.prompts[i % len(setup.prompts)], n) for i, n in enumerate(lengths)]
    waves = [work] if refill else [work[i : i + slots] for i in range(0, len(work), slots)]
    total = 0
    with engine.context():
        for wave in waves:
            requests = [engine.submit(p, 1, SamplingParams(n, seed=i)) for i, (p, n) in enumerate(wave)]
            while not engine.idle:
                engine.step()
            total += sum(len(r.samples[0].token_ids) for r in requests)
    return total


class LlamaCppBatch:
    """llama.cpp's batched decoding of many sequences through llama-cpp-python's low-level API."""

    def __init__(self, path: Path, threads: int, sequences: int, context: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        # silence llama.cpp's load and graph logs (the callback is kept alive on self)
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(self._quiet, None)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params()
        )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = context
        params.n_batch = params.n_ubatch = max(512, sequences)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # one cache: a prompt's cells shared by its group's sequences
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.batch = llama_cpp.llama_batch_init(max(512, sequences), 0, sequences)
        self.sequences = sequences

    def _add(self, token: int, position: int, seqs: list[int], logits: bool) -> None:
        b, i = self.batch, self.batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, position, len(seqs), logits
        for j, seq in enumerate(seqs):
            b.seq_id[i][j] = seq
        b.n_tokens = i + 1

    def _decode(self) -> None:
        if self.lib.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed (context too small?)")
        self.batch.n_tokens = 0

    def run(self, prompts: list[list[int]], group: int, new_tokens: int, seed: int = 0) -> int:
        """`group` samples of each prompt, `new_tokens` each; the generated token count."""
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_dist(seed))
        tokens, positions = [], []
        for j, prompt in enumerate(prompts):  # a prompt's tokens belong to all its group's sequences
            seqs = list(range(j * group, (j + 1) * group))
            for position, token in enumerate(prompt):
                self._add(token, position, seqs, position == len(prompt) - 1)
            self._decode()
            tokens += [lib.llama_sampler_sample(sampler, self.ctx, -1) for _ in seqs]
            positions += [len(prompt)] * group
        for _ in range(new_tokens - 1):
            for seq, token in enumerate(tokens):
                self._add(token, positions[seq], [seq], True)
                positions[seq] += 1
            self._decode()
            tokens = [lib.llama_sampler_sample(sampler, self.ctx, i) for i in range(len(tokens))]
        lib.llama_sampler_free(sampler)
        return len(tokens) * new_tokens

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


class VLLMEngines:
    """A `vllm.LLM` per dtype, started once with rollout.engine=vllm's settings (gspo's own VLLMSampler);
    requests go to it directly, for the EOS-barred sampling the cases need."""

    def __init__(self, setup: Setup, dtypes: list[str]) -> None:
        from gspo.rollout.vllm_engine import VLLMSampler

        slots = len(setup.prompts) * setup.group
        self.llms = {}
        for name in dtypes:
            model = setup.model if DTYPES[name] is None else copy.deepcopy(setup.model).to(DTYPES[name])
            # 2 GiB: 64 sequences of 256 tokens and their prompts, in fp32, without preemption
            self.llms[name] = VLLMSampler(model, setup.tokenizer, max_num_seqs=slots, kv_cache_gib=2).llm

    def run(self, name: str, requests: list[tuple[list[int], int, int]]) -> int:
        """(prompt ids, samples, exactly this many new tokens) each, all submitted at once; tokens generated."""
        from vllm import SamplingParams as VLLMParams

        params = [
            VLLMParams(
                n=n, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False
            )
            for _, n, tokens in requests
        ]
        prompts = [{"prompt_token_ids": ids} for ids, _, _ in requests]
        outputs = self.llms[name].generate(prompts, params, use_tqdm=False)
        return sum(len(sample.token_ids) for output in outputs for sample in output.outputs)


def vllm_fixed(setup: Setup, vllm: VLLMEngines, name: str, new_tokens: int) -> int:
    return vllm.run(name, [(p, setup.group, new_tokens) for p in setup.prompts])


def vllm_mixed(setup: Setup, vllm: VLLMEngines, name: str, lengths: list[int]) -> int:
    return vllm.run(name, [(setup.prompts[i % len(setup.prompts)], 1, n) for i, n in enumerate(lengths)])


@contextlib.contextmanager
def llama_cpp_batch(setup: Setup, quant: str, max_tokens: int) -> Iterator[LlamaCppBatch]:
    from gspo.models.gguf_export import write_gguf

    with tempfile.TemporaryDirectory() as work:
        path = write_gguf(
            setup.model,
            setup.tokenizer,
            Path(work) / f"policy-{quant}.gguf",
            quant=quant,
            source=default_model_file(),
        )
        sequences = len(setup.prompts) * setup.group
        context = sum(len(p) for p in setup.prompts) + sequences * max_tokens + 256
        llama = LlamaCppBatch(Path(path), setup.threads, sequences, context)
        try:
            yield llama
        finally:
            llama.close()


def median_range(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def ratio(a: list[float], b: list[float]) -> str:
    return f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b else "-"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="16 and 32 tokens, mixed from [4, 32], one round"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--mixed", type=int, nargs=2, default=[8, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--quant", default="f16", help="llama.cpp's GGUF weight type (f16, q8_0, ...)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument(
        "--vllm", action="store_true", help="vLLM columns (in the venv of scripts/setup.sh vllm)"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.mixed, args.rounds = [16, 32], [4, 32], 1
    return args


Results = dict[tuple[str, str], list[float]]


def record(results: Results, case: str, column: str, timing: tuple[float, int]) -> None:
    seconds, tokens = timing
    results.setdefault((case, column), []).append(tokens / seconds)
    print(f"#   {case:>10} {column:<22} {tokens / seconds:7.1f} tok/s ({seconds:.1f} s)", flush=True)


def one_round(
    setup: Setup,
    args: argparse.Namespace,
    lengths: list[int],
    llama: Any,
    vllm: VLLMEngines | None,
    results: Results,
) -> None:
    for new_tokens in args.tokens:
        case = f"{new_tokens} tokens"
        for name in args.dtypes:
            dtype = DTYPES[name]
            record(results, case, f"gspo {name}", timed(engine_fixed, setup, new_tokens, dtype))
            record(results, case, f"generate {name}", timed(hf_generate, setup, new_tokens, dtype))
            if vllm is not None:
                record(results, case, f"vllm {name}", timed(vllm_fixed, setup, vllm, name, new_tokens))
        if llama is not None:
            timing = timed(llama.run, setup.prompts, setup.group, new_tokens)
            record(results, case, f"llama.cpp {args.quant}", timing)
    for name in args.dtypes:
        for refill in (True, False):
            column = f"gspo {name} {'refill' if refill else 'no refill'}"
            record(results, "mixed", column, timed(engine_mixed, setup, lengths, DTYPES[name], refill))
        if vllm is not None:
            record(results, "mixed", f"vllm {name}", timed(vllm_mixed, setup, vllm, name, lengths))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(None)
    model, tokenizer = load_model(config.model)
    examples = build_examples(config)[1][: args.prompts]
    prompts = tokenize_prompts(tokenizer, [format_prompt(tokenizer, ex.prompt) for ex in examples])
    setup = Setup(model, tokenizer, prompts, args.group_size, args.threads)
    slots = args.prompts * args.group_size
    lengths = [random.Random(i).randint(*args.mixed) for i in range(4 * slots)]
    print(f"# {cpu_name()}; torch {torch.__version__}, {args.threads} threads; {load_line()}")
    print(
        f"# {args.prompts} prompts x {args.group_size} = {slots} samples, prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens; mixed: {len(lengths)} samples of {args.mixed[0]}-{args.mixed[1]} "
        f"tokens (mean {statistics.mean(lengths):.0f})",
        flush=True,
    )
    results: Results = {}
    with contextlib.ExitStack() as stack:
        llama = None
        if not args.no_llama_cpp:
            llama = stack.enter_context(llama_cpp_batch(setup, args.quant, max(args.tokens)))
        vllm = VLLMEngines(setup, args.dtypes) if args.vllm else None
        engine_fixed(setup, 2, None)  # warm-ups
        hf_generate(setup, 2, None)
        if llama is not None:
            llama.run(prompts, args.group_size, 2)
        if vllm is not None:
            for name in args.dtypes:
                vllm_fixed(setup, vllm, name, 2)
        for round_ in range(args.rounds):
            print(f"# round {round_ + 1} ({load_line()})", flush=True)
            one_round(setup, args, lengths, llama, vllm, results)
    print_table(results, args)
    print(f"# {load_line()}")


def print_table(results: dict[tuple[str, str], list[float]], args: argparse.Namespace) -> None:
    r = lambda case, column: results.get((case, column), [])  # noqa: E731
    llama = f"llama.cpp {args.quant}"
    print(
        "\n| new tokens | dtype | gspo engine | transformers generate | gspo / generate | "
        f"{llama} | gspo / llama.cpp | vLLM | gspo / vLLM |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for new_tokens in args.tokens:
        case = f"{new_tokens} tokens"
        for name in args.dtypes:
            ours, theirs = r(case, f"gspo {name}"), r(case, f"generate {name}")
            vllm = r(case, f"vllm {name}")
            print(
                f"| {new_tokens} | {name} | {median_range(ours)} | {median_range(theirs)} | {ratio(ours, theirs)} | "
                f"{median_range(r(case, llama))} | {ratio(ours, r(case, llama))} | {median_range(vllm)} | "
                f"{ratio(ours, vllm)} |"
            )
    print("\n| mixed lengths | dtype | refill | no refill | refill / no refill | vLLM | refill / vLLM |")
    print("|---|---|---|---|---|---|---|")
    for name in args.dtypes:
        on, off = r("mixed", f"gspo {name} refill"), r("mixed", f"gspo {name} no refill")
        vllm = r("mixed", f"vllm {name}")
        print(
            f"| {args.mixed[0]}-{args.mixed[1]} | {name} | {median_range(on)} | {median_range(off)} | {ratio(on, off)} "
            f"| {median_range(vllm)} | {ratio(on, vllm)} |"
        )
    print("\n(tokens/s: median of the rounds (min-max), generated tokens over wall time, prompts included)")


if __name__ == "__main__":
    main()
