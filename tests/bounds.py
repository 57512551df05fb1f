"""Error bounds that tests derive their tolerances from, so that a tolerance holds on every CPU and thread count.

Two runs that differ only in float summation order (another micro-batch layout, another number of ranks,
another BLAS kernel) agree to a bound, not bit for bit. ``u`` is a format's unit roundoff.
"""

from __future__ import annotations

U32 = 2.0**-24
"""float32's unit roundoff: one rounding moves a value by at most this, relatively."""

TINY_REDUCTION_TERMS = 256
"""The longest sum in the tiny test models' forward and backward passes: hidden 64, MLP 128, vocabulary 99,
and at most 256 tokens in one micro-batch or minibatch of the tests that use this."""

TINY_CHAIN = 8
"""Sums a tiny model's gradient element passes through in sequence (2 layers: attention, MLP, norms, head):
each adds its own relative error."""


def sum_rtol(terms: int, u: float = U32) -> float:
    """Relative error of a sum of ``terms`` values in any order, against the sum of their magnitudes:
    (n - 1) u, to first order (Higham, Accuracy and Stability of Numerical Algorithms, 4.2)."""
    return max(terms - 1, 1) * u


def tiny_gradient_rtol() -> float:
    """How far the tiny model's gradient elements may move, relatively, under another summation order: a chain
    of ``TINY_CHAIN`` sums of at most ``TINY_REDUCTION_TERMS`` terms each (1.2e-4). It holds where an element's
    terms do not cancel to far below their magnitudes; an element that is itself at rounding level gets its
    own bound in the test."""
    return TINY_CHAIN * sum_rtol(TINY_REDUCTION_TERMS)


def assert_sums_close(got, want, rho: float, msg: str = "") -> None:
    """Tensors computed by sums in two orders, each element within ``rho`` of the magnitudes of its terms:
    relatively, or absolutely against the tensor's largest element, which bounds those magnitudes where an
    element's terms cancel."""
    import torch

    scale = torch.as_tensor(want).abs()
    atol = rho * float(scale.max()) if scale.numel() else 0.0
    # rho: the caller's bound, which its comment derives
    torch.testing.assert_close(got, want, rtol=rho, atol=atol, msg=msg or None)


def _adam_ratio_bounds(updates: int, betas: tuple[float, float]) -> list[float]:
    """C_t for t = 1..updates: by Cauchy-Schwarz |m_hat| / sqrt(v_hat) <= C_t = sqrt(sum_k a_k^2 / b_k) with
    the bias-corrected weights a_k of m and b_k of v at step t (1 at t = 1)."""
    beta1, beta2 = betas
    return [
        sum(
            ((1 - beta1) * beta1**k / (1 - beta1**t)) ** 2 / ((1 - beta2) * beta2**k / (1 - beta2**t))
            for k in range(t)
        )
        ** 0.5
        for t in range(1, updates + 1)
    ]


def adam_drift(lr: float, updates: int, rho: float, betas: tuple[float, float] = (0.9, 0.99)) -> float:
    """How far two AdamW runs' weights may drift apart after ``updates`` steps at learning rate ``lr`` when
    every gradient element of one is within a relative ``rho`` of the other's.

    AdamW moves a weight by lr * m/(sqrt(v) + eps) (and a decoupled decay, which shrinks a difference): m and
    v are weighted sums of the gradients and their squares, so m moves by at most rho * M1 (M1 the same
    sum of |g|) and sqrt(v) by at most rho * sqrt(v); the step's ratio by at most 2 rho M1 / sqrt(v) / (1 -
    rho). By Cauchy-Schwarz M1 / sqrt(v) <= C_t = sqrt(sum_k a_k^2 / b_k) with the bias-corrected weights
    a_k of m and b_k of v at step t (1 at t = 1). The drift is at most the sum of lr * 2 rho C_t / (1 - rho).
    """
    return sum(lr * 2 * rho * c / (1 - rho) for c in _adam_ratio_bounds(updates, betas))


def adam_step_bound(lr: float, updates: int, betas: tuple[float, float] = (0.9, 0.99)) -> float:
    """How far two AdamW runs' weights may drift apart at most, whatever their gradients: each update moves
    a weight by at most lr * C_t (``_adam_ratio_bounds``), so two runs by at most twice the sum."""
    return sum(2 * lr * c for c in _adam_ratio_bounds(updates, betas))


def assert_adam_close(got, want, *, lr: float, updates: int, rho: float, betas=(0.9, 0.99), msg: str = ""):
    """Weights after ``updates`` AdamW steps whose gradients differ by float summation order (relatively by
    at most ``rho``): within ``adam_drift`` everywhere but at the few elements whose gradient cancels to
    rounding level, where AdamW's division by the gradient's own size turns noise into a step; those (at
    most 1 in 1000, and 2) are held to ``adam_step_bound``. A sequence trained twice or not at all moves
    most elements by ~lr, far past both."""
    import torch

    drift, step = adam_drift(lr, updates, rho, betas), adam_step_bound(lr, updates, betas)
    diff = (got - want).abs()
    beyond = int((diff > drift).sum())
    assert beyond <= max(2, got.numel() // 1000), (
        f"{msg}: {beyond} of {got.numel()} elements off by > {drift:.2g}"
    )
    assert float(diff.max()) <= step, f"{msg}: off by {float(diff.max()):.3g} > any {updates} AdamW steps"
    assert torch.isfinite(got).all(), msg
