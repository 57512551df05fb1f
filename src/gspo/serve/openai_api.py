"""POST /v1/chat/completions and /v1/completions: OpenAI's request and response shapes, plus gspo's fields.

Every choice carries ``completion_id`` (the record a train call names; also in the chat message, so an agent
that appends the message object sends it back), ``token_ids`` and ``token_logprobs`` (the completion's exact
ids and the sampler's log-probs, its stop token included) and ``policy_version``; the response carries
``prompt_token_ids`` (vLLM's name) and, for chat, ``spliced_messages`` / ``unmatched_messages`` (which
earlier assistant messages were rendered from recorded tokens, and which from their text). With
``stream: true`` the chunks are server-sent events, each with the new ``token_ids``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from gspo.config import ServeConfig
from gspo.core.seeds import stream_key
from gspo.rollout.requests import SamplingParams
from gspo.sampling.driver import Busy, Driver, EngineFailure, Handle
from gspo.serve.chat import ChatPrompt, render_chat, template_supports_tools
from gspo.serve.generation import Choice, Decoder, collect, follow, store
from gspo.serve.protocol import ChatRequest, CompletionRequest, SamplingFields, ServeError
from gspo.serve.records import RecordStore, new_completion_id


@dataclass
class Inference:
    """What the inference endpoints use: the tokenizer, the engine's driver, the records, the limits."""

    tokenizer: Any
    driver: Driver
    records: RecordStore
    serve: ServeConfig
    context: int
    """The longest prompt + completion the model takes (its max_position_embeddings)."""
    stop_ids: frozenset[int]
    vocab_size: int
    max_prompt_chars: int
    """The longest prompt text that can fit the context window (`prompt_char_limit`): a longer one is
    refused before it is tokenised, whose memory grows with the text (~400 bytes per character)."""


def prompt_char_limit(tokenizer: Any, context: int) -> int:
    """The most characters a prompt of `context` tokens can spell: `context` times the vocabulary's longest
    piece. A piece is at least as long as the text it stands for (byte-level pieces: one character per byte;
    byte-fallback and word-piece markers: longer), special tokens included since a text may spell one;
    this holds for every tokenizer whose normaliser does not drop characters (not BERT's accent stripping)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return context * max((len(p) for p in pieces if isinstance(p, str)), default=1)


def check_prompt_chars(inference: Inference, chars: int, field: str) -> None:
    """Refuse a prompt text too long for the context window whatever its tokens, before tokenising it."""
    if chars > inference.max_prompt_chars:
        raise ServeError(
            400,
            f"{field}: the prompt is {chars} characters; the model's context window of {inference.context} "
            f"tokens spells at most {inference.max_prompt_chars} (its longest token times the window); "
            f"shorten {field}",
            param=field,
            code="context_length_exceeded",
        )


@dataclass
class Prepared:
    """A request's prompts and sampling settings, checked against the limits."""

    prompts: list[list[int]]
    n: int
    params: list[SamplingParams]
    """The engine's parameters of each prompt: temperature 0 is greedy; with a seed, prompt j draws from
    streams (seed, j, sample), so a request's samples repeat exactly."""
    stop: list[str]
    stream: bool


