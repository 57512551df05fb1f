"""The sampling engine: continuous batching of a model's completions over a preallocated KV cache.

Work arrives as requests (a prompt's token ids x n samples, with their `SamplingParams`) and waits in a
queue; a fixed number of slots decode together, one token per slot per `step()`. A sample that stops (a
stop token, its max_new_tokens, the context) frees its slot and the same step fills it from the queue,
so the batch stays full while completions end at different lengths. A prompt is computed once (prefill,
batched with the step's other new prompts) and its keys and values copied into the slots of its
samples, also of samples admitted steps later and of other queued requests with the same prompt (e.g.
an agent's G episodes sent as G requests). The slots' keys and values live in a
gspo.rollout.kv_cache.SlotCache, written in place, read through the model's own modules (any
transformers decoder whose attention dispatches through AttentionInterface: GQA, sliding windows, MoE,
LoRA adapters, autocast), so the log-probs are the model's. Each sample draws from its own counter-based
random stream (gspo.rollout.draws), so its tokens depend on its seed and sample index only, not on
the other samples in the batch.

Threading: `submit`, `cancel`, `reset_prefix_cache`, `idle`, `load` and `wait` may be called from any
thread; `step` and `generate` from one thread at a time (the driver, which may sleep in `wait()` while
idle), and no other forward of the model may run during a step (it switches the model's attention
implementation for its forwards). A sample's record (`Completion`) is appended to by `step` only: read
it from the driver thread, or after its finish event. Between steps the model's weights may change in
place (a trainer's update): the engine keeps nothing derived from them across steps but the live slots'
keys, values and next-token logits, and the prompts computed for samples still queued, which
`reset_prefix_cache()` drops (they are computed again). `step` enters the engine's `context` each time;
a driver may hold `with engine.context():` around many steps (under autocast the low-precision weight
copies are then made once), but must leave it before the weights change: autocast's copies would be of
the old weights.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gspo.core.logprobs import decoder_and_head
from gspo.core.seeds import stream_key
from gspo.rollout.draws import Row, draw, uniform
from gspo.rollout.kv_cache import SlotCache, cache_kwarg, make_plan, slot_attention
from gspo.rollout.requests import Completion, Event, Request, SamplingParams

CAPACITY_STEP = 128
"""The cache grows in multiples of this many tokens per slot."""

SHARED_START_MIN = 8
"""A prefill computes the start its prompts share (a system prompt, a chat template) once when it is at
least this many tokens long."""


@dataclass
class _Prefix:
    """A computed prompt: row `row` of a prefill's cache, and its next-token logits."""

    cache: SlotCache
    row: int
    logits: Tensor  # (V,) float32


@dataclass
class _Slot:
    sample: Completion
    stream: int
    length: int  # tokens in the cache
    token: int = -1  # the last drawn token, fed at the next decode


