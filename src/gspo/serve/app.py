"""The ASGI application (FastAPI): routes, the API key, and every error as OpenAI's JSON error object.

Routes: GET /health (no key needed: whether the engine thread lives), GET /v1/models, POST
/v1/chat/completions and /v1/completions (gspo.serve.openai_api), POST /v1/train (gspo.serve.service),
POST /v1/checkpoint, GET /v1/status (the engine's and the trainer's state). With an API key, every other
route needs ``Authorization: Bearer KEY`` (compared in constant time; never logged or echoed). A request
that cannot be served gets a 4xx naming the field; an unexpected error a 500 naming its type, the
traceback going to the server's log; neither disturbs other requests.
"""

from __future__ import annotations

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

MAX_BODY_BYTES = 64 * 2**20
"""A request body larger than this is refused (413) before it is read."""


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
    return name, f"{name}: {error.get('msg', 'invalid value')}"


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
    app.add_middleware(Guard, api_key=service.api_key)
    return app


class Guard:
    """ASGI middleware: the API key (all routes but /health) and the body size limit, checked before the
    request reaches a route. Pure ASGI, so the routes still see a client disconnect (Starlette's
    BaseHTTPMiddleware hides it)."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        refusal = None
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            refusal = ServeError(413, f"the body exceeds {MAX_BODY_BYTES >> 20} MiB", param="body")
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
        return await self.app(scope, receive, send)


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
