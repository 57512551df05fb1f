"""gspo.integrations.art: ART's own client loop (TrainableModel, register, openai_client, Trajectory,
gather_trajectory_groups, backend.train) against `gspo serve` on the tiny model, with the real openpipe-art
package. Skipped without it (pip install 'gspo[art]')."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# art imports litellm, which would fetch a price list over the network
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# `import art` replaces transformers' masking_utils._preprocess_mask_arguments with a transformers-4 signature,
# which breaks every model forward of this pytest process (the other tests' models) under transformers 5: put
# it back. ART's code here is client-side; the server runs in its own process.
from transformers import masking_utils

_preprocess_mask_arguments = masking_utils._preprocess_mask_arguments
art = pytest.importorskip("art", reason="gspo.integrations.art needs pip install 'gspo[art]' (openpipe-art)")
masking_utils._preprocess_mask_arguments = _preprocess_mask_arguments

from openai.types.chat.chat_completion import Choice  # noqa: E402

from conftest import run_example_smoke  # noqa: E402
from gspo.integrations.art import GspoBackend  # noqa: E402
from gspo.run.checkpoint import checkpoint_step, latest_checkpoint  # noqa: E402

SCENARIOS = ["What is 2+3?", "What is 4+1?"]


async def rollout(model: art.TrainableModel, scenario: str, turns: int) -> art.Trajectory:
    """An ART rollout as ART's examples write it: the model's OpenAI client, choices appended to the
    trajectory, a reward at the end (here: how many digits the answers hold, a signal a random model gets)."""
    client = model.openai_client()
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": scenario}], reward=0.0)
    for turn in range(turns):
        chat = await client.chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), max_tokens=4, temperature=1.0
        )
        choice = chat.choices[0]
        trajectory.messages_and_choices.append(choice)
        trajectory.reward += sum(c.isdigit() for c in choice.message.content or "")
        if turn + 1 < turns:
            trajectory.messages_and_choices.append({"role": "user", "content": "Again."})
    trajectory.metrics["turns"] = turns
    return trajectory


def test_an_art_client_loop_trains_through_gspo_serve(tmp_path):
    async def main():
        backend = GspoBackend(
            config="configs/tiny.yaml",
            overrides=[f"output_dir={tmp_path / 'run'}", "report_to=[]", "progress=false", "serve.slots=8"],
        )
        model = art.TrainableModel(
            name="agent", project="gspo-art", base_model="tiny", base_path=str(tmp_path / ".art")
        )
        await model.register(backend)
        assert await model.get_step() == 0
        results = []
        for turns in (1, 2):  # single-turn, then multi-turn trajectories
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, s, turns) for _ in range(4)) for s in SCENARIOS),
                pbar_desc=None,
            )
            results.append((groups, await backend.train(model, groups)))
        step = await model.get_step()
        await backend.close()
        return results, step

    results, step = asyncio.run(main())
    for number, (groups, result) in enumerate(results, start=1):
        rewards = [t.reward for g in groups for t in g.trajectories]
        assert result.step == number
        metrics = result.metrics
        assert (metrics["trajectories"], metrics["turns"]) == (
            8,
            8 * number,
        )  # every choice, by completion id
        # each trajectory one exact sequence (every turn's prompt extends the one before, from the sampled
        # tokens), trained with the sampler's own log-probs as the old policy's
        assert (metrics["segments"], metrics["split_trajectories"], metrics["old_logprobs_recomputed"]) == (
            8,
            0,
            0,
        )
        assert metrics["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert step == 2
    assert checkpoint_step(latest_checkpoint(tmp_path / "run")) == 2  # serve.durable: one per train call


def test_choices_from_elsewhere_and_art_training_arguments_are_refused(tmp_path):
    async def main():
        backend = GspoBackend(
            config="configs/tiny.yaml", overrides=[f"output_dir={tmp_path / 'run'}", "report_to=[]"]
        )
        model = art.TrainableModel(
            name="agent", project="gspo-art", base_model="tiny", base_path=str(tmp_path / ".art")
        )
        await model.register(backend)
        other = Choice(index=0, finish_reason="stop", message={"role": "assistant", "content": "5"})
        foreign = art.TrajectoryGroup(
            [art.Trajectory(messages_and_choices=[{"role": "user", "content": "2+3?"}, other])]
        )
        errors = []
        for call in (
            backend.train(model, [foreign]),
            backend.train(
                model,
                [await art.TrajectoryGroup(rollout(model, "2+3?", 1) for _ in range(2))],
                learning_rate=1e-4,
            ),
        ):
            with pytest.raises((ValueError, TypeError)) as caught:
                await call
            errors.append(str(caught.value))
        step = await model.get_step()
        await backend.close()
        return errors, step

    errors, step = asyncio.run(main())
    assert "trajectory_groups[0].trajectories[0]: a choice without a gspo completion_id" in errors[0]
    assert "learning_rate (train.lr)" in errors[1]
    assert step == 0  # nothing trained


def test_the_tic_tac_toe_example_judges_games_and_has_a_smoke_mode(tmp_path):
    """examples/art_tic_tac_toe/train.py, ART's published example on gspo's backend: its referee on
    hand-made boards, then `--smoke` (the tiny model, one step of 2 games x 2; 30 to 90 s here, under load)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "art_tic_tac_toe" / "train.py"
    spec = importlib.util.spec_from_file_location("art_tic_tac_toe", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    boards = {"x": "xo_xo_x__", "o": "xxo_o_o__", "draw": "xoxxoooxx", None: "xo_______"}
    for expected, cells in boards.items():
        assert example.winner([list(cells[r * 3 : r * 3 + 3]) for r in range(3)]) == expected, cells
    tag, coordinate = example.MOVE_FORMATS["tag"], example.MOVE_FORMATS["coordinate"]
    assert tag.search("<move> C3 </move>").groups() == ("C", "3") and tag.search("I play B2.") is None
    assert coordinate.search("I play B2.").groups() == ("B", "2") and coordinate.search("B22, D1") is None
    run_example_smoke("art_tic_tac_toe", tmp_path)
    (row,) = json.loads((tmp_path / "results.json").read_text())["train"]
    # the tiny random model never writes <move>..</move>: every game ends at its first answer
    assert (row["step"], row["invalid"], row["reward_mean"]) == (1, 1.0, -1.0)


def test_openai_3_under_this_art_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """Under openai 3, ART 0.5.18's model.openai_client() fails on every request in anyio ("float +
    Timeout"); the backend says why and how to fix it instead, and starts no server."""
    import openai

    monkeypatch.setattr(openai, "__version__", "3.57.0")
    with pytest.raises(RuntimeError, match=r"under openai 3\.57\.0 .*: pip install 'openai<3'"):
        GspoBackend(config="configs/tiny.yaml", overrides=[f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_a_server_started_for_a_client_that_dies_stops_with_it(tmp_path):
    """A client that crashes (os._exit, no close) leaves no `gspo serve` behind holding the model."""
    script = (
        "import os\nfrom gspo.integrations.art import start_server\n"
        f"server, url = start_server('configs/tiny.yaml', ['output_dir={tmp_path / 'run'}', 'report_to=[]'])\n"
        "print(server.pid, flush=True)\nos._exit(1)\n"
    )
    # the server's log goes to the client's stderr: not a pipe here, which a live server would hold open
    done = subprocess.run(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=120,
    )
    pid = int(done.stdout.split()[0])
    stat = Path(f"/proc/{pid}/stat")

    def running() -> bool:  # a zombie that nobody reaps (a container's init may not) has stopped
        return stat.exists() and stat.read_text().split()[2] != "Z"

    deadline = time.monotonic() + 60
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    if running():
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"gspo serve {pid} outlived its client")
