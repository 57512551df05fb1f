"""Expert routing of Mixture-of-Experts models: recording it, measuring its volatility, Routing Replay.

Forward hooks on transformers' top-k routers (``*TopKRouter`` modules: Qwen2/3-MoE, OLMoE, Mixtral) record
the k experts each token is sent to, compare two routings of the same tokens (the paper's "about 10% of
activated experts change", section 4.3), and replay the old policy's experts with gates recomputed by
the current router; `UpdateRouting` is the learner's bookkeeping of one update. docs/moe.md has the
definitions and our reading of the paper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gspo.core.layout import MicroBatch
from gspo.core.logprobs import decoder_hidden_states

ROUTER_SUFFIX = "TopKRouter"


@dataclass
class Routing:
    """Expert choices of one forward pass: ``experts[l]`` is the (N, k) long tensor of the l-th MoE layer."""

    experts: list[Tensor]


@dataclass
class RoutingDifference:
    """Counts comparing two routings on the same tokens; they add up over micro-batches (``+``)."""

    changed_sets: int = 0
    """(token, layer) pairs whose set of k experts differs."""
    changed_experts: int = 0
    """(token, layer, slot) activated experts of `before` that `after` does not activate."""
    pairs: int = 0
    """(token, layer) pairs compared."""
    experts: int = 0
    """Activated experts compared: pairs * k."""

    def __add__(self, other: RoutingDifference) -> RoutingDifference:
        return RoutingDifference(
            self.changed_sets + other.changed_sets,
            self.changed_experts + other.changed_experts,
            self.pairs + other.pairs,
            self.experts + other.experts,
        )

    def metrics(self) -> dict[str, float]:
        """``routing_volatility`` (changed sets / pairs) and ``routing_expert_change_frac``; 0 when empty."""
        return {
            "routing_volatility": self.changed_sets / max(1, self.pairs),
            "routing_expert_change_frac": self.changed_experts / max(1, self.experts),
        }


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router modules of ``model`` in layer order; empty for a dense model."""
    return [m for m in _base(model).modules() if type(m).__name__.endswith(ROUTER_SUFFIX)]


def is_moe(model: nn.Module) -> bool:
    return bool(moe_routers(model))


def _unpack(module: nn.Module, output: object) -> tuple[Tensor, Tensor, Tensor]:
    if (
        not isinstance(output, tuple)
        or len(output) != 3
        or output[2].dtype not in (torch.int32, torch.int64)
        or output[2].dim() != 2
        or output[1].shape != output[2].shape
    ):
        raise NotImplementedError(
            f"{type(module).__name__} does not return (router_logits, gates (N, k), experts (N, k)); "
            "routing capture supports transformers' softmax top-k routers (Qwen2/3-MoE, OLMoE, Mixtral)"
        )
    return output  # type: ignore[return-value]


