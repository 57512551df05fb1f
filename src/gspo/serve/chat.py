"""Chat requests as token ids: the chat template, with the server's own sampled tokens spliced back in.

A conversation's earlier assistant messages that this server generated are rendered with the token ids it
sampled (found by the message's ``completion_id``, or by its prompt tokens and text), not by re-tokenising
their text, so the prompt of turn k+1 starts with turn k's prompt and completion tokens verbatim
(gspo.rollout.trajectories.render_turns locates each turn; the template's end-of-turn token stays context
where the sample was cut off). An assistant message no record matches (edited, from elsewhere, expired) is
rendered from its text and reported in `ChatPrompt.unmatched`; where the template does not render a
conversation's start the same once later turns follow (not prefix-stable), the whole prompt is the
template's rendering and every earlier assistant message is unmatched. Tool calls use the Hermes format
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, Qwen2.5/Qwen3/Hermes templates): the request's
tools go into the template, and a completion's tool-call blocks come back as ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gspo.rollout.samplers import tokenize_prompts
from gspo.rollout.trajectories import TrajectoryError, end_of_turn_as_context, render_turns
from gspo.serve.protocol import Message, ServeError
from gspo.serve.records import Record, RecordStore

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class ChatPrompt:
    """A chat request's prompt: token ids, and which assistant messages were spliced from records."""

    ids: list[int]
    spliced: list[int]
    """Indices (into the messages) of assistant messages rendered with their recorded tokens."""
    unmatched: list[int]
    """Indices of assistant messages no record matched: rendered by the template from their text."""


def message_text(message: Message, where: str) -> str:
    """A message's content as one string (text parts joined; anything but text is refused)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ServeError(
                400, f"{where}.content[{j}]: only text parts are supported", param=f"{where}.content"
            )
        texts.append(part["text"])
    return "".join(texts)


def _arguments(value: str | dict[str, Any]) -> Any:
    """Tool-call arguments as the templates want them: a mapping (OpenAI sends a JSON string)."""
    if isinstance(value, dict):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them (gspo's own keys removed)."""
    out = []
    for i, message in enumerate(messages):
        data = message.model_dump(exclude_none=True, exclude={"completion_id"})
        data["role"] = "system" if message.role == "developer" else message.role
        data["content"] = message_text(message, f"messages[{i}]")
        if message.tool_calls:
            data["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                | ({"id": c.id} if c.id else {})
                for c in message.tool_calls
            ]
        out.append(data)
    return out


def turn_key(content: str, tool_calls: list[dict[str, Any]] | None) -> str:
    """What an assistant message says, as one string: its text and its tool calls (name, arguments)."""
    if not tool_calls:
        return content
    calls = [(c["function"]["name"], _arguments(c["function"]["arguments"])) for c in tool_calls]
    return content + "\x00" + json.dumps(calls, sort_keys=True)


def render_chat(
    tokenizer: Any,
    messages: list[Message],
    tools: list[dict[str, Any]] | None,
    records: RecordStore,
    *,
    check_text: Callable[[str], None] | None = None,
) -> ChatPrompt:
    """The prompt ids of a chat request (module docstring), ending with the generation prompt.
    `check_text` sees the conversation's text before anything is tokenised (and may refuse it)."""
    rendered = template_messages(messages)
    assistant = [k for k, m in enumerate(messages) if m.role == "assistant"]
    end_ids = {tokenizer.eos_token_id}
    spliced: list[int] = []
    unmatched: list[int] = []

    def splice(
        a: int, prefix: list[int], generated: list[int], glue: list[int]
    ) -> tuple[list[int], list[int]] | None:
        k = assistant[a]
        record = _record_of(messages[k], rendered[k], prefix, records)
        if record is None:
            unmatched.append(k)
            return None
        spliced.append(k)
        sampled = list(record.completion_ids)
        return sampled, end_of_turn_as_context(sampled, generated, glue, end_ids)[1]

    try:
        try:
            rendering = render_turns(
                tokenizer, rendered, tools, generation_prompt=True, splice=splice, check_text=check_text
            )
        except TrajectoryError:
            # the template (or tokenizer) renders earlier turns differently once later ones follow: the
            # prompt is the template's rendering, and no earlier turn can be the tokens that were sampled
            text = tokenizer.apply_chat_template(
                rendered, tools=tools, tokenize=False, add_generation_prompt=True
            )
            return ChatPrompt(tokenize_prompts(tokenizer, [text])[0], [], assistant)
    except ServeError:
        raise
    except Exception as error:  # the template itself raised (a role or key it does not accept)
        message = " ".join(str(error).split())[:300]
        raise ServeError(
            400, f"messages: the chat template cannot render them: {message}", param="messages"
        ) from None
    return ChatPrompt(rendering.ids, spliced, unmatched)


def _record_of(
    message: Message, rendered: dict[str, Any], prefix: list[int], records: RecordStore
) -> Record | None:
    """The record an assistant message is: the one its completion_id names, or else the newest that
    continued this prompt with this text; either must have continued exactly this prompt and said exactly
    this (an edited message, or one from another conversation, is rendered from its text)."""
    key = turn_key(rendered["content"], rendered.get("tool_calls"))
    if message.completion_id is None:
        return records.match(prefix, key)
    record = records.get(message.completion_id)
    if record is None or record.content != key or list(record.prompt_ids) != prefix:
        return None
    return record


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content without the tool-call blocks, OpenAI tool_calls) of a completion's text; a block that is
    not JSON with a "name" stays in the content."""
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(
            {
                "id": "call_" + secrets.token_hex(8),
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def template_supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template if isinstance(template, str) else True
