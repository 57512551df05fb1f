"""gspo.integrations.verifiers: a verifiers v1 environment (a taskset defined here, the real verifiers
package, its local subprocess runtime) trains through `gspo serve` on the tiny model, single-turn and
multi-turn; the trained tokens are the sampled ones; an error in the environment's code stops the step
like a reward function's. Skipped without verifiers (pip install 'gspo[verifiers]')."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

vf = pytest.importorskip("verifiers.v1", reason="needs pip install 'gspo[verifiers]' (verifiers)")

import gspo.learning.step as serve_step  # noqa: E402
from conftest import run_example_smoke, tiny_config  # noqa: E402
from gspo.client import Client  # noqa: E402
from gspo.integrations.verifiers import harness_config, model_context, rollouts, train_step  # noqa: E402
from gspo.integrations.verifiers_harness import CALLS  # noqa: E402
from gspo.rewards.calling import RewardError  # noqa: E402
from gspo.serve.server import build_service, start_in_thread  # noqa: E402

__all__ = ["DigitsTaskset"]  # this module is the taskset plugin the envs below load (its id: __name__)

QUESTIONS = ["What is 2+3?", "What is 4+1?"]


class DigitsData(vf.TaskData):
    broken: bool = False


class DigitsTask(vf.Task[DigitsData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        """How many digits the answers hold: a signal a random model gets."""
        if self.data.broken:
            raise ZeroDivisionError("the reward's own bug")
        return float(sum(c.isdigit() for m in trace.assistant_messages for c in m.content or ""))


class DigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self) -> Iterator[DigitsTask]:
        for question in QUESTIONS:
            yield DigitsTask(DigitsData(prompt=question), self.config.task)


class TwoTurnEnv(vf.SingleAgentEnv):
    """Multi-turn: the env is the user, answering each reply with "Again."."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            await chat.turn("Again.")


def make_env(kind: type[vf.SingleAgentEnv]) -> vf.SingleAgentEnv:
    agent = vf.AgentConfig(harness=harness_config(), runtime=vf.SubprocessConfig())
    return kind(vf.SingleAgentEnvConfig(taskset=vf.TasksetConfig(id=__name__), agent=agent))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    running = start_in_thread(
        build_service(tiny_config(tmp_path_factory.mktemp("vf") / "run", "serve.slots=8"))
    )
    yield running
    running.stop()


def capture_batches(monkeypatch: pytest.MonkeyPatch) -> list:
    seen: list = []
    real = serve_step.learn

    def learn(policy, spec, batch, *, seed):
        seen.append(batch)
        return real(policy, spec, batch, seed=seed)

    monkeypatch.setattr(serve_step, "learn", learn)
    return seen


@pytest.mark.parametrize("kind, turns", [(vf.SingleAgentEnv, 1), (TwoTurnEnv, 2)], ids=["single", "multi"])
def test_an_environment_trains_on_its_own_rewards_with_the_sampled_tokens(server, monkeypatch, kind, turns):
    seen = capture_batches(monkeypatch)
    env = make_env(kind)
    client = Client(server.url)
    version = server.service.trainer.version

    async def main():
        async with env.serving():
            return await train_step(
                env,
                client,
                list(env.taskset),
                group_size=4,
                sampling=vf.Sampling(max_tokens=4, temperature=1.0),
            )

    answer = asyncio.run(main())
    assert answer["version"] == version + 1
    traces = [t for group in answer["episodes"] for e in group for t in e.traces]
    assert len(traces) == 8 and all(t.ok for t in traces)
    metrics = answer["metrics"]
    assert (metrics["trajectories"], metrics["turns"]) == (8, 8 * turns)
    assert (metrics["split_trajectories"], metrics["old_logprobs_recomputed"]) == (0, 0)
    # the env's own reward (weight 0.5 of the digits in the trace's answers) is what trained
    rewards = [0.5 * sum(c.isdigit() for m in t.assistant_messages for c in m.content or "") for t in traces]
    assert [t.reward for t in traces] == rewards
    assert metrics["reward_mean"] == pytest.approx(sum(rewards) / 8)
    # the trained sequences are the sampled ones: the last call's prompt and completion, bit for bit, and
    # every sampled token trained with the sampler's log-prob
    (batch,) = seen
    trained = {tuple(s.prompt_ids + s.completion_ids): i for i, s in enumerate(batch.sequences)}
    for trace in traces:
        calls = trace.info[CALLS]
        assert len(calls) == turns and len(trace.assistant_messages) == turns
        i = trained[tuple(calls[-1]["prompt_token_ids"] + calls[-1]["token_ids"])]
        mask = batch.sequences[i].train_mask
        sampled = [lp for call in calls for lp in call["token_logprobs"]]
        assert [lp for lp, t in zip(batch.sampler_logprobs[i], mask, strict=True) if t] == sampled


def test_an_error_in_the_environments_code_stops_the_step_like_a_reward_functions(server, monkeypatch):
    seen = capture_batches(monkeypatch)
    env = make_env(vf.SingleAgentEnv)
    client = Client(server.url)
    version = server.service.trainer.version
    tasks = list(env.taskset)
    tasks[1] = DigitsTask(DigitsData(prompt=QUESTIONS[1], idx=1, broken=True), tasks[1].config)

    async def main():
        async with env.serving():
            await train_step(env, client, tasks, group_size=2, sampling=vf.Sampling(max_tokens=4))

    with pytest.raises(RewardError) as caught:
        asyncio.run(main())
    message = str(caught.value)
    assert message.startswith("verifiers environment failed at task 1 (group 1), episode 0: TaskError:")
    assert "ZeroDivisionError" in message and "the reward's own bug" in message
    assert "nothing of this batch was trained" in message
    assert seen == [] and server.service.trainer.version == version


def test_a_server_key_reaches_the_server_through_verifiers_from_gspo_api_key(tmp_path, monkeypatch):
    running = start_in_thread(build_service(tiny_config(tmp_path / "run"), key="k3y"))
    try:
        monkeypatch.delenv("GSPO_API_KEY", raising=False)
        with pytest.raises(ValueError, match=r"\$GSPO_API_KEY: set it"):
            model_context(Client(running.url, api_key="k3y"))
        env = make_env(vf.SingleAgentEnv)
        (task, _) = list(env.taskset)

        async def main(context):
            async with env.serving():
                return await rollouts(env, [task], context, 1)

        monkeypatch.setenv("GSPO_API_KEY", "k3y")  # the server refuses a call without it (401)
        ((episode,),) = asyncio.run(main(model_context(Client(running.url))))
        assert episode.ok and len(episode.traces[0].info[CALLS]) == 1
    finally:
        running.stop()


def test_the_example_trains_the_taskset_it_ships_in_its_smoke_mode(tmp_path):
    """examples/verifiers_sums/train.py --smoke: its own taskset (sums_taskset.py) and in-process `gspo serve`
    on the tiny model, the held-out accuracy measured, one step trained (15 s here)."""
    done = run_example_smoke("verifiers_sums", tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["step"] for row in results["train"]] == [1]
    assert {"accuracy_before", "accuracy_after"} <= set(results)
    assert "held-out accuracy: " in done.stdout
    completions = (tmp_path / "run" / "completions.jsonl").read_text().splitlines()
    assert len(completions) == 2 * 2  # the step's 2 tasks x 2 episodes, logged by the server