@contextlib.contextmanager
def _hooked(model: nn.Module, make_hook) -> Iterator[list[nn.Module]]:
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(_base(model)).__name__} has no top-k MoE router ({ROUTER_SUFFIX} module)")
    handles = [router.register_forward_hook(make_hook(layer)) for layer, router in enumerate(routers)]
    try:
        yield routers
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def record_passes(model: nn.Module, *, enabled: bool = True) -> Iterator[list[Routing]]:
    """Record the experts each router chooses, one Routing per forward pass run inside the block.

    A pass starts when the first router runs. ``enabled=False`` records nothing (the list stays empty),
    so a caller can wrap dense and MoE models alike.

    >>> with torch.no_grad(), record_passes(model) as passes:  # doctest: +SKIP
    ...     model(input_ids_a)
    ...     model(input_ids_b)
    >>> passes[1].experts[0].shape  # (B*T, k) of the second pass, first MoE layer  # doctest: +SKIP
    """
    passes: list[Routing] = []
    if not enabled:
        yield passes
        return

    def make_hook(layer: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            experts = _unpack(module, output)[2]
            if layer == 0:
                passes.append(Routing([torch.empty(0, dtype=torch.long)] * num_layers))
            passes[-1].experts[layer] = experts.detach().clone()

        return hook

    with _hooked(model, make_hook) as routers:
        num_layers = len(routers)
        yield passes


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[Routing]:
    """Record the experts each router chooses during the one forward pass run inside the block.

    >>> with torch.no_grad(), record_routing(model) as routing:  # doctest: +SKIP
    ...     model(input_ids)
    >>> routing.experts[0].shape  # (B*T, k)  # doctest: +SKIP
    """
    routing = Routing([])
    with record_passes(model) as passes:
        yield routing
    if len(passes) != 1:
        raise ValueError(f"record_routing records one forward pass, {len(passes)} ran inside the block")
    routing.experts = passes[0].experts


def _replayed_gates(
    module: nn.Module, logits: Tensor, gates: Tensor, experts: Tensor, replay: Tensor
) -> Tensor:
    """The current router's gates for the replayed experts, normalised the way the router normalises."""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
    own = probs.gather(1, experts)  # (N, k) the router's own top-k probabilities
    candidates = {"plain": own, "renormalised": own / own.sum(-1, keepdim=True)}
    declared = getattr(module, "norm_topk_prob", None)
    order = ["renormalised", "plain"] if declared or declared is None else ["plain", "renormalised"]
    tol = 1e-5 if gates.dtype == torch.float32 else 1e-2
    for form in order:
        if torch.allclose(
            candidates[form].to(gates.dtype).float(), gates.detach().float(), atol=tol, rtol=tol
        ):
            break
    else:
        raise NotImplementedError(
            f"{type(module).__name__}: its gates are not softmax(router_logits)[experts] (renormalised or "
            "not); Routing Replay cannot recompute them"
        )
    chosen = probs.gather(1, replay)  # (N, k)
    if form == "renormalised":
        chosen = chosen / chosen.sum(-1, keepdim=True)
    return chosen.to(gates.dtype)


@contextlib.contextmanager
def routing_replay(model: nn.Module, routing: Routing) -> Iterator[Routing]:
    """Make every router use the experts recorded in ``routing`` for the forward pass run inside the block.

    Gates are recomputed by the current router over the replayed experts (see the module docstring). The
    forward must see exactly the recorded token layout (same micro-batch); a shape mismatch raises.
    Yields the experts the routers would have chosen themselves (for volatility), filled by the forward.
    """
    natural = Routing([])

    def make_hook(layer: int):
        def hook(module: nn.Module, args: tuple, output: object) -> tuple[Tensor, Tensor, Tensor]:
            logits, gates, experts = _unpack(module, output)
            replay = routing.experts[layer].to(experts.device)
            if replay.shape != experts.shape:
                raise ValueError(
                    f"Routing Replay: layer {layer} recorded experts of shape {tuple(replay.shape)} but the "
                    f"forward routes {tuple(experts.shape)}: replay needs the same micro-batch layout"
                )
            natural.experts[layer] = experts.detach().clone()
            return logits, _replayed_gates(module, logits, gates, experts, replay), replay.to(experts.dtype)

        return hook

    with _hooked(model, make_hook) as routers:
        if len(routing.experts) != len(routers):
            raise ValueError(
                f"Routing Replay: {len(routing.experts)} layers recorded, the model has {len(routers)}"
            )
        natural.experts = [torch.empty(0, dtype=torch.long)] * len(routers)
        yield natural


def routing_difference(
    before: Routing, after: Routing, token_mask: Tensor | None = None
) -> RoutingDifference:
    """Compare two routings of the same tokens, per layer and token, as sets of k experts.

    token_mask: (N,) or any shape with N elements, True on the tokens to count (e.g. a micro-batch's
    ``logprob_mask``); None counts every token.
    """
    diff = RoutingDifference()
    for old, new in zip(before.experts, after.experts, strict=True):
        if old.shape != new.shape:
            raise ValueError(f"routings of different shapes: {tuple(old.shape)} vs {tuple(new.shape)}")
        n, k = old.shape
        mask = torch.ones(n, dtype=torch.bool) if token_mask is None else token_mask.reshape(-1).bool().cpu()
        if mask.numel() != n:
            raise ValueError(f"token_mask has {mask.numel()} elements, the routing {n} tokens")
        old, new = old[mask].cpu(), new[mask].cpu()
        # kept[n, j]: the j-th expert chosen before is still among the k chosen after   (n, k)
        kept = (old[:, :, None] == new[:, None, :]).any(-1)
        diff = diff + RoutingDifference(
            changed_sets=int((~kept).any(-1).sum()),
            changed_experts=int((~kept).sum()),
            pairs=int(mask.sum()),
            experts=int(mask.sum()) * k,
        )
    return diff


class UpdateRouting:
    """The routing bookkeeping of one optimizer update, for the learner: around each micro-batch's forward,
    the old policy's expert choices (``routes``, one Routing per micro-batch; None for a dense model: then it
    does nothing) are replayed (Routing Replay, ``replay``) or the current routers' own are recorded, and
    how far the routers' own choices moved from the old policy's is counted."""

    def __init__(self, model: nn.Module, routes: list[Routing] | None, *, replay: bool) -> None:
        self.model, self.routes, self.replay = model, routes, replay
        self.moved = RoutingDifference()  # the current routers' own choices vs the old policy's

    @contextlib.contextmanager
    def forward(self, j: int, token_mask: Tensor) -> Iterator[None]:
        """Around micro-batch j's forward pass; token_mask: the tokens counted (its ``logprob_mask``)."""
        if self.routes is None:
            yield
            return
        hooks = routing_replay(self.model, self.routes[j]) if self.replay else record_routing(self.model)
        with hooks as natural:  # what the current routers choose themselves, replayed or not
            yield
        self.moved = self.moved + routing_difference(self.routes[j], natural, token_mask)

    def metrics(self, updates_before: int) -> dict[str, float]:
        """``routing_volatility`` and ``routing_expert_change_frac`` of the routers against the old policy's,
        named ``*_after_{k}_updates`` by the k updates of the step before this one (none for k = 0: the
        policy had not moved)."""
        if self.routes is None or updates_before == 0:
            return {}
        return {f"{key}_after_{updates_before}_updates": v for key, v in self.moved.metrics().items()}


@torch.no_grad()
def expert_choices(model: nn.Module, mb: MicroBatch) -> Routing:
    """The experts ``model`` chooses for every token of a micro-batch (a decoder pass, no LM head)."""
    decoder = _base(model).get_decoder()
    with record_routing(model) as routing:  # the attention of the log-prob passes, for the same routing
        decoder_hidden_states(decoder, mb.input_ids, mb.attention_mask, mb.position_ids, mb.prefix_tree)
    return routing


def routing_volatility(model: nn.Module, micro: list[MicroBatch], before: list[Routing]) -> dict[str, float]:
    """Volatility of ``model``'s routing against ``before`` (one Routing per micro-batch), on the completion
    tokens (``logprob_mask``) of the micro-batches: ``routing_volatility`` and ``routing_expert_change_frac``.
    """
    total = RoutingDifference()
    for mb, old in zip(micro, before, strict=True):
        total = total + routing_difference(old, expert_choices(model, mb), mb.logprob_mask)
    return total.metrics()
