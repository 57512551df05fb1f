"""The OpenAI-compatible rollout backend: a scripted stub server (retries, timeouts, alignment errors) and a
real llama-cpp-python server on the SmolLM2 GGUF file (skipped, with the reason, when it cannot run)."""

from __future__ import annotations

import contextlib
import json
import math
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from gspo.models import tiny_tokenizer
from gspo.rollout.data import format_prompt
from gspo.rollout.llama_cpp import llama_cpp_server
from gspo.rollout.openai import AlignmentError, OpenAIBackend, ServerError
from gspo.rollout.trajectories import groups_from_rollouts, tokenize_trajectory

Reply = tuple[int, dict[str, Any]]


@pytest.fixture
def stub() -> Iterator[tuple[str, list[dict[str, Any]], list[Callable[[dict[str, Any]], Reply]]]]:
    """A local HTTP server answering POSTs with the scripted replies, in order (the last one repeats)."""
    requests: list[dict[str, Any]] = []
    replies: list[Callable[[dict[str, Any]], Reply]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            status, payload = (replies.pop(0) if len(replies) > 1 else replies[0])(body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests, replies
    server.shutdown()
    server.server_close()


def _choice(
    text: str, *, finish: str = "stop", pieces: list[str] | None = None, offsets: list[int] | None = None
) -> dict[str, Any]:
    pieces = list(text) if pieces is None else pieces  # the tiny tokenizer: one token per character
    logprobs = {"tokens": pieces, "token_logprobs": [-0.5] * len(pieces)}
    if offsets is not None:
        logprobs["text_offset"] = offsets
    return {"text": text, "index": 0, "finish_reason": finish, "logprobs": logprobs}


def _ok(*choices: dict[str, Any], prompt_tokens: int | None = None) -> Callable[[dict[str, Any]], Reply]:
    def reply(body: dict[str, Any]) -> Reply:
        usage = {"prompt_tokens": prompt_tokens if prompt_tokens is not None else len(body["prompt"])}
        return 200, {"choices": list(choices), "usage": usage}

    return reply


def _status(code: int) -> Callable[[dict[str, Any]], Reply]:
    return lambda body: (code, {"error": f"status {code}"})


def test_g_samples_per_prompt_from_a_server_that_ignores_n(stub) -> None:
    url, requests, replies = stub
    tokenizer = tiny_tokenizer()
    replies.append(_ok(_choice("42")))  # one choice per request, like llama-cpp-python
    backend = OpenAIBackend(url, tokenizer, max_concurrency=2, timeout=10)
    rollouts = backend.generate(["ab", "c"], group_size=3, max_new_tokens=4, seed=7)
    assert len(rollouts) == 6 and rollouts.prompt_ids[:3] == [[68, 69]] * 3  # sample-major
    assert rollouts.completion_ids[0] == [*tokenizer("42", add_special_tokens=False).input_ids, 2]
    assert rollouts.sampler_logprobs[0][:2] == [-0.5, -0.5] and math.isnan(rollouts.sampler_logprobs[0][2])
    assert rollouts.truncated == [False] * 6 and rollouts.completions == ["42"] * 6
    assert len({r["seed"] for r in requests}) == 6  # every request its own seed
    assert {r["n"] for r in requests if r["prompt"] == "ab"} == {3, 2, 1}
    assert all(r["top_k"] == 0 and r["min_p"] == 0.0 and r["logprobs"] == 1 for r in requests)


def test_transient_errors_are_retried(stub) -> None:
    url, requests, replies = stub
    replies += [_status(503), _status(429), _ok(_choice("7", finish="length"))]
    rollouts = OpenAIBackend(url, tiny_tokenizer(), timeout=20).generate(
        ["x"], group_size=1, max_new_tokens=1
    )
    assert (
        len(requests) == 3
        and rollouts.truncated == [True]
        and rollouts.completion_ids == [[tiny_tokenizer().convert_tokens_to_ids("7")]]
    )


def test_a_server_that_keeps_failing_gives_a_clear_error_after_the_timeout(stub) -> None:
    url, _, replies = stub
    replies.append(_status(503))
    with pytest.raises(ServerError, match=r"no answer after \d+ attempt\(s\) in 2s \(last error: HTTP 503"):
        OpenAIBackend(url, tiny_tokenizer(), timeout=2.0, max_retries=100).generate(
            ["x"], group_size=1, max_new_tokens=1
        )
    replies[0] = _status(400)  # a bad request is not retried
    with pytest.raises(ServerError, match="rejected the request: HTTP 400"):
        OpenAIBackend(url, tiny_tokenizer(), timeout=20).generate(["x"], group_size=1, max_new_tokens=1)


def test_nothing_listening_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ServerError, match="Is the server running"):
        OpenAIBackend(f"http://127.0.0.1:{port}/v1", tiny_tokenizer(), timeout=1.0).generate(
            ["x"], group_size=1, max_new_tokens=1
        )


def test_misaligned_server_tokens_raise_a_clear_error(stub) -> None:
    url, _, replies = stub
    backend = OpenAIBackend(url, tiny_tokenizer(), timeout=10)
    replies.append(_ok(_choice("ab", pieces=["ab"])))  # a token the trainer's vocabulary splits in two
    with pytest.raises(
        AlignmentError, match=r"the server's token 'ab' is not one token of the trainer's tokenizer"
    ):
        backend.generate(["x"], group_size=1, max_new_tokens=2)
    replies[0] = _ok(_choice("ab", pieces=["a", "c"]))  # tokens that do not spell the text
    with pytest.raises(AlignmentError, match=r"decode to 'ac'.*completion text is 'ab'"):
        backend.generate(["x"], group_size=1, max_new_tokens=2)
    replies[0] = _ok(_choice("a"), prompt_tokens=5)  # the server tokenised the prompt differently
    with pytest.raises(AlignmentError, match="into 5 tokens, the trainer into 1"):
        backend.generate(["x"], group_size=1, max_new_tokens=2)
    with pytest.raises(ValueError, match="untempered"):
        backend.generate(["x"], group_size=1, max_new_tokens=2, temperature=0.7)


def test_tokens_of_partial_characters_are_resolved_from_their_text_or_refused(stub) -> None:
    url, _, replies = stub
    tokenizer = tiny_tokenizer()
    backend = OpenAIBackend(url, tokenizer, timeout=10)
    # like llama-cpp-python: two tokens of one multi-byte character each decode to "" at the same offset
    replies.append(_ok(_choice("abc", pieces=["", "", "c"], offsets=[40, 40, 42])))
    rollouts = backend.generate(["x"], group_size=1, max_new_tokens=3)
    assert rollouts.completion_ids[0] == [*tokenizer("abc", add_special_tokens=False).input_ids, 2]
    replies[0] = _ok(_choice("abc", pieces=["", "c"], offsets=[40, 42]))  # 1 token cannot spell "ab" here
    with pytest.raises(AlignmentError, match=r"1 tokens of partial characters spelling 'ab'.*splits into 2"):
        backend.generate(["x"], group_size=1, max_new_tokens=3)
    # misaligned="resample": the bad sample is drawn again (and counted) instead of raising
    replies[:] = [_ok(_choice("abc", pieces=["", "c"], offsets=[40, 42])), _ok(_choice("ok"))]
    resampling = OpenAIBackend(url, tokenizer, timeout=10, misaligned="resample")
    rollouts = resampling.generate(["x"], group_size=1, max_new_tokens=3)
    assert rollouts.completions == ["ok"] and resampling.resampled == 1


@pytest.mark.parametrize("completion", ["aé", "a é"])
def test_a_character_cut_short_at_the_end_may_be_missing_from_the_servers_text(stub, completion) -> None:
    """A byte-level tokenizer with one merge, " " + the first byte of "é". The completion stops one token
    short of its end, inside "é". The server's text is what vLLM's detokenizer makes of the tokens
    (tokenizers' own DecodeStream): it holds back the last token, " " included; the trainer decodes it
    to U+FFFD. The tokens are trained as sampled; a text that differs elsewhere is still refused."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["\u0120\u00c3"] = len(vocab)  # "Ġ" (a byte-level space) + "Ã" (0xC3, the first byte of "é")
    backend = Tokenizer(models.BPE(vocab, merges=[("\u0120", "\u00c3")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    ids = tokenizer.encode(completion, add_special_tokens=False)[:-1]  # "a", then " \xc3" or "\xc3"
    assert len(ids) == 2 and tokenizer.decode(ids) == completion[:-1] + "\ufffd"
    stream = decoders.DecodeStream(skip_special_tokens=True)
    served = "".join(stream.step(backend, i) or "" for i in ids)
    assert served == "a"
    url, _, replies = stub
    pieces = [f"token_id:{i}" for i in ids]
    replies.append(_ok(_choice(served, finish="length", pieces=pieces), prompt_tokens=1))
    rollouts = OpenAIBackend(url, tokenizer, timeout=10).generate(["x"], group_size=1, max_new_tokens=2)
    assert rollouts.completion_ids == [ids] and rollouts.completions == ["a"]
    replies[0] = _ok(_choice("b", finish="length", pieces=pieces), prompt_tokens=1)
    with pytest.raises(AlignmentError, match="the two tokenizers differ"):
        OpenAIBackend(url, tokenizer, timeout=10).generate(["x"], group_size=1, max_new_tokens=2)


# ---- the real engine -------------------------------------------------------------------------------------
def _smollm2_gguf():
    from gspo.models import default_model_file

    try:
        return default_model_file()
    except FileNotFoundError as error:
        pytest.skip(f"no SmolLM2 GGUF file: {error}")


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[str, Any]]:
    """llama-cpp-python's server on the SmolLM2 Q4_1 GGUF file, and the trainer's tokenizer of that file."""
    path = _smollm2_gguf()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        server = llama_cpp_server(path, n_ctx=512, threads=1)
        url = server.__enter__()
    except RuntimeError as error:
        pytest.skip(f"llama-cpp-python's server could not start: {error}")
    yield url, tokenizer
    server.__exit__(None, None, None)


@pytest.mark.llama_cpp
def test_real_server_returns_g_completions_per_prompt_with_aligned_logprobs(engine) -> None:
    url, tokenizer = engine
    messages = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Say hi."}]]
    prompts = [format_prompt(tokenizer, m[0]["content"]) for m in messages]
    backend = OpenAIBackend(url, tokenizer, max_concurrency=2, timeout=120)
    rollouts = backend.generate(prompts, group_size=2, max_new_tokens=8, seed=0)
    assert len(rollouts) == 4
    eos = tokenizer.eos_token_id
    for i in range(4):
        ids, logprobs = rollouts.completion_ids[i], rollouts.sampler_logprobs[i]
        assert rollouts.prompt_ids[i] == tokenizer(prompts[i // 2], add_special_tokens=False).input_ids
        assert 0 < len(ids) == len(logprobs) <= 9
        assert tokenizer.decode(ids[:-1] if ids[-1] == eos else ids) == rollouts.completions[i]
        # llama.cpp does not report the EOS it stopped on: that one log-prob is unknown, the rest are real
        known = logprobs[:-1] if ids[-1] == eos else logprobs
        assert all(math.isfinite(v) and v <= 0 for v in known)
        assert rollouts.truncated[i] == (ids[-1] != eos)
    assert (
        rollouts.completion_ids[0] != rollouts.completion_ids[1]
        or rollouts.completion_ids[2] != rollouts.completion_ids[3]
    )
    # the engine's tokens go into trajectories unchanged
    groups = groups_from_rollouts(tokenizer, messages, rollouts, [1.0, 0.0, 0.0, 1.0])
    for k, t in enumerate(t for g in groups for t in g.trajectories):
        tok = tokenize_trajectory(tokenizer, t)
        assert tok.prompt_ids == rollouts.prompt_ids[k]
        assert [
            x for x, turn in zip(tok.completion_ids, tok.turn, strict=True) if turn >= 0
        ] == rollouts.completion_ids[k]


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_real_server_logprobs_match_the_trainers_recomputation(engine, smollm2, rollout_logprobs) -> None:
    """Q4_1 kernels vs the de-quantised fp32 model: close per token, closer per sequence."""
    url, tokenizer = engine
    model, _ = smollm2
    prompts = [format_prompt(tokenizer, "What is 4+4?")]
    rollouts = OpenAIBackend(url, tokenizer, timeout=120).generate(
        prompts, group_size=2, max_new_tokens=12, seed=1
    )
    for mine, sampled in zip(rollout_logprobs(model, rollouts), rollouts.sampler_logprobs, strict=True):
        theirs = torch.tensor(sampled)
        known = torch.isfinite(theirs)
        delta = (mine[known] - theirs[known]).abs()
        assert delta.mean() < 0.1, delta


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_gspo_train_samples_from_the_real_server(engine, smollm2_trainer, tmp_path) -> None:
    """rollout.engine=openai: the tiny config's run, on the embedded model the server also serves."""
    url, _ = engine
    from gspo.config import load_config
    from gspo.run.metrics import read_metrics
    from gspo.training.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    config = load_config(
        root / "configs" / "tiny.yaml",
        [
            "model.tiny=null",
            "rollout.engine=openai",
            f"rollout.openai.url={url}",
            f"output_dir={tmp_path / 'run'}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "train.steps=1",
            "task.num_eval=2",
            "eval.every=0",
            "checkpoint.every=0",
            "report_to=[]",
            "train.lr=1e-4",
        ],
    )
    with pytest.warns(UserWarning, match="does not update"), smollm2_trainer():
        trainer = Trainer(config)
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    metrics = trainer.train_step()
    assert trainer.spec.old_logprobs == "recompute"  # the server's weights are not the trainer's
    # the engine's Q4_1 log-probs against the trainer's fp32 recomputation: close, not equal
    assert 0 < metrics["sampler_logprob_abs_diff"] < 0.2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.model.parameters(), strict=True))
    trainer.logger.log(trainer.step, metrics)
    trainer.logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"] == [1]