class Engine:
    """Continuous batching of `model`'s completions over `slots` cache slots (module docstring).

    model: a transformers causal LM (or a peft model around one). stop_token_ids: tokens that end every
    sample (e.g. the tokenizer's EOS). max_length: the longest prompt + completion (default the model's
    max_position_embeddings). prefill_tokens: the most (padded) prompt tokens one prefill forward takes.
    context: entered around each `step` and each `generate` (e.g. FSDP2's gathered parameters, autocast).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        slots: int = 64,
        stop_token_ids: Sequence[int] = (),
        max_length: int | None = None,
        prefill_tokens: int = 8192,
        context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}: the engine needs at least one slot")
        self.model, self.slots, self.context = model, slots, context
        self.decoder, self.head = decoder_and_head(model)
        self._cache_kwarg = cache_kwarg(self.decoder)
        self.stop_token_ids = frozenset(stop_token_ids)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = config.num_hidden_layers
        self.windows = {None, getattr(config, "sliding_window", None)}  # the attention masks to build
        self.max_length = max_length or getattr(config, "max_position_embeddings", None) or 1 << 20
        self.prefill_tokens = prefill_tokens
        self.computed_tokens = 0
        """Tokens run through the model so far: each distinct prompt once (padding included), one per
        decoded row."""
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # notified by submit: wakes a waiting driver
        self._queue: collections.deque[Completion] = collections.deque()
        self._cancelled: set[int] = set()  # request ids
        self._reset_prefixes = False
        self._ids = itertools.count()
        self._prefixes: dict[tuple[int, ...], _Prefix] = {}  # computed prompts of queued samples
        self._slots: list[_Slot] = []
        self._cache: SlotCache | None = None
        # the live slots' next-token logits: rows 0 .. n - 1 of _logits, of which the last _pending
        # are not drawn from yet; _work holds the draw's probabilities (buffers reused across steps)
        self._logits: Tensor | None = None  # (slots, V) float32
        self._work: Tensor | None = None
        self._pending = 0

    # ---- any thread -----------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> Request:
        """Queue n samples of a prompt; they start at a coming step."""
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one sample")
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.head.out_features
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # in C: a long prompt costs no Python per token
            raise ValueError(f"the prompt has token ids outside the model's vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_length:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens, the model's limit is {self.max_length}"
            )
        seed = _seed(params)
        with self._lock:
            request = Request(next(self._ids), list(prompt_ids), params, seed)
            request.samples = [Completion(request, i) for i in range(n)]
            self._queue.extend(request.samples)
            self._arrived.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request: its queued samples never start, its running ones free their slots at the next step
        (finish_reason "cancelled")."""
        with self._lock:
            self._cancelled.add(request.id)

    def reset_prefix_cache(self) -> None:
        """Forget the computed prompts of queued samples (the weights changed): computed again on admission."""
        with self._lock:
            self._reset_prefixes = True

    @property
    def idle(self) -> bool:
        """Nothing running and nothing queued."""
        with self._lock:
            return not self._slots and not self._queue

    @property
    def load(self) -> tuple[int, int]:
        """(samples running, samples queued)."""
        with self._lock:
            return len(self._slots), len(self._queue)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until there is work (a driver's idle loop); whether there is."""
        with self._lock:
            return self._arrived.wait_for(lambda: bool(self._slots or self._queue), timeout)

    # ---- the driver thread ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[Request]:
        """n samples of each prompt, run until the engine is idle; request j draws with the seed
        stream_key(seed, j), seed = params.seed or one from torch's global generator. Returns the requests
        in the prompts' order."""
        base = _seed(params)
        requests = [
            self.submit(p, n, dataclasses.replace(params, seed=stream_key(base, j)))
            for j, p in enumerate(prompts)
        ]
        with self.context():
            while not self.idle:
                self._step()
        self.release()
        return requests

    def step(self) -> list[Event]:
        """Admit queued samples into free slots, draw one token for every running sample, decode."""
        with self.context():
            return self._step()

    def release(self) -> None:
        """Free the cache's memory when idle (it is allocated again when work comes)."""
        if self.idle:
            self._cache, self._logits, self._work, self._prefixes = None, None, None, {}

    @torch.inference_mode()  # ~10% less dispatch overhead than no_grad; its tensors never leave the engine
    def _step(self) -> list[Event]:
        events: list[Event] = []
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            if self._reset_prefixes:
                self._prefixes, self._reset_prefixes = {}, False
            if cancelled:
                self._drop_queued(cancelled, events)
        if cancelled:
            self._finish_slots(
                [i for i, s in enumerate(self._slots) if s.sample.request.id in cancelled], events
            )
        was_training = self.model.training
        self.model.eval()
        try:
            self._admit()
            self._draw(events)
            # slots freed by this step's draws take queued samples now, so the decode batch stays full
            if self._admit():
                self._draw(events)
            if self._slots:
                self._decode()
        finally:
            self.model.train(was_training)
        return events

    def _drop_queued(self, cancelled: set[int], events: list[Event]) -> None:
        kept = collections.deque()
        for sample in self._queue:
            if sample.request.id in cancelled:
                sample.finish_reason = "cancelled"
                events.append(Event(sample, -1, 0.0, None, "cancelled"))
            else:
                kept.append(sample)
        self._queue = kept
        waiting = {s.request.prompt_key for s in kept}
        self._prefixes = {key: p for key, p in self._prefixes.items() if key in waiting}

    def _admit(self) -> bool:
        """Fill free slots from the queue: compute the newcomers' prompts (each distinct prompt once,
        also across requests), copy their keys, values and next-token logits into their slots (pending,
        after any pending ones)."""
        with self._lock:
            count = min(self.slots - len(self._slots), len(self._queue))
            if count == 0:  # most steps: nothing waits, or no slot is free
                return False
            taken = [self._queue.popleft() for _ in range(count)]
            waiting = {s.request.prompt_key for s in self._queue}
        groups: dict[tuple[int, ...], list[Completion]] = {}
        for sample in taken:
            groups.setdefault(sample.request.prompt_key, []).append(sample)
        self._prefill([key for key in groups if key not in self._prefixes])
        needed = max(len(s.prompt_ids) + s.request.params.max_new_tokens for s in taken)
        self._reserve(min(needed, self.max_length), next(iter(self._prefixes.values())).logits)
        for key, samples in groups.items():
            prefix, start = self._prefixes[key], len(self._slots)
            to = torch.arange(start, start + len(samples))
            self._cache.copy_rows(prefix.cache, torch.full_like(to, prefix.row), to, len(key))
            self._logits[start : start + len(samples)] = prefix.logits
            for sample in samples:
                stream = stream_key(sample.request.seed, sample.index)
                self._slots.append(_Slot(sample, stream, len(key)))
            if key not in waiting:  # no queued sample needs this prompt any more
                del self._prefixes[key]
        self._pending += len(taken)
        return True

    def _reserve(self, capacity: int, like: Tensor) -> None:
        """A cache of at least `capacity` tokens per slot, and the logits buffers (rows like `like`)."""
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        if self._cache is None:
            self._cache = SlotCache(self.num_layers, self.slots, capacity)
        elif capacity > self._cache.capacity:
            self._cache.grow(capacity)
        if self._logits is None:
            self._logits = like.new_empty((self.slots, like.shape[-1]))
            self._work = torch.empty_like(self._logits)

    def _prefill(self, prompts: list[tuple[int, ...]]) -> None:
        """Each prompt through the model once, right-padded batches of up to prefill_tokens."""
        batch: list[tuple[int, ...]] = []
        for prompt in sorted(prompts, key=len):  # widest last
            if batch and (len(batch) + 1) * len(prompt) > self.prefill_tokens:
                self._prefill_batch(batch)
                batch = []
            batch.append(prompt)
        if batch:
            self._prefill_batch(batch)

    def _prefill_batch(self, prompts: list[tuple[int, ...]]) -> None:
        """The prompts' keys, values and next-token logits; the start they share (`shared_start`) is
        computed once, in a row of its own, and copied into each prompt's row before the rest."""
        width, first = max(len(p) for p in prompts), shared_start(prompts)
        cache = SlotCache(self.num_layers, len(prompts), width)
        if first:
            start = SlotCache(self.num_layers, 1, first)
            one = torch.ones(1, dtype=torch.long)
            self._forward(start, torch.tensor([prompts[0][:first]]), 0 * one, first * one, first)
            rows = torch.arange(len(prompts))
            cache.copy_rows(start, torch.zeros_like(rows), rows, first)
        ids = torch.zeros((len(prompts), width - first), dtype=torch.long)  # right-padded: never seen
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt) - first] = torch.tensor(prompt[first:])
        lengths = torch.tensor([len(p) - first for p in prompts])
        hidden = self._forward(cache, ids, torch.full_like(lengths, first), lengths, width)  # (P, q, H)
        last = hidden[torch.arange(len(prompts), device=hidden.device), lengths.to(hidden.device) - 1]
        logits = self._head(last, last.new_empty((len(prompts), self.head.out_features), dtype=torch.float32))
        for row, prompt in enumerate(prompts):
            self._prefixes[prompt] = _Prefix(cache, row, logits[row])
        self.computed_tokens += first + ids.numel()

    def _decode(self) -> None:
        """Every live slot's last token through the model: its keys and values written, next logits."""
        n = len(self._slots)
        tokens = torch.tensor([[s.token] for s in self._slots])
        starts = torch.tensor([s.length for s in self._slots])
        width = max(s.length for s in self._slots) + 1
        hidden = self._forward(self._cache, tokens, starts, torch.ones_like(starts), width)
        self._head(hidden[:, 0], self._logits[:n])
        self._pending = n
        for slot in self._slots:
            slot.length += 1
        self.computed_tokens += n

    def _forward(self, cache: SlotCache, ids: Tensor, starts: Tensor, lengths: Tensor, width: int) -> Tensor:
        """(n, q, H) final hidden states of each row's new tokens `ids` (n, q), which the cache takes
        at starts[r] .. (the first lengths[r] real, the rest padding); width: max(starts + lengths),
        known on the host."""
        device = self.head.weight.device
        first = int(starts[0]) if ids.shape[1] > 1 else 0  # a prefill's rows start together (on the host)
        ids, starts, lengths = ids.to(device), starts.to(device), lengths.to(device)
        positions = starts[:, None] + torch.arange(ids.shape[1], device=device)
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else self.head.weight.dtype
        cache.plan = plan = make_plan(starts, lengths, ids.shape[1], width, self.windows, dtype)
        plan.first = first
        with slot_attention(self.decoder):
            out = self.decoder(
                input_ids=ids,
                position_ids=positions,
                use_cache=True,
                gspo_plan=plan,
                **{self._cache_kwarg: cache},
            )
        cache.plan = None
        if plan.calls == 0:
            raise RuntimeError(
                f"{type(self.decoder).__name__} did not run its attention through transformers' "
                "AttentionInterface: the sampling engine cannot drive it"
            )
        return out.last_hidden_state

    def _head(self, hidden: Tensor, out: Tensor) -> Tensor:
        """(n, V) float32 logits of (n, H) hidden states, written into `out`: one mm into the buffer,
        or, under autocast or with hooks on the head (e.g. a benchmark barring tokens), the module."""
        head = self.head
        hooked = head._forward_hooks or head._forward_pre_hooks
        plain = hidden.dtype == head.weight.dtype == out.dtype and not hooked
        if plain and not torch.is_autocast_enabled(hidden.device.type):
            if head.bias is None:
                return torch.mm(hidden, head.weight.T, out=out)
            return torch.addmm(head.bias, hidden, head.weight.T, out=out)
        return out.copy_(head(hidden))

    def _draw(self, events: list[Event]) -> None:
        """Draw the next token of the slots with pending logits (the last ones); record it; free the
        slots whose samples ended."""
        if self._pending == 0:
            return
        first = len(self._slots) - self._pending
        slots = self._slots[first:]
        rows = []
        for slot in slots:
            params = slot.sample.request.params
            u = uniform(slot.stream, len(slot.sample.token_ids))
            rows.append(Row(u, params.temperature, params.top_p, params.greedy))
        top_k = max(s.sample.request.params.top_logprobs for s in slots)
        draws = draw(self._logits[first : len(self._slots)], rows, top_k=top_k, work=self._work)
        self._pending = 0
        tokens, logprobs = draws.tokens.tolist(), draws.logprobs.tolist()  # the step's one host sync
        tops = [None] * len(slots)
        if top_k > 0:
            tops = list(zip(draws.top_ids.tolist(), draws.top_logprobs.tolist(), strict=True))
        finished = [
            first + i
            for i, slot in enumerate(slots)
            if self._record(slot, tokens[i], logprobs[i], tops[i], events)
        ]
        self._finish_slots(finished, events)

    def _record(
        self,
        slot: _Slot,
        token: int,
        logprob: float,
        top: tuple[list[int], list[float]] | None,
        events: list[Event],
    ) -> bool:
        """Append a drawn token to its sample; whether the sample ended."""
        sample, params = slot.sample, slot.sample.request.params
        sample.token_ids.append(token)
        sample.logprobs.append(logprob)
        best = None
        if params.top_logprobs > 0:
            best = list(zip(top[0][: params.top_logprobs], top[1][: params.top_logprobs], strict=True))
            sample.top_logprobs.append(best)
        slot.token = token
        if token in self.stop_token_ids or token in params.stop_token_ids:
            sample.finish_reason = "stop"
        elif len(sample.token_ids) >= params.max_new_tokens or slot.length + 1 >= self.max_length:
            sample.finish_reason = "length"
        events.append(Event(sample, token, logprob, best, sample.finish_reason))
        return sample.finish_reason is not None

    def _finish_slots(self, finished: list[int], events: list[Event]) -> None:
        """Free the slots `finished` (indices into the live slots); the last live slots move into the
        holes (keys, values and pending logits), so the live ones stay 0 .. n - 1."""
        if not finished:
            return
        assert self._pending in (0, len(self._slots)), "pending logits are those of the last slots"
        for i in finished:
            sample = self._slots[i].sample
            if sample.finish_reason is None:  # cancelled while running
                sample.finish_reason = "cancelled"
                events.append(Event(sample, -1, 0.0, None, "cancelled"))
        gone = set(finished)
        kept = len(self._slots) - len(gone)
        holes = [i for i in range(kept) if i in gone]
        movers = [i for i in range(kept, len(self._slots)) if i not in gone]
        order = list(range(kept))
        for hole, mover in zip(holes, movers, strict=True):
            self._cache.move(mover, hole, self._slots[mover].length)
            if self._pending:
                self._logits[hole] = self._logits[mover]
            order[hole] = mover
        self._slots = [self._slots[i] for i in order]
        self._pending = min(self._pending, kept)


def shared_start(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the start all `prompts` share, when there are several and it is at least
    SHARED_START_MIN tokens (else 0); each prompt keeps at least one token of its own, whose logits are its
    first draw's."""
    if len(prompts) < 2:
        return 0
    first, last = min(prompts), max(prompts)  # the common start of all is that of the extreme two
    longest, n = min(len(p) for p in prompts) - 1, 0
    while n < longest and first[n] == last[n]:
        n += 1
    return n if n >= SHARED_START_MIN else 0


def _seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh one from torch's global generator (so a seeded run draws the same)."""
    return params.seed if params.seed is not None else int(torch.randint(1 << 62, ()).item())
