"""Per-token log-probabilities through the LM head, chunked over tokens, with exact gradients.

``token_logprobs`` never holds more than a (chunk_size, V) block of logits: the forward keeps only the
(N,) log-probs (and the last chunk's block), the backward recomputes each chunk's softmax. Logits are
divided by the sampling temperature; bf16/fp16 inputs are computed in fp32. ``causal_lm_logprobs`` runs a
transformers causal LM to its final hidden states and scores only the positions asked for. Design and
benchmark: docs/logprobs.md; the Triton kernels of ``kernel="triton"``: gspo.core.triton_logprobs.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from gspo.core.attention import segment_attention

# Tuned on a 2-core AVX-512 CPU for H=576, V=49,152 (docs/logprobs.md): at N = 8192 tokens, 1024 is
# as fast as the naive path (512: 1.08x) with a 12x lower peak (512: 17x).
DEFAULT_CHUNK_SIZE = 1024

# (Log-)softmax is computed in place, out= aliasing its input: the kernels (CPU and CUDA) read each
# element of a row before writing the same element, and it saves a (chunk, V) buffer plus a memory
# pass per chunk. tests/test_logprobs.py::test_in_place_softmax_is_exact guards this assumption.

# Config attributes with which a model transforms its logits after the head; we refuse rather than
# silently compute log-probs of a different distribution.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}

KERNELS = ("auto", "torch", "triton")
"""Who computes the passes over each chunk's logits: torch ops, or Triton kernels (gspo.core.triton_logprobs);
"auto": Triton on CUDA tensors when it is installed, torch otherwise."""


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``kernel`` with "auto" resolved for tensors on ``device``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown log-prob kernel {kernel!r}; choose one of {KERNELS}")
    if kernel != "auto":
        return kernel
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    lm_head_bias: Tensor | None = None,
    kernel: str = "torch",
    entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """log pi(target) for each row of ``hidden``, without materialising the (N, V) logits.

    pi = softmax((hidden @ weight.T + lm_head_bias) / temperature).

    With ``entropy``, also each row's entropy H = -sum_j pi_j log pi_j (N,), with its gradient: the same
    chunks, one more (chunk_size, V) buffer, and the torch kernel whatever ``kernel`` says (the Triton
    kernels compute log-probs only).

    Args:
        hidden: (N, H) final hidden states, any float dtype.
        weight: (V, H) LM head (output embedding) weight; may be tied to the input embedding, the
            gradients then accumulate on the shared parameter as usual.
        targets: (N,) long token ids in [0, V).
        chunk_size: tokens per chunk; the extra memory is one (chunk_size, V) fp32 buffer, held from
            the forward to the backward when grads are needed, plus (V, H) fp32 for the weight's gradient.
        temperature: sampling temperature (> 0) the rollouts were drawn with.
        lm_head_bias: optional (V,) bias of the head.
        kernel: "torch", "triton" (gspo.core.triton_logprobs: the same function, same chunks) or "auto"
            (see ``KERNELS``).

    Returns:
        (N,) float32 log-probs; with ``entropy``, (log-probs, entropies).
    """
    _check_head_inputs(hidden, weight, targets, lm_head_bias, chunk_size, temperature)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, lm_head_bias)
    )
    # fp32 throughout, also under autocast: mixed precision stops at the head
    with torch.autocast(hidden.device.type, enabled=False):
        if entropy:
            if needs_grad:
                return _ChunkedLogprobsEntropy.apply(
                    hidden, weight, lm_head_bias, targets, chunk_size, temperature
                )
            logp, entropies, _ = _forward_chunks_entropy(
                hidden, weight, lm_head_bias, targets, chunk_size, temperature
            )
            return logp, entropies
        if resolve_kernel(kernel, hidden.device) == "triton":
            from gspo.core.triton_logprobs import triton_token_logprobs  # needs triton: imported on use

            return triton_token_logprobs(
                hidden,
                weight,
                targets,
                chunk_size=chunk_size,
                temperature=temperature,
                lm_head_bias=lm_head_bias,
                needs_grad=needs_grad,
            )
        if needs_grad:
            return _ChunkedTokenLogprobs.apply(hidden, weight, lm_head_bias, targets, chunk_size, temperature)
        return _forward_chunks(hidden, weight, lm_head_bias, targets, chunk_size, temperature)[0]


def _check_head_inputs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    chunk_size: int,
    temperature: float,
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden (N, H) and weight (V, H), got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"lm_head_bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _fp32_head(weight: Tensor, bias: Tensor | None, temperature: float) -> tuple[Tensor, Tensor | None]:
    # 1/T is folded into the (c, H) hidden chunk and into the bias, never applied to a (c, V) block.
    weight32 = weight.detach().float()
    bias32 = None if bias is None else bias.detach().float() / temperature
    return weight32, bias32


def _chunk_logits(
    hidden_c: Tensor, weight32: Tensor, bias32: Tensor | None, temperature: float, out: Tensor
) -> Tensor:
    """(c, V) fp32 tempered logits (hidden_c @ W^T + b) / T written into ``out``."""
    h = hidden_c.detach().float()
    if temperature != 1.0:
        h = h / temperature
    if bias32 is None:
        return torch.mm(h, weight32.T, out=out)
    return torch.addmm(bias32, h, weight32.T, out=out)


def _forward_chunks(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    chunk_size: int,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """log-probs (N,) and the (chunk, V) buffer: its first rows hold log pi of the last chunk."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    weight32, bias32 = _fp32_head(weight, bias, temperature)
    logp = torch.empty(n, dtype=torch.float32, device=device)
    # Reused across chunks: fresh (c, V) allocations each chunk cost page faults on CPU.
    logits_buf = torch.empty(min(chunk_size, n), vocab, dtype=torch.float32, device=device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        c = end - start
        logits = _chunk_logits(hidden[start:end], weight32, bias32, temperature, logits_buf[:c])
        # log pi = log_softmax(z)   (c, V), in place (see the note on in-place softmax)
        log_pi = torch.log_softmax(logits, dim=-1, out=logits)
        logp[start:end] = log_pi.gather(1, targets[start:end, None]).view(-1)
    return logp, logits_buf


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Forward keeps the (N,) outputs and the last chunk's log pi; backward recomputes the other chunks.

    Keeping the last block (it is the forward's buffer, so no extra peak memory) saves one chunk's
    logits matmul: the whole recompute when N <= chunk_size. The backward consumes it in place; a
    second backward (retain_graph) recomputes every chunk.

    With u = h W^T + b, z = u / T, pi = softmax(z), g = dL/dlogp:
        dL/dz_ij = g_i ([j = t_i] - pi_ij)
    and dL/du = dL/dz / T, dL/dh = dL/du W, dL/dW = dL/du^T h, dL/db = sum_i dL/du_i.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature):
        logp, last_log_pi = _forward_chunks(hidden, weight, bias, targets, chunk_size, temperature)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.last_log_pi = last_log_pi
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp):
        hidden, weight, bias, targets = ctx.saved_tensors
        last_log_pi, ctx.last_log_pi = ctx.last_log_pi, None
        if grad_logp is None:
            return None, None, None, None, None, None
        grads = _backward_chunks(
            hidden,
            weight,
            bias,
            targets,
            grad_logp,
            last_log_pi,
            ctx.chunk_size,
            ctx.temperature,
            ctx.needs_input_grad[:3],
        )
        return (*grads, None, None, None)