# ---- a server that is wrong, slow, hostile or far away -------------------------------------------------
@contextlib.contextmanager
def _raw_server(respond: Callable[[Any, str, str, dict[str, str]], None]) -> Iterator[str]:
    """A local server calling respond(wfile, method, path, headers) for each request, to write any bytes."""
    seen: list[tuple[str, str, dict[str, str]]] = []

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            method, path, _ = self.rfile.readline().decode().split(" ", 2)
            headers = {}
            while (line := self.rfile.readline().decode().strip()) != "":
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
            self.rfile.read(int(headers.get("content-length", 0)))
            seen.append((method, path, headers))
            with contextlib.suppress(OSError):  # the client may hang up first (deadlines, size limits)
                respond(self.wfile, method, path, headers)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()


def _answer(
    wfile: Any, status: int, body: bytes, *, content_type: str = "application/json", extra: str = ""
) -> None:
    wfile.write(
        f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}"
        "Connection: close\r\n\r\n".encode()
        + body
    )


def test_a_redirect_is_refused_and_the_key_never_reaches_another_origin() -> None:
    def elsewhere(wfile, method, path, headers) -> None:
        _answer(wfile, 200, json.dumps({"choices": [_choice("1")]}).encode())

    with _raw_server(elsewhere) as (other, seen_there):

        def redirect(wfile, method, path, headers) -> None:
            _answer(wfile, 302, b"", extra=f"Location: {other}/completions\r\n")

        with _raw_server(redirect) as (url, seen_here):
            backend = OpenAIBackend(url, tiny_tokenizer(), api_key="sk-secret-123", timeout=5)
            with pytest.raises(
                ServerError, match=r"redirected the request \(HTTP 302\) to http://127\.0\.0\.1:\d+"
            ):
                backend.generate(["x"], group_size=1, max_new_tokens=1)
    assert seen_here[0][2]["authorization"] == "Bearer sk-secret-123"  # the configured server has it
    assert seen_there == []  # the other origin saw no request at all, so no key


