"""The gradient-clipping norm over SmolLM2-135M-shaped fp32 gradients: torch's (``get_total_norm``, what
``clip_grad_norm_`` uses) against gspo's (gspo.parallel.clipping.total_norm), time and error against the
float64 norm. Random normal values; no model is loaded.

    python benchmarks/grad_norm.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

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
        f"{sum(g.numel() for g in grads) / 1e6:.1f}M values in {len(grads)} tensors, {torch.get_num_threads()} threads"
    )
    for name, norm in (
        ("torch get_total_norm", torch.nn.utils.get_total_norm),
        ("gspo total_norm", total_norm),
    ):
        norm(grads)  # warm-up
        start = time.perf_counter()
        for _ in range(args.repeats):
            value = float(norm(grads))
        ms = (time.perf_counter() - start) / args.repeats * 1e3
        print(f"{name:>22}: {ms:6.1f} ms, relative error {abs(value - exact) / exact:.1e}")


if __name__ == "__main__":
    main()