def _backward_chunks(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    grad_logp: Tensor,
    last_log_pi: Tensor | None,
    chunk_size: int,
    temperature: float,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    need_h, need_w, need_b = needs
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    weight32, bias32 = _fp32_head(weight, bias, temperature)
    hidden32 = hidden.detach().float()
    # dL/du = s ([j = t] - pi) with the row scale s = g / T   (N,)
    g_over_t = grad_logp.float() / temperature

    # the [j = t] terms, once for all tokens (few large ops instead of many small ones per chunk)
    grad_hidden = weight32[targets].mul_(g_over_t[:, None]) if need_h else None  # (N, H)
    # the first chunk writes grad_weight (no zero fill of a (V, H) block), the others accumulate
    grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=device) if need_w else None
    if need_w and n == 0:
        grad_weight.zero_()
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_b else None

    if last_log_pi is None:
        logits_buf = torch.empty(min(chunk_size, n), vocab, dtype=torch.float32, device=device)
    else:
        logits_buf = last_log_pi
    starts = list(range(0, n, chunk_size))
    # the last chunk first: its log pi is still in the buffer from the forward, no recompute
    for i, start in enumerate(starts[-1:] + starts[:-1]):
        end = min(start + chunk_size, n)
        c = end - start
        if i == 0 and last_log_pi is not None:
            pi = logits_buf[:c].exp_()
        else:
            logits = _chunk_logits(hidden[start:end], weight32, bias32, temperature, logits_buf[:c])
            pi = torch.softmax(logits, dim=-1, out=logits)
        s_c = g_over_t[start:end, None]
        if need_h:
            # dL/dh -= s (pi @ W)   (c, H)
            grad_hidden[start:end].addcmul_(torch.mm(pi, weight32), s_c, value=-1.0)
        if need_w:
            # dL/dW -= pi^T (s h)   (V, H)
            if i == 0:
                torch.mm(pi.T, hidden32[start:end] * -s_c, out=grad_weight)
            else:
                grad_weight.addmm_(pi.T, hidden32[start:end] * s_c, alpha=-1.0)
        if need_b:
            grad_bias.addmv_(pi.T, s_c.squeeze(1), alpha=-1.0)
    del logits_buf, last_log_pi
    if need_w:
        grad_weight.index_add_(0, targets, hidden32 * g_over_t[:, None])
    if need_b:
        grad_bias.index_add_(0, targets, g_over_t)
    return (
        None if grad_hidden is None else grad_hidden.to(hidden.dtype),
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    )


