"""ART's `Backend` over `gspo serve`: ART client code (TrainableModel, gather_trajectory_groups,
backend.train) trains with gspo's objective on any machine, a CPU included.

`GspoBackend(url)` talks to a running `gspo serve`; `GspoBackend(config=..., overrides=[...])` starts one as
a child process and stops it on `close`. Not a thread of this process: `import art` replaces a function of
transformers (masking_utils._preprocess_mask_arguments) with one written for transformers 4, which breaks
every model's forward under transformers 5 in the process that imported art. Inference is the server's: the model's
`openai_client()` points at it, and each choice it returns carries the `completion_id` of the exact tokens
and log-probs it sampled. `train` turns each ART Trajectory into a `gspo.client.Episode` (the completion
ids of its choices, in order, across its additional histories too, and its reward) and posts the groups
with `gspo.client.Client`: the server rebuilds every trajectory from its own records and runs one step of
the configured objective (docs/agents.md). The step is the server's policy version.

Deliberate choices:
- The server's config decides the objective and the optimiser (train.lr, train.objective, ...): ART's
  per-call training arguments (learning_rate, loss_fn, epsilon, ...) are refused with a message naming the
  key to set instead, rather than ignored.
- A choice without a gspo completion id (an answer from another endpoint) cannot be trained exactly: the
  train call is refused, naming the group and trajectory.
- Checkpoints are the server's (serve.durable: one per train call; checkpoint.keep of them are kept), so
  `_delete_checkpoint_files` leaves them alone.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import re
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai

from gspo.client import Client, Episode, EpisodeGroup, completion_id
from gspo.rollout.processes import PREEXEC

if TYPE_CHECKING:
    import art


def _import_art() -> Any:
    """openpipe-art, imported when a backend is made (its import takes seconds and patches transformers)."""
    try:
        import art
    except ImportError as error:
        raise ImportError(f"GspoBackend needs openpipe-art: pip install 'gspo[art]' ({error})") from None
    _check_openai(importlib.metadata.version("openpipe-art"), openai.__version__)
    return art


def _check_openai(art_version: str, openai_version: str) -> None:
    """openpipe-art up to 0.5.18 hands openai's http client an `httpx.Timeout`; openai 3 builds that client
    on httpx2, which takes it for a number, and every request of `model.openai_client()` then fails deep in
    anyio ("float + Timeout"). Say so before anything starts."""

    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", version)[:3])

    if release(openai_version) >= (3,) and release(art_version) <= (0, 5, 18):
        raise RuntimeError(
            f"openpipe-art {art_version}'s model.openai_client() fails under openai {openai_version} "
            "(httpx2 cannot use the httpx.Timeout it passes): pip install 'openai<3' (the gspo[art] extra "
            "pins it)"
        )


SERVER_KEYS = {
    "learning_rate": "train.lr",
    "loss_fn": "train.objective",
    "epsilon": "train.eps_low",
    "epsilon_high": "train.eps_high",
    "kl_penalty_coef": "train.beta",
    "importance_sampling_level": "train.objective (gspo: sequence, gspo_token: token)",
}
"""ART's per-call training arguments and the `gspo serve` config key that decides each one."""


