"""The gradient-clipping norm over SmolLM2-135M-shaped fp32 gradients: torch's (``get_total_norm``, what
``clip_grad_norm_`` uses), one BLAS dot per tensor (gspo's before its blocked sum) and gspo's
(gspo.parallel.clipping.total_norm: float32 sums of 1024-value blocks added in float64), time and error
against the float64 norm, on this CPU and thread count (both printed). Random normal values; no model is
loaded. The variants alternate, round by round.

    python benchmarks/grad_norm.py [--repeats 5]
    OMP_NUM_THREADS=1 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/grad_norm.py   # other summation orders
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from gspo.parallel.clipping import total_norm

# SmolLM2-135M: the tied embedding, then 30 layers of q, k, v, o, gate, up, down and two norms, the final norm
SHAPES = (
    [(49152, 576)]
    + [
        shape
        for _ in range(30)
        for shape in [
            (576, 576),
            (192, 576),
            (192, 576),
            (576, 576),
            (1536, 576),
            (1536, 576),
            (576, 1536),
            (576,),
            (576,),
        ]
    ]
    + [(576,)]
)


def one_dot_per_tensor(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum of squares as one BLAS dot (whose accuracy is the BLAS build's), added in float64."""
    squares = torch.stack([torch.dot(g.reshape(-1), g.reshape(-1)) for g in grads])
    return squares.double().sum().sqrt().float()


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    exact = float(torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt())
    print(
        f"{sum(g.numel() for g in grads) / 1e6:.1f}M values in {len(grads)} tensors, {cpu_name()}, "
        f"{torch.get_num_threads()} threads"
    )
    variants = {
        "torch get_total_norm": torch.nn.utils.get_total_norm,
        "one BLAS dot per tensor": one_dot_per_tensor,
        "gspo total_norm": total_norm,
    }
    seconds = {name: [] for name in variants}
    errors = {}
    for norm in variants.values():
        norm(grads)  # warm-up
    for _ in range(args.repeats):
        for name, norm in variants.items():
            start = time.perf_counter()
            value = float(norm(grads))
            seconds[name].append(time.perf_counter() - start)
            errors[name] = abs(value - exact) / exact
    for name in variants:
        ms = sorted(seconds[name])[len(seconds[name]) // 2] * 1e3
        print(f"{name:>24}: {ms:6.1f} ms (median), relative error {errors[name]:.1e}")


if __name__ == "__main__":
    main()