def _forward_chunks_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    chunk_size: int,
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """log-probs (N,), entropies (N,), and the (chunk, V) buffer whose first rows hold the last chunk's
    log pi."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    weight32, bias32 = _fp32_head(weight, bias, temperature)
    logp = torch.empty(n, dtype=torch.float32, device=device)
    entropies = torch.empty(n, dtype=torch.float32, device=device)
    logits_buf = torch.empty(min(chunk_size, n), vocab, dtype=torch.float32, device=device)
    pi_buf = torch.empty_like(logits_buf)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        c = end - start
        logits = _chunk_logits(hidden[start:end], weight32, bias32, temperature, logits_buf[:c])
        log_pi = torch.log_softmax(logits, dim=-1, out=logits)
        logp[start:end] = log_pi.gather(1, targets[start:end, None]).view(-1)
        # H = -sum_j pi_j log pi_j   (c,)
        entropies[start:end] = torch.exp(log_pi, out=pi_buf[:c]).mul_(log_pi).sum(-1).neg_()
    return logp, entropies, logits_buf


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """`_ChunkedTokenLogprobs` with each row's entropy as a second output.

    With g = dL/dlogp, e = dL/dH and H_i = -sum_j pi_ij log pi_ij:
        dH_i/dz_ij = -pi_ij (log pi_ij + H_i)
        dL/dz_ij = g_i [j = t_i] - pi_ij (g_i + e_i (log pi_ij + H_i))
    the [j = t_i] part handled as in `_backward_chunks`, the rest as one (c, V) block per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature):
        logp, entropies, _ = _forward_chunks_entropy(hidden, weight, bias, targets, chunk_size, temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, entropies)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp, entropies

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, entropies = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        n = hidden.shape[0]
        g = torch.zeros(n, device=hidden.device) if grad_logp is None else grad_logp.float()
        e = torch.zeros(n, device=hidden.device) if grad_entropy is None else grad_entropy.float()
        grads = _backward_chunks_entropy(
            hidden, weight, bias, targets, g, e, entropies, ctx.chunk_size, ctx.temperature,
            ctx.needs_input_grad[:3],
        )  # fmt: skip
        return (*grads, None, None, None)


