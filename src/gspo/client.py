"""A thin client for `gspo serve`: the official openai SDK pointed at the server, and training on groups.

Your agent is ordinary code against `openai.AsyncOpenAI` (or `OpenAI`). Each completion the server returns
carries a ``completion_id``; an `Episode` collects those of one episode, in order, with its reward.
`Client.gather` runs your rollout function G times per scenario, concurrently (the server batches the
requests), and `Client.train` posts the groups: the server rebuilds each trajectory from the tokens it
sampled and runs the configured objective's updates on the live policy (docs/agents.md).

>>> client = Client("http://127.0.0.1:8000/v1")  # doctest: +SKIP
>>> async def rollout(openai, scenario):  # doctest: +SKIP
...     trajectory = Episode()
...     reply = await openai.chat.completions.create(model=client.model, messages=[...])
...     trajectory.add(reply)
...     trajectory.reward = score(reply.choices[0].message.content, scenario)
...     return trajectory
>>> groups = asyncio.run(client.gather(rollout, scenarios, group_size=8))  # doctest: +SKIP
>>> client.train(groups)["metrics"]["reward_mean"]  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import os
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import openai


def completion_id(response: Any, choice: int = 0) -> str:
    """The gspo completion id of a choice of a chat or text completion (a response object, a choice, a
    message, or their dicts)."""
    item = response
    if isinstance(item, dict):
        item = item["choices"][choice] if "choices" in item else item
        found = item.get("completion_id") or (item.get("message") or {}).get("completion_id")
    else:
        choices = getattr(item, "choices", None)
        item = choices[choice] if choices else item
        found = getattr(item, "completion_id", None) or getattr(
            getattr(item, "message", None), "completion_id", None
        )
    if not isinstance(found, str):
        raise ValueError("no completion_id in this response: is it an answer of `gspo serve`?")
    return found


@dataclass
class Episode:
    """One episode: the completion ids of its turns (in order) and its reward.

    turn_rewards: optional, one per turn, for per-turn advantages; metrics: your own numbers, averaged by
    `Client.gather`'s summary.
    """

    completion_ids: list[str] = field(default_factory=list)
    reward: float = 0.0
    turn_rewards: list[float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, response: Any, choice: int = 0) -> None:
        """Record the turn a response (or choice) is."""
        self.completion_ids.append(completion_id(response, choice))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"completion_ids": list(self.completion_ids), "reward": float(self.reward)}
        if self.turn_rewards is not None:
            out["turn_rewards"] = [float(r) for r in self.turn_rewards]
        return out


@dataclass
class EpisodeGroup:
    """The trajectories of one scenario: advantages compare them with each other."""

    trajectories: list[Episode] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"trajectories": [t.to_json() for t in self.trajectories]}


def group_json(group: EpisodeGroup | Mapping[str, Any]) -> dict[str, Any]:
    """A group as the train call's JSON: an EpisodeGroup, or the mapping docs/agents.md shows,
    ``{"trajectories": [{"completion_ids": [...], "reward": r}, ...]}``, whose trajectories may be Episodes
    too. The server checks every field (a refusal is a 400 naming it)."""
    if isinstance(group, EpisodeGroup):
        return group.to_json()
    if isinstance(group, Mapping) and isinstance(group.get("trajectories"), (list, tuple)):
        episodes = [t.to_json() if isinstance(t, Episode) else t for t in group["trajectories"]]
        return {**group, "trajectories": episodes}
    raise TypeError(
        f"a group is an EpisodeGroup or a mapping {{'trajectories': [...]}}, got {type(group).__name__}"
    )


_RENAMED = {"Trajectory": Episode, "TrajectoryGroup": EpisodeGroup}


def __getattr__(name: str) -> Any:
    """The names before 0.2 (gspo.Trajectory is a chat conversation; the client's record is an Episode)."""
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"gspo.client.{name} is now gspo.client.{new.__name__}; the old name goes in a later release",
            DeprecationWarning,
            stacklevel=2,
        )
        return new
    raise AttributeError(f"module 'gspo.client' has no attribute {name!r}")