def prepare(
    inference: Inference,
    body: SamplingFields,
    prompts: list[list[int]],
    *,
    requested: int | None,
    top: int,
    field: str,
) -> Prepared:
    """Check a request's model, n, stop strings and lengths (each error names its field)."""
    serve = inference.serve
    if body.model != serve.model_name:
        raise ServeError(
            404,
            f"model {body.model!r} is not served here: use {serve.model_name!r}",
            param="model",
            code="model_not_found",
        )
    if body.n > serve.max_n:
        raise ServeError(400, f"n={body.n} exceeds serve.max_n={serve.max_n}", param="n")
    if len(prompts) * body.n > serve.max_waiting:  # could never be queued: a 429 would be retried forever
        raise ServeError(
            400,
            f"{len(prompts)} prompts x n={body.n} = {len(prompts) * body.n} samples, more than "
            f"serve.max_waiting={serve.max_waiting} may wait at once: send fewer prompts or a smaller n",
            param="n" if len(prompts) == 1 else field,
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 16 or any(not s for s in stop):
        raise ServeError(400, "stop: give at most 16 non-empty strings", param="stop")
    if requested is not None and requested > serve.max_tokens:
        raise ServeError(
            400, f"max_tokens={requested} exceeds serve.max_tokens={serve.max_tokens}", param="max_tokens"
        )
    longest = max(len(p) for p in prompts)
    room = inference.context - longest
    max_tokens = requested if requested is not None else min(serve.max_tokens, room)
    if longest == 0:
        raise ServeError(400, f"{field}: the prompt is empty", param=field)
    if longest + max_tokens > inference.context:
        raise ServeError(
            400,
            f"the prompt is {longest} tokens and max_tokens is {max_tokens}: {longest + max_tokens} exceeds the "
            f"model's context window of {inference.context} tokens; shorten {field} or lower max_tokens",
            param=field if room < 1 else "max_tokens",
            code="context_length_exceeded",
        )
    temperature = 1.0 if body.temperature is None else body.temperature
    params = [
        SamplingParams(
            max_tokens,
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if body.top_p is None else body.top_p,
            greedy=temperature == 0,
            seed=None if body.seed is None else stream_key(body.seed, j),
            top_logprobs=top,
        )
        for j in range(len(prompts))
    ]
    return Prepared(prompts, body.n, params, stop, body.stream)


def submit(inference: Inference, prepared: Prepared) -> list[Handle]:
    """Queue the request's samples; a whole answer with no stop string gets its tokens at the end."""
    at_end = not (prepared.stream or prepared.stop)
    try:
        return inference.driver.submit(
            list(zip(prepared.prompts, prepared.params, strict=True)), prepared.n, at_end=at_end
        )
    except Busy as error:
        raise ServeError(429, f"the server is busy: {error}; try again later", code="busy") from None
    except EngineFailure as error:
        raise ServeError(503, str(error), code="engine_error") from None


async def _whole(inference: Inference, prepared: Prepared, handle: Handle, request: Request) -> list[Choice]:
    """All of a prompt's choices, run to their end (stop strings, limits); [] if the client left."""
    decoder = Decoder(inference.tokenizer, prepared.stop, inference.stop_ids)
    timeout = inference.serve.request_timeout
    return await collect(
        inference.driver, handle, decoder, timeout=timeout, disconnected=request.is_disconnected
    )


def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _piece(tokenizer: Any, token: int) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, choice: Choice, start: int, end: int) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for tokens start .. end of a choice."""
    content = []
    for t in range(start, end):
        entry = _piece(tokenizer, choice.tokens[t]) | {"logprob": choice.logprobs[t]}
        tops = choice.tops[t] if t < len(choice.tops) else []
        entry["top_logprobs"] = [_piece(tokenizer, i) | {"logprob": lp} for i, lp in tops]
        content.append(entry)
    return {"content": content, "refusal": None}


def _gspo_fields(choice: Choice) -> dict[str, Any]:
    return {
        "completion_id": choice.completion_id,
        "token_ids": choice.tokens,
        "token_logprobs": choice.logprobs,
        "policy_version": min(choice.versions, default=None),
        "policy_versions": [min(choice.versions, default=0), max(choice.versions, default=0)],
    }


async def chat_completions(inference: Inference, body: ChatRequest, request: Request) -> Any:
    tokenizer = inference.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ServeError(
            400, "this model has no chat template: use /v1/completions with a text prompt", param="messages"
        )
    tools = body.tools if body.tool_choice != "none" else None
    if tools and not template_supports_tools(tokenizer):
        raise ServeError(
            400,
            "tools: this model's chat template has no tool support; describe the tools in a system message",
            param="tools",
        )
    chat = render_chat(
        tokenizer,
        body.messages,
        tools,
        inference.records,
        check_text=lambda text: check_prompt_chars(inference, len(text), "messages"),
    )
    top = (body.top_logprobs or 0) if body.logprobs else 0
    requested = body.max_completion_tokens or body.max_tokens
    prepared = prepare(inference, body, [chat.ids], requested=requested, top=top, field="messages")
    (handle,) = submit(inference, prepared)
    response_id = "chatcmpl-" + new_completion_id().removeprefix("gspo-")
    if body.stream:
        decoder = Decoder(tokenizer, prepared.stop, inference.stop_ids)
        call = ChatCall(inference, body, prepared, chat, handle, decoder, response_id, bool(tools), request)
        events = _chat_stream(call)
        return StreamingResponse(events, media_type="text/event-stream")
    choices = await _whole(inference, prepared, handle, request)
    out = []
    for choice in choices:
        content, calls = store(inference.records, handle, choice, tools=bool(tools))
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        message["completion_id"] = choice.completion_id
        entry = {"index": choice.index, "message": message, "finish_reason": choice.finish_reason}
        entry["logprobs"] = chat_logprobs(tokenizer, choice, 0, len(choice.tokens)) if body.logprobs else None
        out.append(entry | _gspo_fields(choice))
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": inference.serve.model_name,
            "choices": out,
            "usage": _usage(prepared.prompts, choices),
            "prompt_token_ids": chat.ids,
            "spliced_messages": chat.spliced,
            "unmatched_messages": chat.unmatched,
        }
    )


@dataclass
class ChatCall:
    """One streamed chat request under way: its body, prompt and settings, its engine handle, its text."""

    inference: Inference
    body: ChatRequest
    prepared: Prepared
    chat: ChatPrompt
    handle: Handle
    decoder: Decoder
    response_id: str
    tools: bool
    request: Request


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _chat_stream(call: ChatCall) -> AsyncIterator[str]:
    """The chunks of a streamed chat completion (tool calls: the text is held back and sent at the end,
    parsed). A client that disconnects cancels the request: Starlette cancels this generator, and `follow`
    checks too (asyncio.wait_for may swallow a cancellation that meets a token: tokens that kept coming
    faster than a loaded event loop took them ran a stream to its end after its client had gone)."""
    head = {
        "id": call.response_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": call.inference.serve.model_name,
    }
    choices = [Choice(i) for i in range(call.handle.n)]
    first = [
        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "completion_id": c.completion_id}
        for c in choices
    ]
    chat = call.chat
    yield _sse(
        head
        | {"choices": first, "prompt_token_ids": chat.ids}
        | {"spliced_messages": chat.spliced, "unmatched_messages": chat.unmatched}
    )
    steps = follow(
        call.inference.driver,
        call.handle,
        choices,
        call.decoder,
        timeout=call.inference.serve.request_timeout,
        disconnected=call.request.is_disconnected,
    )
    try:
        async with contextlib.aclosing(steps):
            async for _ in steps:
                parts = [part for c in choices if (part := _stream_part(call, c)) is not None]
                if parts:
                    yield _sse(head | {"choices": parts})
    except ServeError as error:
        yield _sse(error.body())
        return
    options = call.body.stream_options
    if options is not None and options.include_usage:
        yield _sse(head | {"choices": [], "usage": _usage(call.prepared.prompts, choices)})
    yield "data: [DONE]\n\n"


def _stream_part(call: ChatCall, choice: Choice) -> dict[str, Any] | None:
    """One choice's part of a chunk: the text and tokens not sent yet; at its end, its record's fields."""
    mark, choice.sent_tokens = choice.sent_tokens, len(choice.tokens)
    if choice.reported or (mark == len(choice.tokens) and not choice.done):
        return None
    delta: dict[str, Any] = {}
    if not call.tools:
        delta["content"] = call.decoder.delta(choice)
    part: dict[str, Any] = {"index": choice.index, "delta": delta, "finish_reason": None}
    part["token_ids"] = choice.tokens[mark:]
    if call.body.logprobs:
        part["logprobs"] = chat_logprobs(call.inference.tokenizer, choice, mark, len(choice.tokens))
    if choice.done:
        content, calls = store(call.inference.records, call.handle, choice, tools=call.tools)
        if call.tools:
            delta["content"] = content or None
            if calls:
                delta["tool_calls"] = [c | {"index": i} for i, c in enumerate(calls)]
        part["finish_reason"] = choice.finish_reason
        part |= {k: v for k, v in _gspo_fields(choice).items() if k != "token_ids"}
        choice.reported = True  # its final part is out: nothing more for it
    return part


def completion_prompts(
    inference: Inference, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    """/v1/completions' prompt(s) as token ids: text tokenised as `gspo train` tokenises prompts, ids as given."""
    from gspo.rollout.samplers import tokenize_prompts

    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        prompt = [prompt]  # type: ignore[list-item]
    if not prompt:
        raise ServeError(
            400, "prompt: give a text, a list of texts, token ids or lists of token ids", param="prompt"
        )
    out = []
    for j, p in enumerate(prompt):
        if isinstance(p, str):
            check_prompt_chars(inference, len(p), "prompt")
        ids = tokenize_prompts(inference.tokenizer, [p])[0] if isinstance(p, str) else list(p)
        bad = [t for t in ids if not 0 <= t < inference.vocab_size]
        if bad:
            raise ServeError(
                400,
                f"prompt[{j}]: token id {bad[0]} is outside the vocabulary (0 .. {inference.vocab_size - 1})",
                param="prompt",
            )
        out.append(ids)
    return out