def test_the_key_stays_out_of_repr_and_messages_and_only_http_is_spoken() -> None:
    def echo(wfile, method, path, headers) -> None:  # a server echoing the request back in its error
        _answer(wfile, 400, json.dumps({"error": "bad", "headers": headers}).encode())

    with _raw_server(echo) as (url, _):
        backend = OpenAIBackend(url, tiny_tokenizer(), api_key="sk-secret-123", timeout=5)
        assert "sk-secret-123" not in repr(backend)
        with pytest.raises(ServerError, match="rejected the request: HTTP 400") as raised:
            backend.generate(["x"], group_size=1, max_new_tokens=1)
        assert "sk-secret-123" not in str(raised.value)
    for bad in ("file:///etc/passwd", "ftp://host/v1", "127.0.0.1:8000/v1", "http://user:pw@host/v1"):
        with pytest.raises(ValueError, match="base_url"):
            OpenAIBackend(bad, tiny_tokenizer())


def test_the_timeout_is_a_deadline_on_the_whole_request_however_slowly_the_server_sends() -> None:
    def trickle_body(wfile, method, path, headers) -> None:
        body = json.dumps({"choices": [_choice("1")], "padding": " " * 100}).encode()
        wfile.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for byte in body:  # one byte every 50 ms: each read is quick, the whole takes 10 s
            wfile.write(bytes([byte]))
            wfile.flush()
            time.sleep(0.05)

    def trickle_headers(wfile, method, path, headers) -> None:
        wfile.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(200):
            wfile.write(b"X-Slow: 1\r\n")
            wfile.flush()
            time.sleep(0.05)

    for respond in (trickle_body, trickle_headers):
        with _raw_server(respond) as (url, _):
            start = time.perf_counter()
            with pytest.raises(
                ServerError, match=r"no answer after 1 attempt\(s\) in 1s .*no complete answer"
            ):
                OpenAIBackend(url, tiny_tokenizer(), timeout=1.0).generate(
                    ["x"], group_size=1, max_new_tokens=1
                )
            assert time.perf_counter() - start < 3, respond.__name__