Group = EpisodeGroup | Mapping[str, Any]
"""What Client.train takes per group: an EpisodeGroup, or its JSON's mapping (docs/agents.md)."""

Rollout = Callable[[openai.AsyncOpenAI, Any], Awaitable[Episode]]
"""Your agent: (the async client, a scenario) -> a finished Episode with its reward."""


class Client:
    """The server at `base_url` (its API root, ".../v1"); `api_key` defaults to $GSPO_API_KEY.

    openai / async_openai: official SDK clients for your agent; model: the served model's name.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
    ):
        self._settings = {
            "base_url": base_url,
            "api_key": api_key or os.environ.get("GSPO_API_KEY") or "no-key",
        }
        self._settings["timeout"] = timeout
        self.openai = openai.OpenAI(**self._settings)
        self._async: tuple[asyncio.AbstractEventLoop | None, openai.AsyncOpenAI] | None = None
        self._model: str | None = None

    @property
    def async_openai(self) -> openai.AsyncOpenAI:
        """An async client for the running event loop (a new one per loop: each asyncio.run has its own).
        `gather` and `atrain` use clients of their own, closed before their loop ends; close this one
        (``await client.async_openai.close()``) before yours does if you call it across asyncio.run calls."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if self._async is None or (loop is not None and self._async[0] not in (None, loop)):
            self._async = (loop, openai.AsyncOpenAI(**self._settings))
        elif self._async[0] is None and loop is not None:
            self._async = (loop, self._async[1])
        return self._async[1]

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.openai.models.list().data[0].id
        return self._model

    async def gather(
        self,
        rollout: Rollout,
        scenarios: Iterable[Any],
        group_size: int,
        *,
        max_exceptions: int = 0,
    ) -> list[EpisodeGroup]:
        """`group_size` rollouts of each scenario, all at once; a group per scenario. A rollout that raises
        is dropped (and its group if fewer than two are left: a group of one trains nothing) up to
        `max_exceptions` of them, then the error is raised.
        Each rollout gets the same scenario object: build the episode's own state from it (rollouts that
        change one shared environment corrupt each other's episodes)."""
        scenarios = list(scenarios)
        # a client of this call's own, closed in the loop that made it: `asyncio.run(client.gather(...))`
        # once per step leaves no connection of a closed loop behind ("Event loop is closed")
        async with openai.AsyncOpenAI(**self._settings) as agent:
            tasks = [[rollout(agent, s) for _ in range(group_size)] for s in scenarios]
            results = await asyncio.gather(*(t for group in tasks for t in group), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if len(failed) > max_exceptions:
            raise failed[0]
        groups = []
        for j in range(len(scenarios)):
            kept = [r for r in results[j * group_size : (j + 1) * group_size] if isinstance(r, Episode)]
            if len(kept) >= 2:
                groups.append(EpisodeGroup(kept))
        return groups

    def train(self, groups: Iterable[Group], *, request_id: str | None = None) -> dict[str, Any]:
        """One train call on `groups` (EpisodeGroups, or mappings as the train call's JSON: `group_json`);
        returns the server's answer (version, metrics, split trajectories). A request id makes retries
        safe: the server applies a call once however often it arrives."""
        body = {"groups": [group_json(g) for g in groups], "request_id": request_id or uuid.uuid4().hex}
        return self.openai.post("/train", body=body, cast_to=object)

    async def atrain(self, groups: Iterable[Group], *, request_id: str | None = None) -> dict[str, Any]:
        body = {"groups": [group_json(g) for g in groups], "request_id": request_id or uuid.uuid4().hex}
        async with openai.AsyncOpenAI(**self._settings) as server:  # closed in this loop, as `gather`'s
            return await server.post("/train", body=body, cast_to=object)

    def status(self) -> dict[str, Any]:
        return self.openai.get("/status", cast_to=object)

    def checkpoint(self) -> dict[str, Any]:
        return self.openai.post("/checkpoint", cast_to=object)