def text_logprobs(tokenizer: Any, choice: Choice) -> dict[str, Any]:
    """The legacy completions `logprobs` object."""
    pieces = [tokenizer.decode([t]) for t in choice.tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    tops = [{tokenizer.decode([i]): lp for i, lp in top} for top in choice.tops] or None
    return {"tokens": pieces, "token_logprobs": choice.logprobs, "top_logprobs": tops, "text_offset": offsets}


async def completions(inference: Inference, body: CompletionRequest, request: Request) -> Any:
    if body.stream:
        raise ServeError(
            400,
            "stream: streaming is supported on /v1/chat/completions; set stream=false here",
            param="stream",
        )
    if body.best_of not in (None, body.n):
        raise ServeError(400, "best_of: only best_of == n (or unset) is supported", param="best_of")
    prompts = completion_prompts(inference, body.prompt)
    prepared = prepare(
        inference, body, prompts, requested=body.max_tokens, top=body.logprobs or 0, field="prompt"
    )
    handles = submit(inference, prepared)
    out, finished = [], []
    for j, handle in enumerate(handles):
        choices = await _whole(inference, prepared, handle, request)
        for choice in choices:
            text, _ = store(inference.records, handle, choice, tools=False)
            entry = {
                "index": j * prepared.n + choice.index,
                "text": text,
                "finish_reason": choice.finish_reason,
            }
            entry["logprobs"] = (
                text_logprobs(inference.tokenizer, choice) if body.logprobs is not None else None
            )
            out.append(entry | _gspo_fields(choice) | {"prompt_token_ids": prompts[j]})
        finished.extend(choices)
    return JSONResponse(
        {
            "id": "cmpl-" + new_completion_id().removeprefix("gspo-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": inference.serve.model_name,
            "choices": out,
            "usage": _usage(prompts, finished),
        }
    )
