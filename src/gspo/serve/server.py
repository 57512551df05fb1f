"""`gspo serve`: build the policy as `gspo train` does, put the sampling engine and the trainer behind the
ASGI app, and run it with uvicorn on serve.host:serve.port.

The config is `gspo train`'s (model, LoRA, objective, optimiser, checkpoints) plus its `serve` section. With
--resume, the run folder's config is used, and how the server listens (serve.host, serve.port,
serve.api_key_env, serve.max_body_bytes) comes from the command line alone: a run folder someone shared
cannot open the server to the network, pick which environment variable holds a key, or lift the body
limit. The socket is bound before the model loads, so a port in use fails at once.
"""

from __future__ import annotations

import contextlib
import copy
import ipaddress
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError, ServeConfig, load_config, validate
from gspo.config.checks import LOOPBACK
from gspo.config.engines import ENGINES, engine_of
from gspo.rollout.openai import api_key_problem
from gspo.run.own_runs import record
from gspo.run.resume import resume_config
from gspo.run.start import open_folder, start_run
from gspo.run.trust import check_code_keys, check_reaches, model_reaches, users_code_files, users_reaches
from gspo.sampling.side import SamplingSide
from gspo.serve.app import Service, create_app
from gspo.serve.openai_api import Inference, prompt_char_limit
from gspo.serve.records import RecordStore
from gspo.serve.service import TrainService

LISTEN_KEYS = ("serve.host", "serve.port", "serve.api_key_env", "serve.max_body_bytes")
"""How the server listens: on --resume these come from the command line, never from the run folder."""


def serve_config(
    config: str | Path | None,
    overrides: list[str],
    resume: str | Path | None,
    *,
    trust_run_folder: bool = False,
) -> Config:
    """The config to serve: CONFIG plus overrides; with --resume the run's own, its listen keys from the
    command line only (module docstring), its objective code and the base model of its LoRA checkpoint
    used only when named again or trusted (gspo.run.trust)."""
    if resume is None:
        return load_config(config, overrides)
    listen = [o for o in overrides if o.partition("=")[0] in LISTEN_KEYS]
    resumed = resume_config(resume, [o for o in overrides if o not in listen])
    # the server imports no reward or sampler code, and contacts no server of the folder's
    folder, trust = Path(resume), trust_run_folder
    check_code_keys(resumed, overrides, folder=folder, keys=["train.objective"], trust_run_folder=trust)
    reads = model_reaches(resumed, copies_gguf=False)
    check_reaches(resumed, overrides, folder=folder, trust_run_folder=trust, keys=reads)
    given = load_config(None, listen)
    for key in LISTEN_KEYS:
        name = key.removeprefix("serve.")
        setattr(resumed.serve, name, getattr(given.serve, name))
    validate(resumed)
    return resumed


def api_key(config: Config) -> str | None:
    """The key clients must send: the value of the variable serve.api_key_env names (None: no key), checked
    as a client's key is (gspo.rollout.openai.api_key_problem): a key no client can send, or one a client
    would send stripped, is refused at start by the variable's name, never echoed."""
    name = config.serve.api_key_env
    if name is None:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise ConfigError(f"serve.api_key_env={name}, but ${name} is empty or not set: export the key in it")
    why = api_key_problem(value)
    if why is not None:
        raise ConfigError(
            f"the environment variable {name} (serve.api_key_env) {why}; it is not shown: set it to the key "
            "alone, without a trailing newline or carriage return (clients could never send it)"
        )
    return value


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); a port in use or not ours is a ConfigError."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name
        family = socket.AF_INET6 if host not in LOOPBACK and ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({error.strerror or error}): choose another serve.port (0 picks a "
            "free one) or serve.host"
        ) from None
    sock.set_inheritable(True)
    return sock


def stop_token_ids(tokenizer: Any, model: torch.nn.Module) -> frozenset[int]:
    """The tokenizer's EOS and the model's generation-config EOS ids (chat models end turns with one)."""
    ids = {tokenizer.eos_token_id}
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None) if generation is not None else None
    ids.update(extra if isinstance(extra, list) else [extra])
    return frozenset(i for i in ids if i is not None)


