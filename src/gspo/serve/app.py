"""The ASGI application (FastAPI): routes, the API key, and every error as OpenAI's JSON error object.

Routes: GET /health (no key needed: whether the engine thread lives), GET /v1/models, POST
/v1/chat/completions and /v1/completions (gspo.serve.openai_api), POST /v1/train (gspo.serve.service),
POST /v1/checkpoint, GET /v1/status (the engine's and the trainer's state). With an API key, every other
route needs ``Authorization: Bearer KEY`` (compared in constant time; never logged or echoed). A request
that cannot be served gets a 4xx naming the field; an unexpected error a 500 naming its type, the
traceback going to the server's log; neither disturbs other requests.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from gspo.serve.openai_api import Inference, chat_completions, completions
from gspo.serve.protocol import ChatRequest, CompletionRequest, ServeError, TrainRequest, field_name
from gspo.serve.service import TrainService

log = logging.getLogger("gspo.serve")

BODY_PAUSE_SECONDS = 5.0
"""The longest a request body may pause between two of its pieces (uvicorn's own bound on an idle
connection): a client that sends part of a body and then nothing held its connection, and a task of the
server, for as long as it liked. Answered 408, and the connection closed."""
BODY_SECONDS = 60.0
"""The longest a whole request body may take to arrive (2 MiB, the default limit, at 35 KB/s): a client
that trickles a byte every few seconds never pauses long enough for `BODY_PAUSE_SECONDS`."""


@dataclass
class Service:
    """What the routes serve: inference, training, and the API key (None: no key)."""

    inference: Inference
    trainer: TrainService
    api_key: str | None
    started: float = 0.0

    def __repr__(self) -> str:  # the key stays out of any log or traceback that prints this
        return (
            f"Service(model={self.inference.serve.model_name!r}, api_key={'set' if self.api_key else None})"
        )


def error_response(error: ServeError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _validation_message(error: dict[str, Any]) -> tuple[str, str]:
    name = field_name(tuple(error.get("loc", ()))) or "body"
    if error.get("type") == "json_invalid":
        context = error.get("ctx", {}).get("error", "")
        return "body", f"the body is not valid JSON ({context})"
    if error.get("type") == "extra_forbidden":
        return name, f"{name}: unknown field (not part of this endpoint's request)"
    if error.get("type") == "missing":
        return name, f"{name}: this field is required"
    return name, f"{name}: {error.get('msg', 'invalid value').removeprefix('Value error, ')}"


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="gspo serve", docs_url=None, redoc_url=None, openapi_url=None)
    service.started = time.time()

    @app.exception_handler(ServeError)
    async def _serve_error(_: Request, error: ServeError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        param, message = _validation_message(errors[0]) if errors else ("body", "invalid request")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        return error_response(ServeError(400, message + more, param=param, code="invalid_request"))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(ServeError(error.status_code, str(error.detail)))

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, error: RecursionError) -> JSONResponse:
        return error_response(ServeError(400, "the body is nested too deeply", param="body"))

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception) -> JSONResponse:
        log.exception("internal error in %s %s", request.method, request.url.path)
        return error_response(
            ServeError(500, f"internal error ({type(error).__name__}); see the server's log")
        )

    _routes(app, service)
    app.add_middleware(Guard, api_key=service.api_key, max_body=service.inference.serve.max_body_bytes)
    return app


class Guard:
    """ASGI middleware: the body size limit (Content-Length, before anything else), the API key (all
    routes but /health), then the body itself, read here up to serve.max_body_bytes and refused (413)
    the moment it passes the limit, so no route parses or holds more. Pure ASGI, so the routes still see
    a client disconnect (Starlette's BaseHTTPMiddleware hides it)."""

    def __init__(self, app: Any, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        refusal = None
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            refusal = self._too_large()
        elif self.api_key is not None and scope.get("path") != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                refusal = ServeError(
                    401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key"
                )
        if refusal is not None:
            return await error_response(refusal)(scope, receive, send)
        body = bytearray()
        deadline = time.monotonic() + BODY_SECONDS
        while True:
            wait = min(BODY_PAUSE_SECONDS, deadline - time.monotonic())
            try:
                message = await asyncio.wait_for(receive(), timeout=max(wait, 0.0))
            except (
                TimeoutError
            ):  # answered, and the connection closed: the rest of the body is not waited for
                response = error_response(self._too_slow(len(body)))
                response.headers["connection"] = "close"
                return await response(scope, receive, send)
            if message["type"] == "http.disconnect":
                return None  # nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_body:  # a chunked body, or more than its Content-Length said
                return await error_response(self._too_large())(scope, receive, send)
            if not message.get("more_body", False):
                break
        return await self.app(scope, _replay(bytes(body), receive), send)

    def _too_slow(self, received: int) -> ServeError:
        return ServeError(
            408,
            f"the request body stopped arriving ({received} bytes received): its pieces may pause at most "
            f"{BODY_PAUSE_SECONDS:g} s, and all of it must arrive within {BODY_SECONDS:g} s; send it again, whole",
            param="body",
            code="request_timeout",
        )

    def _too_large(self) -> ServeError:
        return ServeError(
            413,
            f"the request body is larger than serve.max_body_bytes={self.max_body} bytes: send less, or "
            "start gspo serve with a larger serve.max_body_bytes",
            param="body",
            code="body_too_large",
        )


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that gives the body read already, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _routes(app: FastAPI, service: Service) -> None:
    inference, trainer = service.inference, service.trainer

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = inference.driver.status()["alive"]
        return JSONResponse(
            {"status": "ok" if alive else "engine thread stopped"}, status_code=200 if alive else 503
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(service)]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict[str, Any]:
        if name != inference.serve.model_name:
            raise ServeError(
                404, f"model {name!r} is not served here: use {inference.serve.model_name!r}", param="model"
            )
        return _model_card(service)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        return await chat_completions(inference, body, request)

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request) -> Any:
        return await completions(inference, body, request)

    @app.post("/v1/train")
    async def train(body: TrainRequest) -> dict[str, Any]:
        if body.model is not None and body.model != inference.serve.model_name:
            raise ServeError(
                404, f"model {body.model!r} is not served here", param="model", code="model_not_found"
            )
        return await trainer.train(body)

    @app.post("/v1/checkpoint")
    async def checkpoint() -> dict[str, Any]:
        path = await trainer.checkpoint()
        return {"object": "checkpoint", "version": trainer.version, "path": str(path)}

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return {
            "object": "status",
            "model": inference.serve.model_name,
            "uptime_seconds": round(time.time() - service.started, 1),
            "engine": inference.driver.status(),
            "trainer": trainer.status(),
            "records": {"kept": len(inference.records), "expired": inference.records.expired},
            "during_update": inference.serve.during_update,
        }


def _model_card(service: Service) -> dict[str, Any]:
    return {
        "id": service.inference.serve.model_name,
        "object": "model",
        "created": int(service.started),
        "owned_by": "gspo",
        "max_model_len": service.inference.context,
        "policy_version": service.trainer.version,
    }