@pytest.mark.parametrize(
    ("status", "body", "content_type", "message"),
    [
        (
            200,
            b"<html><body>502 Bad Gateway</body></html>",
            "text/html",
            r"the answer is not JSON: '<html><body>502",
        ),
        (200, b'[{"text": "1"}]', "application/json", r"the answer is a JSON list, not an object"),
        (200, b'{"choices": "none"}', "application/json", r"malformed completion answer: no list of choices"),
        (
            200,
            json.dumps(
                {"choices": [{"text": "1", "logprobs": {"tokens": [1], "token_logprobs": [0.0]}}]}
            ).encode(),
            "application/json",
            r"logprobs are not lists of tokens",
        ),
        (
            200,
            json.dumps({"choices": [], "padding": "x" * 2_000_000}).encode(),
            "application/json",
            r"no list of choices: '\{",
        ),
    ],
)
def test_a_malformed_answer_is_a_server_error_with_the_url_and_a_short_excerpt(
    status, body, content_type, message
):
    respond = lambda wfile, *_: _answer(wfile, status, body, content_type=content_type)  # noqa: E731
    with _raw_server(respond) as (url, _), pytest.raises(ServerError, match=message) as raised:
        OpenAIBackend(url, tiny_tokenizer(), timeout=5).generate(["x"], group_size=1, max_new_tokens=1)
    assert str(raised.value).startswith(f"{url}/completions: ") and len(str(raised.value)) < 600


