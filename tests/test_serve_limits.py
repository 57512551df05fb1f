"""gspo serve under requests meant to sink it (bodies past serve.max_body_bytes, prompts too long to
tokenise) and under the mixed load that once stalled its streams; the real server (uvicorn on 127.0.0.1) on
the tiny model, which keeps serving after each."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import tiny_config
from gspo.serve import app
from gspo.serve.server import build_service, start_in_thread

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
LIMIT = 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    run = tmp_path_factory.mktemp("limits") / "run"
    config = tiny_config(run, f"serve.max_body_bytes={LIMIT}", "serve.max_waiting=4")
    running = start_in_thread(build_service(config))
    yield running
    running.stop()


def _answers(server) -> bool:
    body = {"model": "gspo", "messages": QUESTION, "max_tokens": 2}
    return httpx.post(server.url + "/chat/completions", json=body, timeout=60).status_code == 200


def _chat_body(chars: int) -> bytes:
    return json.dumps({"model": "gspo", "messages": [{"role": "user", "content": "7" * chars}]}).encode()


def test_a_body_past_the_limit_is_refused_413_as_it_arrives_and_the_server_serves_on(server) -> None:
    # declared: refused from its Content-Length, before a byte of it is read
    response = httpx.post(
        server.url + "/chat/completions",
        content=_chat_body(3_000_000),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["param"] == "body" and error["code"] == "body_too_large"
    assert f"serve.max_body_bytes={LIMIT}" in error["message"] and "\n" not in error["message"]
    assert _answers(server)
    # chunked (no Content-Length): refused once the bytes read pass the limit, while the body still comes
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gspo\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(2):  # 128 KiB sent, the body not ended: the answer must not wait for its end
            sock.sendall(b"10000\r\n" + b"7" * 65536 + b"\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:100]

    def chunks() -> Iterator[bytes]:  # the client sends it all: uvicorn reads and drops the rest
        yield b'{"model": "gspo", "messages": [{"role": "user", "content": "'
        yield from (b"7" * 65536 for _ in range(48))
        yield b'"}]}'

    response = httpx.post(server.url + "/chat/completions", content=chunks(), timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert _answers(server)
    # at the limit: read and parsed (here: refused for its length, not its size)
    at_limit = _chat_body(LIMIT - 100)
    response = httpx.post(
        server.url + "/chat/completions", content=at_limit, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def _partial_body(server, head: bytes, sent: bytes) -> tuple[bytes, float]:
    """(what the server answered until it closed the connection, how long that took) to a request whose
    body stops after ``sent``."""
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        start = time.monotonic()
        sock.sendall(head + sent)
        reply = b""
        while chunk := sock.recv(4096):  # until the server closes it (a timeout here fails the test)
            reply += chunk
        return reply, time.monotonic() - start


def test_a_client_that_stops_sending_its_body_is_answered_408_and_let_go(server, monkeypatch) -> None:
    """A client that sent 50 bytes of a 100-byte body, then nothing, kept its connection (and a task of the
    server) open as long as it liked: past 5 s before the bound, 20 s here. Bounds shortened for the test."""
    monkeypatch.setattr(app, "BODY_PAUSE_SECONDS", 0.5)
    monkeypatch.setattr(app, "BODY_SECONDS", 2.0)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gspo\r\nContent-Type: application/json\r\n"
    reply, seconds = _partial_body(server, head + b"Content-Length: 100\r\n\r\n", b"{" * 50)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:100]
    assert b'"code":"request_timeout"' in reply and seconds < 5, (reply[-300:], seconds)
    # a trickle: a byte of a chunked body every 0.3 s never pauses 0.5 s, and is cut at 2 s
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        start = time.monotonic()
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        reply = b""
        while not reply and time.monotonic() - start < 10:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b"1\r\n{\r\n")
            sock.settimeout(0.3)
            with contextlib.suppress(TimeoutError):
                reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408 ") and 1.5 < time.monotonic() - start < 5, reply[:100]
    assert _answers(server)


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenised(server, monkeypatch) -> None:
    """512 tokens of at most 12 characters each (the tiny vocabulary's longest piece): 6144 characters at
    most. A longer text is refused without tokenising it (tokenising takes ~400 bytes per character)."""
    inference = server.service.inference
    assert inference.context == 512 and inference.max_prompt_chars == 512 * 12
    tokenizer = type(inference.tokenizer)
    longest: list[int] = []
    real = tokenizer.__call__

    def spy(self, text, *args, **kwargs):
        longest.append(len(text) if isinstance(text, str) else 0)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "__call__", spy)
    text = "7" * 6200
    for path, body, field in (
        ("/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
        ("/completions", {"prompt": ["hi", text]}, "prompt"),
    ):
        response = httpx.post(server.url + path, json={"model": "gspo", "max_tokens": 2} | body, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "context_length_exceeded", error
        assert error["param"] == field and "at most 6144" in error["message"], error
    assert max(longest, default=0) < 6200, "the long prompt was tokenised"
    monkeypatch.undo()
    # under the bound the prompt is tokenised and refused by its token count, as before
    response = httpx.post(
        server.url + "/completions", json={"model": "gspo", "prompt": "7" * 6000, "max_tokens": 2}
    )
    assert response.status_code == 400 and "the prompt is 6000 tokens" in response.json()["error"]["message"]
    assert _answers(server)


def test_streams_mixed_with_non_streamed_n_gt_1_requests_all_run_to_their_end(tmp_path) -> None:
    """8 non-streamed requests with n=3 and 4 streams with n=2 queue together on 4 slots and wait past
    the server's disconnect-check interval (0.5 s) before their first token, as under load. Every stream
    gets every token and its end (streams once got their first chunk, then nothing until the timeout)."""
    running = start_in_thread(
        build_service(tiny_config(tmp_path / "run", "serve.slots=4", "serve.request_timeout=20"))
    )
    driver = running.service.inference.driver
    tokenizer = running.service.inference.tokenizer

    async def plain(client: httpx.AsyncClient, seed: int) -> dict:
        body = {"model": "gspo", "messages": QUESTION, "n": 3, "max_tokens": 6, "seed": seed}
        response = await client.post("/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def stream(client: httpx.AsyncClient, seed: int) -> list[dict]:
        body = {"model": "gspo", "messages": QUESTION, "n": 2, "max_tokens": 6, "seed": seed, "stream": True}
        chunks = []
        async with client.stream("POST", "/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line.removeprefix("data: "))
        assert chunks[-1] == "[DONE]", chunks[-2:]
        return [json.loads(c) for c in chunks[:-1]]

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            await driver.pause(10.0)
            calls = [asyncio.ensure_future(plain(client, i)) for i in range(8)]
            calls += [asyncio.ensure_future(stream(client, 100 + i)) for i in range(4)]
            while driver.status()["waiting_samples"] < 8 * 3 + 4 * 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.6)  # past DISCONNECT_CHECK, as a busy server's queue
            driver.resume()
            done = await asyncio.wait_for(asyncio.gather(*calls), 25)
            return done[:8], done[8:]

    try:
        plains, streams = asyncio.run(run())
        assert all(len(r["choices"]) == 3 for r in plains)
        for chunks in streams:
            for index in (0, 1):
                parts = [c for chunk in chunks for c in chunk.get("choices", []) if c["index"] == index]
                ids = [t for p in parts for t in p.get("token_ids") or []]
                text = "".join(p["delta"].get("content") or "" for p in parts)
                assert 1 <= len(ids) <= 6 and parts[-1]["finish_reason"] in ("stop", "length"), parts
                shown = ids[:-1] if parts[-1]["finish_reason"] == "stop" else ids
                assert text == tokenizer.decode(shown, skip_special_tokens=True)
        assert driver.status()["running_samples"] == driver.status()["waiting_samples"] == 0
    finally:
        driver.resume()
        running.stop()


def test_a_full_queue_says_what_is_full_and_a_request_that_can_never_queue_is_a_400(server) -> None:
    """serve.max_waiting=4. A 429 said "1024 samples are waiting" when no other request waited: the
    request's own prompts were counted, and a request larger than the queue was told to try again."""
    driver = server.service.inference.driver
    chat = {"model": "gspo", "messages": QUESTION, "max_tokens": 2}

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await driver.pause(10.0)
            try:
                held = asyncio.ensure_future(client.post("/chat/completions", json=chat | {"n": 3}))
                while driver.status()["waiting_samples"] < 3:
                    await asyncio.sleep(0.01)
                busy = await client.post("/chat/completions", json=chat | {"n": 2})
            finally:
                driver.resume()
            return busy, await held

    busy, held = asyncio.run(run())
    assert held.status_code == 200 and busy.status_code == 429
    assert busy.json()["error"]["message"] == (
        "the server is busy: 3 samples are waiting for a slot and this request adds 2, beyond "
        "serve.max_waiting=4; try again later"
    )
    for path, body, field in (
        ("/chat/completions", chat | {"n": 5}, "n"),
        ("/completions", {"model": "gspo", "prompt": ["1", "2", "3"], "n": 2, "max_tokens": 2}, "prompt"),
    ):
        response = httpx.post(server.url + path, json=body, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field, error
        assert "more than serve.max_waiting=4 may wait at once" in error["message"]
    assert driver.status()["waiting_samples"] == 0 and _answers(server)