class GspoBackend:
    """An `art.Backend` whose model is the policy of one `gspo serve` (module docstring).

    ``base_url``: a running server's API root (".../v1"), its key from ``api_key`` or $GSPO_API_KEY; else
    ``config`` and ``overrides`` (as `gspo serve CONFIG key=value ...`) start one as a child process.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        config: str | Path | None = None,
        overrides: Sequence[str] = (),
        timeout: float = 600.0,
    ) -> None:
        self._art = _import_art()
        self._server: subprocess.Popen | None = None
        if base_url is None:
            base_url = self._start_server(config, overrides)
        elif config is not None or overrides:
            raise ValueError(
                "GspoBackend: give a running server's base_url, or a config to start one, not both"
            )
        self.client = Client(base_url, api_key=api_key, timeout=timeout)
        self._model_name: str | None = None

    def _start_server(self, config: str | Path | None, overrides: Sequence[str]) -> str:
        self._server, url = start_server(config, overrides)
        return url

    # ---- registration and inference ------------------------------------------------------------------
    async def register(self, model: art.Model) -> None:
        """The server serves one policy: a backend trains one model (its name is kept for the messages)."""
        if self._model_name not in (None, model.name):
            raise ValueError(
                f"this gspo serve already trains model {self._model_name!r}: start another server for "
                f"{model.name!r}"
            )
        self._model_name = model.name

    async def _prepare_backend_for_training(
        self, model: art.TrainableModel, config: Any = None
    ) -> tuple[str, str]:
        """(base URL, API key) of the server: `model.openai_client()` samples from the live policy."""
        return str(self.client.openai.base_url), self.client.openai.api_key

    def _model_inference_name(self, model: art.Model, step: int | None = None) -> str:
        """The served model's name (the server serves its current version only, whatever ``step``)."""
        return self.client.model

    async def _get_step(self, model: art.TrainableModel) -> int:
        """The policy version: train calls applied so far (a resumed server continues its count)."""
        status = await self.client.async_openai.get("/status", cast_to=object)
        return int(status["trainer"]["version"])

    # ---- training --------------------------------------------------------------------------------------
    async def train(
        self, model: art.TrainableModel, trajectory_groups: Iterable[art.TrajectoryGroup], **kwargs: Any
    ) -> art.TrainResult:
        """One GSPO step (the server's objective) on ART's trajectory groups; returns the new version and
        the step's metrics."""
        refused = sorted(set(kwargs) - {"verbose", "save_checkpoint"})
        if refused:
            keys = ", ".join(f"{name} ({SERVER_KEYS.get(name, 'the server config')})" for name in refused)
            raise TypeError(
                f"GspoBackend.train: gspo serve's config decides {keys}: set it when starting the server"
            )
        groups = [EpisodeGroup(episodes(group, g)) for g, group in enumerate(trajectory_groups)]
        answer = await self.client.atrain([group for group in groups if group.trajectories])
        metrics = {k: float(v) for k, v in answer["metrics"].items() if isinstance(v, (int, float))}
        return self._art.TrainResult(step=int(answer["version"]), metrics=metrics)

    async def checkpoint(self) -> dict[str, Any]:
        """Write a checkpoint now (with serve.durable, every train call already has one)."""
        return await self.client.async_openai.post("/checkpoint", cast_to=object)

    async def _delete_checkpoint_files(self, model: art.TrainableModel, steps_to_keep: list[int]) -> None:
        """gspo serve keeps its newest checkpoint.keep checkpoints itself; nothing else is deleted."""

    def _train_sft(
        self, model: Any, trajectories: Any, config: Any, dev_config: Any, verbose: bool = False
    ) -> AsyncIterator[dict[str, float]]:
        raise NotImplementedError("gspo serve trains RL objectives only; SFT is not offered by GspoBackend")

    async def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.terminate()  # SIGTERM: uvicorn's graceful shutdown checkpoints what is not on disk
            await asyncio.to_thread(server.wait)

    async def __aenter__(self) -> GspoBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def start_server(config: str | Path | None, overrides: Sequence[str]) -> tuple[subprocess.Popen, str]:
    """`gspo serve CONFIG overrides serve.port=0` as a child process (its log on this stderr): the process
    and its URL. On Linux the server gets SIGTERM (and checkpoints, as on close) when the thread that
    started it ends, so a client that crashed leaves no server holding the model's memory."""
    command = [sys.executable, "-m", "gspo", "serve", *([str(config)] if config else []), *overrides]
    server = subprocess.Popen(
        [*command, "serve.port=0"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=PREEXEC,
    )
    line = server.stdout.readline() if server.stdout else ""
    if not line.startswith("gspo serve: http://"):  # it failed: its error line is on stderr
        server.kill()
        server.wait()
        raise RuntimeError(f"gspo serve did not start (exit code {server.returncode}): {shlex.join(command)}")
    return server, line.split()[2]


def episodes(group: art.TrajectoryGroup, index: int = 0) -> list[Episode]:
    """gspo Episodes of an ART group: each trajectory's choices (main history, then additional histories)
    by completion id, its reward, and its numeric metrics."""
    out = []
    for t, trajectory in enumerate(group.trajectories):
        histories = [trajectory.messages_and_choices] + [
            h.messages_and_choices for h in trajectory.additional_histories
        ]
        choices = [item for history in histories for item in history if not isinstance(item, dict)]
        where = f"trajectory_groups[{index}].trajectories[{t}]"
        if not choices:
            raise ValueError(f"{where} has no choice to train: append the completions' choices, as ART does")
        try:
            ids = [completion_id(choice) for choice in choices]
        except ValueError:
            raise ValueError(
                f"{where}: a choice without a gspo completion_id (an answer from another endpoint?): sample "
                "with model.openai_client() of a model registered with GspoBackend"
            ) from None
        metrics = {k: float(v) for k, v in trajectory.metrics.items() if isinstance(v, (int, float))}
        out.append(Episode(ids, float(trajectory.reward), metrics=metrics))
    return out
