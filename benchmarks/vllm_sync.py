"""vLLM's weight sync, the cost of every rollout batch with rollout.engine=vllm or vllm_server, by model size.

Models: the tests' tiny Llama (tests/test_vllm.py: gspo.models.tiny_model with 32-wide attention heads, which
vLLM's CPU attention needs) and the embedded SmolLM2-135M-Instruct, both fp32. Modes:
- in-process: `VLLMSampler.sync_weights` (the tensors streamed into vLLM's in-place reload, prefix cache reset);
- server: `FileReload` on a `VLLMServer` that gspo starts (safetensors written into the server's folder, the
  reload called over HTTP, prefix cache reset); the HTTP part (`reload`) is also timed on its own, and the
  rest is the writing.
The policy alternates between two weight sets (its own and a perturbed copy) from sync to sync, and after
each timed sync vLLM's greedy tokens for fixed prompts must be the ones that weight set gave before: a sync
that did not happen (or half happened) fails the run instead of being timed. The two sets' greedy tokens
must differ, or the check would be blind.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_sync.py [--repeats 5]
        [--models tiny smollm2] [--modes in-process server]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch
from generation import cpu_name, load_line  # benchmarks/, the script's own folder

from gspo.config import load_config
from gspo.models import load_model, tiny_model, tiny_tokenizer
from gspo.rollout.data import format_prompt
from gspo.rollout.vllm_engine import VLLMSampler
from gspo.rollout.vllm_server import FileReload, VLLMServer, server_sampler


def tiny() -> tuple[torch.nn.Module, object]:
    """tests/test_vllm.py's tiny Llama: gspo's, with 32-wide attention heads."""
    from transformers import LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    config = tiny_model("llama", len(tokenizer), 0).config
    config.head_dim = 32
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


def smollm2() -> tuple[torch.nn.Module, object]:
    model, tokenizer = load_model(load_config(None).model)
    return model.eval(), tokenizer


MODELS = {"tiny": tiny, "smollm2": smollm2}


def perturbed(model: torch.nn.Module, scale: float) -> dict[str, torch.Tensor]:
    """Every weight moved, as tests/test_vllm.py's `perturb` does (far enough to change the greedy tokens)."""
    generator = torch.Generator().manual_seed(1)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


class GreedyCheck:
    """vLLM's greedy tokens for fixed prompts, recorded per weight set and checked after each sync."""

    def __init__(self, generate, tokenizer) -> None:
        self.generate = generate
        self.prompts = [format_prompt(tokenizer, f"What is {a} + {b}?") for a, b in [(1, 2), (3, 4)]]
        self.expected: dict[int, list[list[int]]] = {}

    def __call__(self, weight_set: int) -> None:
        tokens = self.generate(self.prompts).completion_ids
        expected = self.expected.setdefault(weight_set, tokens)
        if tokens != expected:
            raise SystemExit(
                f"after the sync to weight set {weight_set}, vLLM's greedy tokens are not its own"
            )
        if len(self.expected) == 2 and self.expected[0] == self.expected[1]:
            raise SystemExit(
                "both weight sets give the same greedy tokens: the sync did not reach vLLM, or --scale is too small"
            )


def run_mode(mode: str, model, tokenizer, weight_sets, repeats: int, work: Path) -> dict[str, list[float]]:
    """Seconds of each timed sync (and, for the server, of its HTTP reload alone)."""
    times: dict[str, list[float]] = {"sync": [], "reload": []}
    if mode == "in-process":
        sampler = VLLMSampler(model, tokenizer)
        sync = sampler.sync_weights
        greedy = lambda p: sampler.generate(p, group_size=1, max_new_tokens=8, greedy=True)  # noqa: E731
        server = None
    else:
        server = VLLMServer(model, tokenizer, work / "server")
        backend = server_sampler(server, tokenizer, timeout=600)
        sync = FileReload(server)
        greedy = lambda p: backend.generate(p, group_size=1, max_new_tokens=8, temperature=0.0)  # noqa: E731
        reload = server.reload

        def timed_reload() -> None:
            start = time.perf_counter()
            reload()
            times["reload"].append(time.perf_counter() - start)

        server.reload = timed_reload
    try:
        check = GreedyCheck(greedy, tokenizer)
        check(0)  # the weights it started on
        # one untimed sync into set 1 records its tokens; then each timed one flips the set
        for step in range(repeats + 1):
            weight_set = (step + 1) % 2
            model.load_state_dict(weight_sets[weight_set])
            start = time.perf_counter()
            sync(model, tokenizer, step)
            seconds = time.perf_counter() - start
            check(weight_set)
            if step > 0:
                times["sync"].append(seconds)
            elif server is not None:
                times["reload"].clear()
        model.load_state_dict(weight_sets[0])
    finally:
        if server is not None:
            server.close()
    return times


def median_range(values: list[float]) -> str:
    if not values:
        return "-"
    ms = [1000 * v for v in values]
    return f"{statistics.median(ms):.0f} ms ({min(ms):.0f}-{max(ms):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs per model and mode")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--modes", nargs="+", default=["in-process", "server"], choices=["in-process", "server"]
    )
    parser.add_argument("--scale", type=float, default=0.05, help="the perturbation's std")
    args = parser.parse_args()
    print(f"# {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {load_line()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gspo-vllm-sync-") as work:
        for name in args.models:
            model, tokenizer = MODELS[name]()
            weight_sets = [copy.deepcopy(model.state_dict()), perturbed(model, args.scale)]
            parameters = sum(p.numel() for p in model.parameters())
            megabytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
            for mode in args.modes:
                times = run_mode(mode, model, tokenizer, weight_sets, args.repeats, Path(work) / name)
                rows.append((name, parameters, megabytes, mode, times))
                print(f"# {name} {mode}: {times} ({load_line()})", flush=True)
    print(
        "\n| model | parameters | state dict sent (fp32) | mode | sync (median, min-max) | of which HTTP reload |"
    )
    print("|---|---|---|---|---|---|")
    for name, parameters, megabytes, mode, times in rows:
        print(
            f"| {name} | {parameters / 1e6:.2f}M | {megabytes:.1f} MiB | {mode} | {median_range(times['sync'])} | "
            f"{median_range(times['reload'])} |"
        )
    print(f"\n({args.repeats} timed syncs each, greedy tokens checked after every one; {load_line()})")


if __name__ == "__main__":
    main()
