"""rollout.engine's built-in samplers, once: the one place a name becomes an engine. The config's checks, the
trust rules (which servers and paths a run reaches) and the sampling side's factories all read `ENGINES`;
adding an engine is one `Engine` entry here and its factory.

The table is torch-free, so that the config can read it: each factory is named as "module:function" and
imported only when a run builds its sampler (gspo.sampling.factories.build_sampler).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gspo.config.values import ConfigError

if TYPE_CHECKING:
    from gspo.config.schema import Config


@dataclass(frozen=True)
class Engine:
    """One built-in sampler: how it is built, what it needs and what it reaches."""

    factory: str
    """Its factory, "module:function", called with (config, policy, tokenizer, run folder)."""
    one_process: bool = False
    """It runs in one process: refused under torchrun (use hf there)."""
    in_process: bool = False
    """The trainer's own model, generating in this process: its key/value cache is checked against the free
    memory at start-up."""
    streams: bool = False
    """It answers `gspo serve`'s requests token by token (a step engine: continuous batching, streaming,
    cancellation)."""
    copies_gguf: bool = False
    """It reads model.path's GGUF beside a checkpoint (its metadata and tokenizer)."""
    checks: Callable[[Config], None] = field(default=lambda config: None)
    """What it needs of the config, a ConfigError naming the fix."""
    reaches: Callable[[Config], list[str]] = field(default=lambda config: [])
    """The config keys of servers and outside paths it uses (gspo.run.trust.REACHES)."""


def _server_temperature(config: Config) -> None:
    temperature = config.rollout.temperature
    if temperature != 1.0:
        raise ConfigError(
            f"rollout.temperature={temperature} with rollout.engine={config.rollout.engine}: servers report "
            "log-probs of the untempered distribution (the default temperature is the in-process engines'); "
            "add rollout.temperature=1.0"
        )


def _openai_checks(config: Config) -> None:
    if not config.rollout.openai.url:
        raise ConfigError(
            'rollout.engine=openai needs rollout.openai.url, the API root (e.g. "http://127.0.0.1:8000/v1")'
        )
    _server_temperature(config)


def _openai_reaches(config: Config) -> list[str]:
    openai = config.rollout.openai
    default_key = type(openai)().api_key_env  # a key variable of the user's own is a reach of its own
    return ["rollout.openai.url"] + (
        ["rollout.openai.api_key_env"] if openai.api_key_env != default_key else []
    )


def _vllm_checks(config: Config) -> None:
    if config.rollout.top_p != 1.0:
        raise ConfigError(
            f"rollout.top_p={config.rollout.top_p} with rollout.engine={config.rollout.engine}: vLLM's log-probs "
            "would be those of the truncated distribution, which the trainer does not score; set rollout.top_p=1.0"
        )


def _vllm_server_checks(config: Config) -> None:
    """vllm_server: top_p as vLLM's, and a server of the user's (rollout.vllm.url) comes with the folder both
    sides see, and only with it."""
    _vllm_checks(config)
    vllm = config.rollout.vllm
    if vllm.url is None:
        return
    if not vllm.url.rstrip("/").endswith("/v1"):
        raise ConfigError(
            f"rollout.vllm.url={vllm.url!r} must be the server's API root, ending in /v1 "
            '(e.g. "http://127.0.0.1:8000/v1")'
        )
    if vllm.weight_sync == "files" and vllm.weights_dir is None:
        raise ConfigError(
            "rollout.vllm.url needs rollout.vllm.weights_dir, a folder the server's machine sees too, where "
            "gspo writes the weights for it to reload after every step (and rollout.vllm.server_weights_dir "
            "if its path differs there)"
        )
    if vllm.weight_sync == "nccl" and vllm.weights_dir is not None:
        raise ConfigError(
            "rollout.vllm.weights_dir is for rollout.vllm.weight_sync=files: remove it, or sync by files"
        )


def _vllm_server_reaches(config: Config) -> list[str]:
    vllm = config.rollout.vllm
    if vllm.url is None:
        return []
    if vllm.weight_sync == "nccl":
        return ["rollout.vllm.url", "rollout.vllm.nccl_address"]
    folders = [
        f"rollout.vllm.{name}" for name in ("weights_dir", "server_weights_dir") if getattr(vllm, name)
    ]
    return ["rollout.vllm.url", *folders]


ENGINES: dict[str, Engine] = {
    "hf": Engine("gspo.sampling.factories:hf_sampler", in_process=True, streams=True),
    "openai": Engine(
        "gspo.sampling.factories:openai_sampler", checks=_openai_checks, reaches=_openai_reaches
    ),
    "llama_cpp": Engine(
        "gspo.sampling.factories:llama_cpp_sampler",
        one_process=True,
        copies_gguf=True,
        checks=_server_temperature,
    ),
    "vllm": Engine(
        "gspo.sampling.factories:vllm_sampler", one_process=True, streams=True, checks=_vllm_checks
    ),
    "vllm_server": Engine(
        "gspo.sampling.factories:vllm_server_sampler",
        one_process=True,
        checks=_vllm_server_checks,
        reaches=_vllm_server_reaches,
    ),
}
"""The built-in samplers by rollout.engine's name; a user's factory is named by its file or module instead."""


def engine_of(config: Config) -> Engine | None:
    """rollout.engine's entry; None for a user's own factory ("path/file.py:function", "module:function")."""
    return ENGINES.get(config.rollout.engine)


def check_engine(config: Config) -> None:
    """What the engine rollout.engine names needs of the config (its own checks), and what belongs to another
    engine's settings alone (rollout.vllm.url and its folders), refused with the fix."""
    name = config.rollout.engine  # a built-in's or a factory's, checked as it is set (gspo.config.rules)
    engine = engine_of(config)
    vllm = config.rollout.vllm
    if vllm.weight_sync == "nccl" and vllm.url is None:
        raise ConfigError(
            "rollout.vllm.weight_sync=nccl needs a server of yours on other GPUs (rollout.vllm.url): NCCL "
            "cannot join two processes on one GPU, as gspo's own server would share the trainer's; set "
            "rollout.vllm.url, or rollout.vllm.weight_sync=files"
        )
    if vllm.url is None:
        for key in ("weights_dir", "server_weights_dir"):
            if getattr(vllm, key) is not None:
                raise ConfigError(
                    f"rollout.vllm.{key} is for a server of yours (rollout.vllm.url): set rollout.vllm.url, "
                    f"or remove rollout.vllm.{key} (gspo's own server uses RUN/vllm_server)"
                )
    elif engine is not ENGINES["vllm_server"]:
        raise ConfigError(
            f"rollout.vllm.url is the server of rollout.engine=vllm_server, not of rollout.engine={name}: set "
            "rollout.engine=vllm_server, or remove rollout.vllm.url"
        )
    if engine is not None:
        engine.checks(config)