def _backward_chunks_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    entropies: Tensor,
    chunk_size: int,
    temperature: float,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of `_ChunkedLogprobsEntropy` (its docstring), dL/du = dL/dz / T with u = h W^T + b."""
    need_h, need_w, need_b = needs
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    weight32, bias32 = _fp32_head(weight, bias, temperature)
    hidden32 = hidden.detach().float()
    inv_t = 1.0 / temperature
    g_over_t = grad_logp * inv_t
    grad_hidden = weight32[targets].mul_(g_over_t[:, None]) if need_h else None  # the [j = t] terms
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_b else None
    logits_buf = torch.empty(min(chunk_size, n), vocab, dtype=torch.float32, device=device)
    pi_buf = torch.empty_like(logits_buf)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        c = end - start
        logits = _chunk_logits(hidden[start:end], weight32, bias32, temperature, logits_buf[:c])
        log_pi = torch.log_softmax(logits, dim=-1, out=logits)
        pi = torch.exp(log_pi, out=pi_buf[:c])
        # M = pi (g + e (log pi + H))   (c, V), in the log pi buffer; dL/dz = g [j = t] - M
        m = log_pi.add_(entropies[start:end, None]).mul_(grad_entropy[start:end, None])
        m = m.add_(grad_logp[start:end, None]).mul_(pi)
        if need_h:
            grad_hidden[start:end].add_(torch.mm(m, weight32), alpha=-inv_t)
        if need_w:
            grad_weight.addmm_(m.T, hidden32[start:end], alpha=-inv_t)
        if need_b:
            grad_bias.add_(m.sum(0), alpha=-inv_t)
    if need_w:
        grad_weight.index_add_(0, targets, hidden32 * g_over_t[:, None])
    if need_b:
        grad_bias.index_add_(0, targets, g_over_t)
    return (
        None if grad_hidden is None else grad_hidden.to(hidden.dtype),
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    )


def causal_lm_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    *,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    logprob_mask: Tensor | None = None,
    prefix_tree: bool = False,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    kernel: str = "torch",
    entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """out[b, t] = log pi(input_ids[b, t] | input_ids[b, :t]) from a transformers causal LM, chunked.

    Runs the model's decoder to its final hidden states (never its LM head), gathers the hidden states
    of positions t - 1 for the scored positions t only, and applies ``token_logprobs`` with the model's
    own output embedding (weight and bias). Prompt tokens that are not scored cost no head FLOPs.

    Batches:
    - padded (left or right): pass ``attention_mask``; when ``position_ids`` is None they are derived
      from it (cumsum - 1, clamped at 0) so both paddings give the same positions.
    - packed: ``attention_mask`` None, ``position_ids`` restarting at 0 for each segment (usually
      B == 1; several packed rows work too; tail padding is one more segment: leave it out of logprob_mask).
      transformers >= 5 turns restarting position_ids into a block-diagonal causal mask for the eager
      and sdpa attentions when there is no attention mask and no cache (we pass use_cache=False: with
      a cache, which its config enables by default, the segments would attend to each other).
    - prefix trees (gspo.core.layout's shared_prefix rows), ``prefix_tree=True``: packed rows of trees in
      depth-first order, position_ids the depth; a token is predicted by its parent (the last earlier
      token one level up), which for a branch's first token is not the token before it.

    Args:
        model: a transformers causal LM, or a peft PeftModel wrapping one (LoRA adapters in the
            decoder are used; an adapter on the LM head itself is not supported).
        input_ids: (B, T) long.
        attention_mask: (B, T), 1/True for real tokens.
        position_ids: (B, T) long, or None.
        logprob_mask: (B, T) bool, positions to score; default all real tokens. A position without a
            real predecessor in its own sequence (t = 0, first real token of a left-padded row, first
            token of a packed segment) is never scored.
        prefix_tree: the packed rows are prefix trees (see Batches).
        temperature: the sampling temperature; logits are divided by it before the softmax.
        chunk_size: tokens per head chunk (see ``token_logprobs``).
        kernel: who computes the head's passes (see ``token_logprobs``).
        entropy: also return the entropy of the distribution each scored token was drawn from.

    Returns:
        (B, T) float32 log-probs, exactly 0 where not scored; with ``entropy``, (log-probs, entropies),
        both (B, T).
    """
    decoder, head = decoder_and_head(model)

    batch, seq_len = input_ids.shape
    if attention_mask is not None and position_ids is not None and _restarts(position_ids, attention_mask):
        raise ValueError(
            "position_ids restart inside a row while attention_mask is given: transformers only builds "
            "the block-diagonal mask of packed segments when attention_mask is None"
        )
    if prefix_tree and (attention_mask is not None or position_ids is None):
        raise ValueError("prefix_tree rows need position_ids and no attention_mask")
    if attention_mask is not None and position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden_states = decoder_hidden_states(decoder, input_ids, attention_mask, position_ids, prefix_tree)

    if not prefix_tree:
        scored = _scored_positions(input_ids, attention_mask, position_ids, logprob_mask)  # (B, T) bool
        flat_pos = scored.flatten().nonzero().squeeze(1)  # (n,) indices b * T + t, all with t >= 1
        predecessor = flat_pos - 1  # the hidden state at t - 1 predicts the token at t
    else:
        scored, previous = _tree_parents(position_ids)
        if logprob_mask is not None:
            scored = scored & logprob_mask.bool()
        flat_pos = scored.flatten().nonzero().squeeze(1)
        predecessor = previous.flatten().index_select(0, flat_pos)
    hidden_prev = hidden_states.flatten(0, 1).index_select(0, predecessor)  # (n, H)
    targets = input_ids.flatten().index_select(0, flat_pos)  # (n,)
    values = token_logprobs(
        hidden_prev,
        head.weight,
        targets,
        chunk_size=chunk_size,
        temperature=temperature,
        lm_head_bias=head.bias,
        kernel=kernel,
        entropy=entropy,
    )
    dense = torch.zeros(batch * seq_len, dtype=torch.float32, device=input_ids.device)
    if entropy:
        logp, entropies = values
        return (
            dense.index_put((flat_pos,), logp).view(batch, seq_len),
            dense.index_put((flat_pos,), entropies).view(batch, seq_len),
        )
    return dense.index_put((flat_pos,), values).view(batch, seq_len)


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """A causal LM's decoder (to its final hidden states) and its plain nn.Linear LM head, whose
    logits are the model's: no wrapper on the head, no transform of the logits after it (else raises).
    ``model``: a transformers causal LM or a peft model around one (the adapters sit in the decoder)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise TypeError(
            f"gspo needs a plain nn.Linear LM head, got {type(head).__name__}; "
            "an adapter or wrapper on the head would be silently ignored"
        )
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    for name, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, name, neutral)
        if value != neutral:
            raise NotImplementedError(f"models with {name}={value} transform their logits after the head")
    return base.get_decoder(), head