def test_an_answer_over_the_size_limit_is_refused_without_reading_it_all() -> None:
    def big(wfile, method, path, headers) -> None:
        _answer(wfile, 200, b'{"choices": [], "padding": "' + b"x" * 3_000_000 + b'"}')

    def big_chunked(wfile, method, path, headers) -> None:  # no Content-Length: the limit applies as it reads
        wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(300):
            wfile.write(b"2710\r\n" + b"x" * 10_000 + b"\r\n")
        wfile.write(b"0\r\n\r\n")

    for respond, message in (
        (big, r"is 3,000,030 bytes, over max_response_bytes=1,000,000"),
        (big_chunked, r"over max_response_bytes=1,000,000 bytes"),
    ):
        with _raw_server(respond) as (url, _):
            backend = OpenAIBackend(url, tiny_tokenizer(), timeout=10, max_response_bytes=1_000_000)
            with pytest.raises(ServerError, match=message):
                backend.generate(["x"], group_size=1, max_new_tokens=1)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            b'{"choices": [{"text": "", "index": 0, "finish_reason": "length", '
            b'"logprobs": {"tokens": ["token_id:999999"], "token_logprobs": [-0.1]}}]}',
            r"sampled token id 999999, outside the trainer's vocabulary of 99",
        ),
        (
            b'{"choices": [{"text": "1", "index": 0, "finish_reason": "length", '
            b'"logprobs": {"tokens": ["1"], "token_logprobs": [Infinity]}}]}',
            r"prompt 0, completion token 0: the server reported the log-probability inf, which no",
        ),
        (
            b'{"choices": [{"text": "12", "index": 0, "finish_reason": "length", '
            b'"logprobs": {"tokens": ["1", "2"], "token_logprobs": [-0.5, NaN]}}]}',
            r"completion token 1: the server reported the log-probability nan",
        ),
        (
            b'{"choices": [{"text": "1", "index": 0, "finish_reason": "length", '
            b'"logprobs": {"tokens": ["1"], "token_logprobs": [0.5]}}]}',
            r"the log-probability 0\.5, which no probability has \(log-probabilities are finite and <= 0\)",
        ),
        (b'{"choices": ' + b"[" * 5000 + b"]" * 5000 + b"}", r"the answer is JSON nested too deeply to read"),
    ],
)
def test_an_answer_no_model_of_the_trainers_could_give_is_a_server_error(body: bytes, message: str) -> None:
    """Out-of-vocabulary ids and infinite log-probs were accepted (or raised elsewhere),
    deeply nested JSON raised RecursionError."""
    respond = lambda wfile, *_: _answer(wfile, 200, body)  # noqa: E731
    with _raw_server(respond) as (url, _), pytest.raises(ServerError, match=message) as raised:
        OpenAIBackend(url, tiny_tokenizer(), timeout=5).generate(["x"], group_size=1, max_new_tokens=1)
    assert str(raised.value).startswith(f"{url}/completions: ") and len(str(raised.value)) < 600


