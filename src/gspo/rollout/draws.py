"""One token per row from next-token logits: greedy, or drawn at a temperature within a top-p nucleus, by
each sample's own counter-based random stream.

A sample's draw at its t-th token uses one uniform u = hash(stream, t) in (0, 1] (splitmix64's finaliser,
a counter-based generator: no state, so a sample's draws depend on neither the other rows of the batch
nor the order of the steps) and takes the first token whose cumulative probability reaches u, an inverse
CDF over the distribution (the nucleus's, renormalised, under top-p). The log-probs returned are those of
the tempered distribution, log_softmax(logits / temperature) at the chosen token, which the trainer also
scores; top-p truncation is not folded into them (as in vLLM's default). Greedy rows take the argmax and
report log_softmax(logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gspo.core.seeds import mix64


def uniform(key: int, counter: int) -> float:
    """The counter-th draw of stream `key`: a float in (0, 1] with 53 random bits."""
    return ((mix64(key ^ mix64(counter)) >> 11) + 1) * 2.0**-53


@dataclass(frozen=True)
class Row:
    """One row's draw: its uniform in (0, 1] and its request's settings (host values: deciding what to
    compute needs no device sync)."""

    uniform: float
    temperature: float = 1.0
    """> 0; ignored on greedy rows."""
    top_p: float = 1.0
    """In (0, 1]; 1 keeps the whole distribution."""
    greedy: bool = False


@dataclass
class Draws:
    """The drawn tokens of n rows, their log-probs and, if asked, the k most likely tokens' log-probs."""

    tokens: Tensor  # (n,) long
    logprobs: Tensor  # (n,) float32
    top_ids: Tensor | None = None  # (n, k) long, most likely first
    top_logprobs: Tensor | None = None  # (n, k) float32


def draw(logits: Tensor, rows: Sequence[Row], *, top_k: int = 0, work: Tensor | None = None) -> Draws:
    """One token per row of `logits` (n, V) float32 (module docstring); `top_k`: how many of the most
    likely tokens' log-probs to return per row (0: none). In place: `logits` is overwritten with the
    log-probs, and the probabilities go to `work`, a (>= n, V) float32 buffer reused across calls (a
    fresh (n, V) tensor per call costs more in page faults than the arithmetic), or a new tensor."""
    n, device = logits.shape[0], logits.device
    scales = [1.0 if row.greedy else row.temperature for row in rows]
    if any(scale != 1.0 for scale in scales):
        logits.div_(torch.tensor(scales, device=device)[:, None])
    log_pi = torch.log_softmax(logits, dim=-1, out=logits)  # (n, V), in place (see gspo.core.logprobs)
    probs = torch.exp(log_pi, out=work[:n] if work is not None else None)
    uniforms = torch.tensor([row.uniform for row in rows], dtype=torch.float32, device=device)
    tokens = _inverse_cdf(probs, uniforms)
    nucleus = [i for i, row in enumerate(rows) if row.top_p < 1.0 and not row.greedy]
    if nucleus:
        index = torch.tensor(nucleus, device=device)
        top_p = torch.tensor([rows[i].top_p for i in nucleus], device=device)
        tokens[index] = _nucleus_draw(probs[index], uniforms[index], top_p)
    greedy = [i for i, row in enumerate(rows) if row.greedy]
    if greedy:
        index = torch.tensor(greedy, device=device)
        tokens[index] = log_pi[index].argmax(-1)
    draws = Draws(tokens, log_pi.gather(1, tokens[:, None]).squeeze(1))
    if top_k > 0:
        draws.top_logprobs, draws.top_ids = log_pi.topk(top_k, dim=-1)
    return draws


BLOCK = 256
"""Tokens per block of the two-level inverse CDF."""


def _inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """(n,) the first index whose cumulative probability reaches u times the row's total: token i with
    probability p_i is chosen for u in (cdf_{i-1}, cdf_i], so a zero-probability token never is (u > 0).

    Two levels, to read the (n, V) probabilities once and write nothing of that size: the blocks' sums
    locate the block, a cumulative sum inside it the token."""
    vocab = probs.shape[1]
    full = vocab - vocab % BLOCK
    sums = probs[:, :full].unflatten(1, (-1, BLOCK)).sum(-1)  # (n, blocks)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], 1)
    cdf = sums.cumsum(-1)
    target = uniforms * cdf[:, -1]  # (n,)
    block = torch.searchsorted(cdf, target[:, None]).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    index = block[:, None] * BLOCK + torch.arange(BLOCK, device=probs.device)  # (n, BLOCK)
    inside = probs.gather(1, index.clamp(max=vocab - 1)).masked_fill_(index >= vocab, 0.0).cumsum(-1)
    # rounding may put the rest just past the block's own sum: its last token of positive probability
    rest = torch.minimum(target - before, inside[:, -1])
    tokens = block * BLOCK + torch.searchsorted(inside, rest[:, None]).squeeze(1).clamp_(max=BLOCK - 1)
    # a row that is not finite (a diverged model) finds no token: keep it a valid index, and its NaN
    # log-prob for the learner's check to name
    return tokens.clamp_(max=vocab - 1)


def _nucleus_draw(probs: Tensor, uniforms: Tensor, top_p: Tensor) -> Tensor:
    """(m,) a draw from each row's top-p nucleus: the smallest set of the most likely tokens whose
    probability reaches top_p (transformers' TopPLogitsWarper rule: in ascending order, a token is dropped
    while the cumulative probability up to it is <= 1 - top_p; the most likely token always stays)."""
    ascending, order = probs.sort(dim=-1, stable=True)
    drop = ascending.cumsum(-1) <= (1 - top_p)[:, None]
    drop[:, -1] = False
    index = _inverse_cdf(ascending.masked_fill_(drop, 0.0), uniforms)
    return order.gather(1, index[:, None]).squeeze(1)
