"""verifiers v1 environments trained by gspo: a v1 `Env`'s episodes run against the live policy of one
`gspo serve`, are scored by the environment's own reward functions, and train as GSPO groups.

How a trainer drives v1: prime-rl's orchestrator spawns verifiers' env server (`verifiers.v1.serve`) and asks
it for rollouts by task index, with a `TrainClientConfig` that points at vLLM; that server runs, inside
`env.serving()`, `env.run_slot(slot, ModelContext(model, client, sampling))`. gspo calls the same in its own
process (no server, no ZMQ). An episode runs the env's agents, each
a harness program whose model calls go through verifiers' interception server to the `client` endpoint,
then scores each trace with the task's `@reward`s. Here the endpoint is `gspo serve`'s OpenAI API
(`EvalClientConfig`: verifiers relays the server's JSON to the harness unchanged), and the agents' harness
is `harness_config()`: gspo.integrations.verifiers_harness, a chat program in this process that keeps, in `trace.info["gspo"]`, each call's
`completion_id` and the exact prompt and completion token ids and log-probs the server sampled. A trace
becomes a `gspo.client.Episode` (its completion ids in order, its reward `trace.reward`: the weighted sum
of the task's rewards), an env episode's traces one group member each, and `Client.atrain` runs one step
of the server's objective on the groups: the trained tokens are the sampled ones.

Why a harness of gspo's own: verifiers' built-in harnesses run their chat program as a uv script, which
fetches its dependencies from PyPI at the first episode (no network on many training machines), and they
never see the completion ids; its `TrainClientConfig` path needs a vLLM `/inference/v1/generate` endpoint.
The interception contract allows an in-process loop (`Harness.launch`'s docstring), and
`SUPPORTS_RESUME` lets a multi-turn env (`agent.interaction(task)`) continue the conversation turn by turn.

An episode that failed (an error in the env's `run`/`finalize`, a task's reward or metric raising, the
harness or the server failing) is treated like a reward function raising in
`gspo train`: `RewardError` names the task, the episode and verifiers' error line, and nothing of that
batch is trained (the server keeps every step already taken).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gspo.client import Client, Episode, EpisodeGroup
from gspo.rewards.calling import RewardError

if TYPE_CHECKING:
    import verifiers.v1 as vf


def _import_verifiers() -> Any:
    """verifiers.v1 and gspo's harness plugin, imported on first use (the package is an optional extra)."""
    try:
        import verifiers.v1 as vf

        import gspo.integrations.verifiers_harness  # noqa: F401  (registers the harness id)
    except ImportError as error:
        raise ImportError(
            f"gspo.integrations.verifiers needs verifiers: pip install 'gspo[verifiers]' ({error})"
        ) from None
    return vf


def harness_config() -> vf.HarnessConfig:
    """The agent's harness for training through gspo: `vf.AgentConfig(harness=harness_config(), ...)`."""
    vf = _import_verifiers()
    from gspo.integrations.verifiers_harness import HARNESS_ID

    return vf.HarnessConfig(id=HARNESS_ID)


def model_context(client: Client, sampling: vf.Sampling | None = None) -> vf.ModelContext:
    """The ModelContext that points an env's agents at `client`'s server (its key from $GSPO_API_KEY)."""
    if client.openai.api_key not in ("no-key", os.environ.get("GSPO_API_KEY")):
        # verifiers' client sends the key of an environment variable, after any header of ours
        raise ValueError("model_context: verifiers reads the server's API key from $GSPO_API_KEY: set it")
    vf = _import_verifiers()
    config = vf.EvalClientConfig(base_url=str(client.openai.base_url), api_key_var="GSPO_API_KEY")
    return vf.ModelContext(model=client.model, client=config, sampling=sampling or vf.Sampling())


async def rollouts(
    env: vf.Env, tasks: Sequence[vf.Task], context: vf.ModelContext, group_size: int
) -> list[list[vf.Episode]]:
    """`group_size` episodes of each task, all at once (inside `env.serving()`), as verifiers' env server
    runs them for prime-rl: planned by `env.slots`, each retried whole per the env's `retries`."""
    slots = [slot for task in tasks for slot in env.slots(task, group_size)]
    episodes = await asyncio.gather(*(env.run_slot(slot, context) for slot in slots))
    return [list(episodes[i : i + group_size]) for i in range(0, len(episodes), group_size)]


def episode_groups(groups: Iterable[Sequence[vf.Episode]]) -> list[EpisodeGroup]:
    """gspo groups of scored v1 episodes: each trace that called the model is one trajectory (its
    completion ids, its reward). A failed episode raises RewardError (module docstring)."""
    from gspo.integrations.verifiers_harness import CALLS

    out = []
    for g, group in enumerate(groups):
        members = []
        for e, episode in enumerate(group):
            where = f"task {episode.task.data.idx} (group {g}), episode {e}"
            # `ok`, not the errors: an episode or agent run that a retry saved keeps the earlier errors
            if not episode.ok:
                failure = episode.last_error or next((t.errors[-1] for t in episode.traces if t.errors), None)
                line = f"{failure.type}: {failure.message}" if failure else "the episode is not ok"
                raise RewardError(
                    f"verifiers environment failed at {where}: {line}; nothing of this batch was trained: "
                    "fix the environment, then run again"
                )
            for trace in episode.traces:
                calls = trace.info.get(CALLS, [])
                if calls:
                    ids = [call["completion_id"] for call in calls]
                    members.append(Episode(ids, float(trace.reward), metrics=_numbers(trace.metrics)))
        out.append(EpisodeGroup(members))
    return out


def _numbers(metrics: dict[str, float | None]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items() if value is not None}


async def train_step(
    env: vf.Env,
    client: Client,
    tasks: Sequence[vf.Task],
    *,
    group_size: int,
    sampling: vf.Sampling | None = None,
) -> dict[str, Any]:
    """One GSPO step: `group_size` episodes of each task against the live policy, scored by the env, trained
    by the server. Call inside `env.serving()`. Returns the server's answer (version, metrics) and the
    episodes (``answer["episodes"]``)."""
    groups = await rollouts(env, tasks, model_context(client, sampling), group_size)
    answer = await client.atrain(episode_groups(groups))
    return {**answer, "episodes": groups}