def _aligned(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every parameter in memory of its own. Weights read from a safetensors file can lie at
    the file's offsets (8 bytes past a 64-byte boundary here), where the CPU's matrix-vector kernels round
    differently: a resumed server then drew log-probs 1 ulp off the ones the same weights gave before the
    kill (tests/test_serve.py's kill -9 test)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.data_ptr() % 64:
                parameter.data = parameter.data.clone()
    return model


def build_service(
    config: Config, *, resume: str | Path | None = None, force: bool = False, key: str | None = None
) -> Service:
    """The run (gspo.run.start, as `gspo train` opens it), sampling side, records and trainer of a `gspo
    serve` run (module docstring)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("gspo serve runs in one process: start it without torchrun")
    engine = engine_of(config)
    if engine is not None and not engine.streams:
        raise ConfigError(
            f"gspo serve answers requests token by token (streaming, stop strings, continuous batching), which "
            f"rollout.engine={config.rollout.engine} does not: serve with rollout.engine="
            + " or ".join(name for name, e in ENGINES.items() if e.streams)
        )
    # the folder checked, then locked for this process (one writer per run folder: gspo.run.lock)
    folder = open_folder(config, resume, force=force, command="gspo serve")
    run = start_run(config, folder, prepare=_aligned)
    restored = run.restore()
    served = restored.get("serve", {})  # a checkpoint of `gspo train`: its step is the version
    run.step = int(served.get("version", run.step))
    model, tokenizer, serve = run.policy.model, run.tokenizer, config.serve
    stops = stop_token_ids(tokenizer, model)
    # stale: the engine samples from a copy of its own while the policy trains; wait: from the policy itself
    side = SamplingSide.open(
        run,
        beside=serve.during_update == "stale",
        threaded=True,
        engine=lambda sampler: streaming_engine(sampler, serve.slots, stops),
    )
    records = RecordStore(serve.max_records, serve.record_ttl)
    trainer = TrainService(run, side, records, dict(served.get("answers", {})))
    driver = side.driver
    assert driver is not None  # a server's side has its thread
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = getattr(text, "max_position_embeddings", None) or driver.engine.max_length
    vocab = model.get_input_embeddings().num_embeddings
    limit = prompt_char_limit(tokenizer, context)
    inference = Inference(tokenizer, driver, records, serve, context, stops, vocab, limit)
    return Service(inference, trainer, key)


def streaming_engine(sampler: Any, slots: int, stops: frozenset[int]) -> Any:
    """The step engine ``sampler`` answers requests with (gspo.rollout.requests.StepEngine); a sampler of
    your own without one (`step_engine`) cannot serve."""
    make = getattr(sampler, "step_engine", None)
    if make is None:
        raise ConfigError(
            f"gspo serve answers requests token by token, and the sampler {type(sampler).__name__} has no "
            "step_engine(slots, stop_token_ids) (gspo.rollout.requests.StepEngine): serve with rollout.engine=hf "
            "or vllm"
        )
    return make(slots=slots, stop_token_ids=sorted(stops))


def close_service(service: Service) -> None:
    """Stop sampling, checkpoint what is not on disk yet (serve.durable=false), close the metrics."""
    trainer = service.trainer
    trainer.side.close(timeout=10.0)
    if trainer.version != trainer.saved_version:
        trainer._save()
    trainer.logger.close()
    trainer.run.release()  # written in full: another process may continue it now


def serve(
    config: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    resume: str | Path | None = None,
    force: bool = False,
    trust_run_folder: bool = False,
) -> None:
    """Run `gspo serve` until interrupted (SIGINT/SIGTERM: uvicorn's graceful shutdown)."""
    try:
        import uvicorn
    except ImportError as error:
        raise ImportError(
            f"gspo serve needs the server packages: pip install 'gspo[serve]' ({error})"
        ) from None
    resolved = serve_config(config, list(overrides), resume, trust_run_folder=trust_run_folder)
    key = api_key(resolved)
    sock = bind(resolved.serve.host, resolved.serve.port)
    service = build_service(resolved, resume=resume, force=force, key=key)
    # the code files and outside paths the user named are theirs for this run, as `gspo train` records them
    resumed = resume is not None
    files, named = (
        users_code_files(resolved, overrides, resumed=resumed),
        users_reaches(resolved, overrides, resumed=resumed),
    )
    if refusal := record(service.trainer.run_dir, files, named):
        print(f"note: this run is not recorded as yours ({refusal})", file=sys.stderr)
    port = sock.getsockname()[1]
    host = resolved.serve.host
    shown = f"[{host}]" if ":" in host else host
    print(
        f"gspo serve: http://{shown}:{port}/v1 model {resolved.serve.model_name!r}, policy version "
        f"{service.trainer.version}, run folder {service.trainer.run_dir}"
        + (", API key required" if key else ""),
        flush=True,
    )
    server = uvicorn.Server(uvicorn_config(create_app(service), resolved.serve))
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again with the handler it found: with
    # Python's default that killed the process before close_service, leaving the lock's record (and, with
    # serve.durable=false, the last train calls unsaved). The handler found is this one, which unwinds.
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        server.run(sockets=[sock])
    except Stopped:
        pass  # a clean stop: exit 0 once the service is closed
    finally:
        signal.signal(signal.SIGTERM, previous)
        close_service(service)


def uvicorn_config(app: Any, serve: ServeConfig) -> Any:
    """How uvicorn runs `gspo serve`: its start-up and error lines, and a line per request only with
    serve.access_log (an agent's training sends thousands, which buried the client's own output)."""
    import uvicorn

    # stdout carries the server's address line (scripts read it); uvicorn's log goes to stderr, so a
    # reader that stops after that line cannot block the server on a full pipe
    logging = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logging["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return uvicorn.Config(
        app,
        log_level="info",
        log_config=logging,
        access_log=serve.access_log,
        timeout_graceful_shutdown=5,
    )


class Stopped(Exception):
    """SIGTERM reached `gspo serve` after uvicorn's graceful shutdown."""


def _stopped(signum: int, frame: Any) -> None:
    raise Stopped


@dataclass
class Running:
    """A server running in a thread of this process (tests, benchmarks): its URL and how to stop it."""

    url: str
    service: Service
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        close_service(self.service)


def start_in_thread(service: Service, host: str = "127.0.0.1") -> Running:
    """Serve `service` on a free port of `host` in a daemon thread; returns once it accepts requests."""
    import uvicorn

    sock = bind(host, 0)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    thread = service.trainer.run.workers.thread("uvicorn", server.run, sockets=[sock])
    while not server.started and thread.is_alive():
        with contextlib.suppress(Exception):
            thread.join(0.02)
    return Running(f"http://{host}:{sock.getsockname()[1]}/v1", service, server, thread)