def decoder_hidden_states(
    decoder: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    prefix_tree: bool = False,
) -> Tensor:
    """The decoder's final hidden states (B, T, H). Packed rows (no attention_mask, position_ids given)
    run their attention one segment at a time where the model allows it (gspo.core.attention), else with
    transformers' block-diagonal mask; prefix-tree rows need the former."""
    packed = attention_mask is None and position_ids is not None
    with segment_attention(decoder, position_ids, prefix_tree) if packed else contextlib.nullcontext():
        # use_cache=False: a cache would also stop transformers from detecting packed segments
        outputs = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
    return outputs.last_hidden_state


def _scored_positions(
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    logprob_mask: Tensor | None,
) -> Tensor:
    """(B, T) bool: positions t whose token has a real predecessor t - 1 in the same sequence."""
    has_predecessor = torch.ones_like(input_ids, dtype=torch.bool)
    has_predecessor[:, 0] = False
    if attention_mask is not None:
        real = attention_mask.bool()
        has_predecessor[:, 1:] &= real[:, 1:] & real[:, :-1]
    elif position_ids is not None:
        # packed: a segment starts wherever the position does not continue the previous one
        pos = position_ids.expand_as(input_ids)
        has_predecessor[:, 1:] &= pos[:, 1:] == pos[:, :-1] + 1
    if logprob_mask is not None:
        has_predecessor &= logprob_mask.bool()
    return has_predecessor


def _tree_parents(position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Prefix-tree rows (depth-first, position = depth): (B, T) whether a token has a parent, and the flat
    index b * T + t' of that parent: the last earlier token one level up, which is the previous token
    unless the token starts a branch."""
    rows, width = position_ids.shape
    index = torch.arange(width, device=position_ids.device).expand(rows, width)
    continues = torch.zeros_like(position_ids, dtype=torch.bool)
    continues[:, 1:] = position_ids[:, 1:] == position_ids[:, :-1] + 1
    parent = index - 1
    starts = ((position_ids > 0) & ~continues).nonzero()  # (n, 2): (row, t) of each branch's first token
    if len(starts):
        row, t = starts[:, 0], starts[:, 1]
        depth = position_ids[row, t]
        # [n, t']: an earlier token of the row one level up; the parent is the last of them
        candidates = (position_ids[row] == (depth - 1)[:, None]) & (index[row] < t[:, None])
        if not bool(candidates.any(-1).all()):
            raise ValueError(
                "prefix_tree rows need every token's parent before it (trees depth-first, position_ids the depth)"
            )
        parent[row, t] = width - 1 - candidates.flip(-1).to(torch.uint8).argmax(-1)
    row_offset = torch.arange(rows, device=position_ids.device)[:, None] * width
    return position_ids > 0, parent.clamp(min=0) + row_offset


def _restarts(position_ids: Tensor, attention_mask: Tensor) -> bool:
    """Whether some real token's position is lower than its real predecessor's (a packed row)."""
    both_real = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    return bool(((position_ids[:, 1:] < position_ids[:, :-1]) & both_real).any())
