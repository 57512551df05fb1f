"""Peak memory and wall time of log-probs through the LM head: naive vs chunked (gspo.core.logprobs).

One step = forward + backward of sum_i g_i * log pi(t_i) with a fixed random upstream gradient g, for
hidden (N, H) and head weight (V, H), both requiring grad, fp32 (SmolLM2 shapes by default: H=576,
V=49,152):

    naive:   log_softmax(h @ W.T, -1).gather(1, t)     holds (N, V) logits and their gradient
    chunked: gspo.core.logprobs.token_logprobs(h, W, t)     holds (chunk, V) blocks; backward recomputes them

With --fused, two prototypes of a fused head+loss path (not in the library; see docs/logprobs.md) are
timed as well, both given the per-token upstream gradient g inside the chunk loop:

    fused-1pass: one pass, 3 matmuls: possible only when dL/dlogp_t depends on token t alone (GRPO)
    fused-2pass: a no-grad forward first, then the 1-pass: what GSPO / GSPO-token would need, since
                 their per-token gradient depends on the whole sequence's log-probs

Memory (honest, not an allocator counter):
- CPU: each (method, N, chunk) runs in a fresh Python subprocess. After the inputs exist and a tiny
  warm-up step (N=64) has initialised the BLAS/OpenMP runtimes, the kernel's peak-RSS mark is reset
  (``echo 5 > /proc/self/clear_refs``) and VmRSS is read; after one full-size step VmHWM is read. The
  number is VmHWM - VmRSS: every page the step touched, including the gradients it leaves behind
  (h.grad, W.grad), BLAS workspaces and allocator overhead. torch's CPU allocator does not cache, so
  freed blocks are not hidden. Without a writable clear_refs the fallback is ru_maxrss (coarser).
- CUDA: torch.cuda.max_memory_allocated() - memory_allocated() before the step.
Time: one subprocess per (device, N) runs all methods round-robin (so background load on a shared
machine hits them alike): one warm-up step each (N <= 2048), then --repeats rounds. Reported: median
(min) wall-clock seconds, the wall-clock ratio of medians, and on CPU the ratio of median process CPU
times (user + sys of all threads), which other tenants' load distorts much less than wall-clock.

    python benchmarks/logprob_memory.py --chunk-size 1024,512 --fused --repeats 3   # docs/logprobs.md
    python benchmarks/logprob_memory.py --sizes 2048 --repeats 3 --chunk-size 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from gspo.core.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs

# (N, V) fp32 buffers the naive step holds at its peak (log_softmax output, the scattered gradient of
# gather, the gradient of log_softmax): used to skip naive runs that would not fit in memory.
NAIVE_NV_BUFFERS = 3


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, targets[:, None]).squeeze(1)


@torch.no_grad()
def fused_prototype_step(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    upstream: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """One pass with dL/dlogp = upstream known per chunk: log-probs, and grads written to .grad.

    dL/du = g [j = t] - g pi   ->   dL/dh = g (W[t] - pi W),  dL/dW = -pi^T (g h) + scatter_t(g h)
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros_like(weight)
    logp = torch.empty(n, device=hidden.device)
    logits_buf = torch.empty(min(chunk_size, n), vocab, device=hidden.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h_c, t_c, g_c = hidden[start:end], targets[start:end], upstream[start:end, None]
        logits = torch.mm(h_c, weight.T, out=logits_buf[: end - start])
        log_pi = torch.log_softmax(logits, dim=-1, out=logits)  # in place, as gspo.core.logprobs does
        logp[start:end] = log_pi.gather(1, t_c[:, None]).squeeze(1)
        pi = log_pi.exp_()
        grad_hidden[start:end] = (weight[t_c] - pi @ weight) * g_c
        grad_weight.addmm_(pi.T, h_c * g_c, alpha=-1.0)
        grad_weight.index_add_(0, t_c, h_c * g_c)
    hidden.grad, weight.grad = grad_hidden, grad_weight
    return logp


def _step(method: str, chunk_size: int, hidden, weight, targets, upstream) -> None:
    hidden.grad = weight.grad = None
    if method == "fused-1pass":
        fused_prototype_step(hidden, weight, targets, upstream, chunk_size)
    elif method == "fused-2pass":
        with torch.no_grad():
            token_logprobs(hidden, weight, targets, chunk_size=chunk_size)  # -> sequence weights
        fused_prototype_step(hidden, weight, targets, upstream, chunk_size)
    else:
        if method == "naive":
            logp = naive_logprobs(hidden, weight, targets)
        else:
            logp = token_logprobs(hidden, weight, targets, chunk_size=chunk_size)
        (logp * upstream).sum().backward()
    if hidden.device.type == "cuda":
        torch.cuda.synchronize()


def _proc_bytes(path: str, field: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in {path}")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _make_inputs(n: int, args: argparse.Namespace):
    torch.manual_seed(0)
    device = torch.device(args.device)
    hidden = torch.randn(n, args.hidden, device=device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (n,), device=device)
    upstream = torch.randn(n, device=device)
    return hidden, weight, targets, upstream


def _worker_memory(args: argparse.Namespace) -> dict:
    method, chunk_size = args.cases.split(":")
    _step(method, int(chunk_size), *_make_inputs(64, args))  # runtimes initialised outside the step
    inputs = _make_inputs(args.n, args)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _step(method, int(chunk_size), *inputs)
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before, "how": "cuda max_memory_allocated"}
    if _reset_peak_rss():
        before = _proc_bytes("/proc/self/status", "VmRSS")
        _step(method, int(chunk_size), *inputs)
        return {"peak_bytes": _proc_bytes("/proc/self/status", "VmHWM") - before, "how": "VmHWM - VmRSS"}
    before = _proc_bytes("/proc/self/status", "VmRSS")
    _step(method, int(chunk_size), *inputs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"peak_bytes": peak, "how": "ru_maxrss - VmRSS"}


def _worker_time(args: argparse.Namespace) -> dict:
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    inputs = _make_inputs(args.n, args)
    wall: dict[str, list[float]] = {f"{m}:{c}": [] for m, c in cases}
    cpu: dict[str, list[float]] = {f"{m}:{c}": [] for m, c in cases}
    warmup_inputs = _make_inputs(min(args.n, 2048), args)
    for method, chunk_size in cases:
        _step(method, chunk_size, *warmup_inputs)
    for _ in range(args.repeats):
        for method, chunk_size in cases:
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            _step(method, chunk_size, *inputs)
            wall[f"{method}:{chunk_size}"].append(time.perf_counter() - start_wall)
            cpu[f"{method}:{chunk_size}"].append(time.process_time() - start_cpu)
    return {"wall": wall, "cpu": cpu}


def _run_worker(args: argparse.Namespace, mode: str, n: int, cases: list[str]) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        mode,
        "--n",
        str(n),
        "--cases",
        ",".join(cases),
    ]
    for flag in ("device", "repeats", "hidden", "vocab"):
        cmd += ["--" + flag, str(getattr(args, flag))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        return {"error": lines[-1][:60]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2048,8192,32768", help="comma-separated token counts N")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per N (median reported)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cpu, and cuda when available)")
    parser.add_argument("--chunk-size", default=str(DEFAULT_CHUNK_SIZE), help="comma-separated chunk sizes")
    parser.add_argument(
        "--fused", action="store_true", help="also time the fused prototypes (first chunk size)"
    )
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument(
        "--max-naive-gib", type=float, default=16.0, help="skip naive above this estimated peak"
    )
    parser.add_argument("--worker", choices=("memory", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_grad_enabled(True)
        result = _worker_memory(args) if args.worker == "memory" else _worker_time(args)
        print(json.dumps(result))
        return

    chunk_sizes = [int(c) for c in args.chunk_size.split(",")]
    devices = ["cpu", "cuda"] if args.device == "auto" and torch.cuda.is_available() else [args.device]
    devices = ["cpu" if d == "auto" else d for d in devices]
    print(
        f"H={args.hidden} V={args.vocab} fp32, forward+backward, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, {args.repeats} timed rounds, "
        f"load average at start {os.getloadavg()[0]:.1f}"
    )
    columns = ["device", "N", "chunk", "naive peak", "chunked peak", "memory"]
    columns += ["naive time", "chunked time", "time ratio", "CPU-time ratio"]
    if args.fused:
        columns += ["fused-1pass / chunked", "fused-2pass / chunked"]
    how = "?"
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns), flush=True)
    for device in devices:
        args.device = device
        for n in (int(s) for s in args.sizes.split(",")):
            estimate = NAIVE_NV_BUFFERS * n * args.vocab * 4
            run_naive = estimate <= min(args.max_naive_gib * 2**30, 0.8 * _available_bytes(device))
            memory = {"naive": {"skipped": f"skipped (~{_fmt_bytes(estimate)})"}}
            if run_naive:
                memory["naive"] = _run_worker(args, "memory", n, ["naive:0"])
            for c in chunk_sizes:
                memory[f"chunked:{c}"] = _run_worker(args, "memory", n, [f"chunked:{c}"])
            cases = (["naive:0"] if run_naive else []) + [f"chunked:{c}" for c in chunk_sizes]
            if args.fused:
                cases += [f"fused-1pass:{chunk_sizes[0]}", f"fused-2pass:{chunk_sizes[0]}"]
            timing = _run_worker(args, "time", n, cases)
            wall = {k: (statistics.median(v), min(v)) for k, v in timing.get("wall", {}).items()}
            cpu = {k: statistics.median(v) for k, v in timing.get("cpu", {}).items()}
            if device != "cpu":
                cpu = {}
            naive_mem = memory["naive"]
            for i, c in enumerate(chunk_sizes):
                chunked_mem = memory[f"chunked:{c}"]
                how = chunked_mem.get("how", how)
                cells = [device, str(n), str(c)]
                for res in (naive_mem, chunked_mem):
                    cells.append(res.get("skipped") or res.get("error") or _fmt_bytes(res["peak_bytes"]))
                both = "peak_bytes" in naive_mem and "peak_bytes" in chunked_mem
                ratio = naive_mem["peak_bytes"] / chunked_mem["peak_bytes"] if both else None
                cells.append(f"{ratio:.1f}x lower" if ratio else "-")
                cells += [_fmt_time(wall.get(k), timing) for k in ("naive:0", f"chunked:{c}")]
                cells.append(_fmt_ratio(wall, "naive:0", f"chunked:{c}"))
                cells.append(_fmt_ratio(cpu, "naive:0", f"chunked:{c}"))
                if args.fused:
                    # wall-clock ratio of medians (CPU-time ratio), at the first chunk size only
                    for m in ("fused-1pass", "fused-2pass"):
                        base, other = f"chunked:{c}", f"{m}:{c}"
                        cells.append(
                            f"{_fmt_ratio(wall, base, other)} ({_fmt_ratio(cpu, base, other)})"
                            if i == 0
                            else "-"
                        )
                print("| " + " | ".join(cells) + " |", flush=True)
    print(f"memory: {how} of one step, fresh subprocess per case; time: median (min) wall-clock")
    print(f"load average at end {os.getloadavg()[0]:.1f}")


def _fmt_time(median_min: tuple[float, float] | None, timing: dict) -> str:
    if median_min is None:
        return timing.get("error", "-")
    return f"{median_min[0]:.2f} s ({median_min[1]:.2f})"


def _fmt_ratio(values: dict, base: str, other: str) -> str:
    def median(v):
        return v[0] if isinstance(v, tuple) else v

    if base not in values or other not in values:
        return "-"
    return f"{median(values[other]) / median(values[base]):.2f}x"


if __name__ == "__main__":
    main()