def test_a_log_probability_rounded_just_above_zero_is_taken_as_zero() -> None:
    body = json.dumps(
        {
            "choices": [
                {
                    "text": "1",
                    "index": 0,
                    "finish_reason": "length",
                    "logprobs": {"tokens": ["1"], "token_logprobs": [2e-7]},
                }
            ]
        }
    ).encode()
    with _raw_server(lambda wfile, *_: _answer(wfile, 200, body)) as (url, _):
        rollouts = OpenAIBackend(url, tiny_tokenizer(), timeout=5).generate(
            ["x"], group_size=1, max_new_tokens=1
        )
    assert rollouts.sampler_logprobs == [[0.0]]


# ---- a weight sync through a real server -----------------------------------------------------------------
def test_save_and_reload_hands_the_trained_weights_to_a_real_server(tmp_path) -> None:
    """`Trainer(sampler=OpenAIBackend(..., weight_sync=SaveAndReload(directory, reload)))` against a `gspo
    serve` of the same tiny model, in a thread: after a step the trainer saves its weights, `reload` loads
    that checkpoint into the server's sampling model, and the server's log-probs are the trained policy's."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config
    from gspo.rollout.openai import OpenAIBackend, SaveAndReload
    from gspo.serve.server import build_service, start_in_thread
    from gspo.training.trainer import Trainer

    running = start_in_thread(build_service(tiny_config(tmp_path / "server", "serve.during_update=stale")))
    reloaded: list[Path] = []

    def reload(path: Path) -> None:  # the user's way to point a server at a checkpoint: here, in process
        weights = AutoModelForCausalLM.from_pretrained(path).state_dict()
        trainer_of_server = running.service.trainer
        with torch.no_grad():
            for name, tensor in trainer_of_server.side.model.state_dict().items():
                tensor.copy_(weights[name])
        trainer_of_server.side.driver.engine.reset_prefix_cache()
        reloaded.append(path)

    try:
        config = tiny_config(tmp_path / "run", "eval.every=0", "train.steps=1", "checkpoint.every=0")
        trainer = Trainer(config)  # its own HF sampler, replaced below: the same tokenizer and weights
        backend = OpenAIBackend(
            running.url,
            trainer.tokenizer,
            model=config.serve.model_name,
            send_token_ids=True,
            sampling={},  # gspo serve refuses llama.cpp's extra fields
            weight_sync=SaveAndReload(tmp_path / "weights", reload),
        )
        trainer.rollouts.side.sampler = backend
        before = [p.detach().clone() for p in trainer.policy.model.parameters()]
        trainer.train_step()
        assert reloaded == [tmp_path / "weights" / "step-1"]
        moved = max(
            float((a - b).abs().max()) for a, b in zip(trainer.policy.model.parameters(), before, strict=True)
        )
        assert moved > 1e-4  # the update changed the weights the server now has
        prompts = trainer.rollouts.prompts(trainer.rollouts.stream.next_batch()[:2])
        rollouts = backend.generate(prompts, group_size=2, max_new_tokens=2, temperature=1.0)
        from gspo.core.layout import TokenSequence, make_micro_batches
        from gspo.learning.learner import place
        from gspo.learning.policy import score

        sequences = [
            TokenSequence(p, c, [True] * len(c))
            for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)
        ]
        for mb in make_micro_batches(
            sequences, layout="padded", pack_length=64, micro_batch_tokens=256, pad_id=0
        ):
            with torch.no_grad():
                mine = score(trainer.policy.model, mb, trainer.spec)
            mask = mb.logprob_mask.reshape(-1)
            theirs = place(rollouts.sampler_logprobs, mb)
            # the server decodes token by token with a cache, the trainer scores whole sequences: fp32 sums in
            # other orders over the tiny model (bounds.tiny_gradient_rtol of log-probs of size ~5: 6e-4); the
            # weights before the step would be off by the update's effect, ~1e-2
            torch.testing.assert_close(theirs[mask], mine[mask], rtol=0, atol=1e-3)
        trainer.finish()
    finally:
        running.stop()
