"""gspo serve's train calls follow `gspo train`'s rules: a completion is trained once, a group holds two
trajectories or more, rewards fit float32, and JSON booleans are not numbers; the real server (uvicorn on
127.0.0.1) on the tiny model. Every refusal is a 400 naming the field and changes nothing. A served run
is continued with `gspo serve --resume`."""

from __future__ import annotations

import httpx
import pytest

from conftest import TINY, tiny_config
from gspo.cli import main
from gspo.serve.server import build_service, start_in_thread

QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    running = start_in_thread(build_service(tiny_config(tmp_path_factory.mktemp("rules") / "run")))
    yield running
    running.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _completions(server, n: int) -> list[str]:
    body = {"model": "gspo", "messages": QUESTION, "max_tokens": 3, "n": n}
    return [c["completion_id"] for c in _post(server, "/chat/completions", body).json()["choices"]]


def _group(ids: list[str], rewards: list[float] | None = None) -> dict:
    rewards = rewards if rewards is not None else [float(r) for r in range(len(ids))]
    return {"trajectories": [{"completion_ids": [i], "reward": r} for i, r in zip(ids, rewards, strict=True)]}


def _refused(server, path: str, body: dict, param: str, code: str | None = None) -> str:
    version = server.service.trainer.version
    response = _post(server, path, body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, (param, response.status_code, error)
    assert code is None or error["code"] == code, error
    assert server.service.trainer.version == version
    return error["message"]


def test_a_completion_is_trained_once_across_train_calls(server) -> None:
    ids = _completions(server, 2)
    first = _post(server, "/train", {"groups": [_group(ids)], "request_id": "call-a"}).json()
    assert first["version"] == server.service.trainer.version
    # the same call again is its stored answer; the same completions under another id are refused
    assert _post(server, "/train", {"groups": [_group(ids)], "request_id": "call-a"}).json()["repeated"]
    # the same id with other groups: a 409 that says they were not trained (it returned the old answer)
    other = _post(server, "/train", {"groups": [_group(_completions(server, 2))], "request_id": "call-a"})
    error = other.json()["error"]
    assert (other.status_code, error["code"], error["param"]) == (409, "request_id_reused", "request_id")
    assert "these groups were not trained" in error["message"]
    assert server.service.trainer.version == first["version"]
    for request_id in ("call-b", None):
        message = _refused(
            server,
            "/train",
            {"groups": [_group(ids)], "request_id": request_id},
            "groups[0].trajectories[0].completion_ids[0]",
            "trained_completion",
        )
        assert f"trained already (the update to policy version {first['version']})" in message
    # one trained completion spoils the call: nothing of it is trained
    fresh = _completions(server, 2)
    _refused(
        server,
        "/train",
        {"groups": [_group(fresh), _group([ids[1], fresh[0]])]},
        "groups[1].trajectories[0].completion_ids[0]",
    )
    assert _post(server, "/train", {"groups": [_group(fresh)]}).json()["version"] == first["version"] + 1


def test_a_group_of_one_trajectory_is_refused_unless_its_advantages_are_given(server) -> None:
    ids = _completions(server, 3)
    message = _refused(
        server,
        "/train",
        {"groups": [_group(ids[:2]), _group(ids[2:])]},
        "groups[1].trajectories",
        "group_of_one",
    )
    assert "a group of 1 trajectory trains nothing" in message
    # advantages given: the client's own, no group to compare with, so the group of one trains
    tokens = len(server.service.inference.records.get(ids[2]).completion_ids)
    lone = {"trajectories": [{"completion_ids": [ids[2]], "reward": 1.0, "advantages": [[0.5] * tokens]}]}
    version = server.service.trainer.version
    assert _post(server, "/train", {"groups": [lone]}).json()["version"] == version + 1


def test_rewards_beyond_float32_are_a_400_naming_the_field(server) -> None:
    ids = _completions(server, 2)
    tokens = len(server.service.inference.records.get(ids[0]).completion_ids)
    where = "groups[0].trajectories[0]"
    other = len(server.service.inference.records.get(ids[1]).completion_ids)
    cases = [
        (f"{where}.reward", {"reward": 1e39}),
        (f"{where}.reward", {"reward": -1e39}),
        (f"{where}.turn_rewards[0]", {"turn_rewards": [1e39]}),
        (f"{where}.turn_rewards", {"turn_rewards": [3e38], "reward": 3e38}),  # each fits, their sum not
        (f"{where}.advantages[0][0]", {"advantages": [[1e39] * tokens]}),
    ]
    for param, change in cases:
        group = _group(ids)
        group["trajectories"][0] |= change
        if "advantages" in change:
            group["trajectories"][1]["advantages"] = [[0.0] * other]
        assert "float32" in _refused(server, "/train", {"groups": [group]}, param)
    assert server.service.trainer.status()["last_error"] is None  # refused, not failed
    assert _post(server, "/train", {"groups": [_group(ids, [3e38, -3e38])]}).status_code == 200


def test_json_booleans_are_not_numbers(server) -> None:
    chat = {"model": "gspo", "messages": QUESTION, "max_tokens": 2}
    for field in ("max_tokens", "n", "temperature", "seed", "top_p"):
        _refused(server, "/chat/completions", chat | {field: True}, field)
    _refused(server, "/chat/completions", chat | {"stream": 1}, "stream")
    _refused(server, "/completions", {"model": "gspo", "prompt": [5, True], "max_tokens": 2}, "prompt")
    ids = _completions(server, 2)
    group = _group(ids)
    group["trajectories"][0]["reward"] = True
    _refused(server, "/train", {"groups": [group]}, "groups[0].trajectories[0].reward")
    assert (
        _post(server, "/chat/completions", chat | {"max_tokens": 3}).status_code == 200
    )  # numbers still are


def test_a_served_run_folder_is_continued_with_gspo_serve_resume(server, capsys) -> None:
    ids = _completions(server, 2)
    assert _post(server, "/train", {"groups": [_group(ids)]}).status_code == 200  # a checkpoint now
    run = server.service.trainer.run_dir
    assert main(["serve", str(TINY), f"output_dir={run}", "serve.port=0", "tensorboard=false"]) == 5
    err = capsys.readouterr().err
    assert f"already holds a run: continue it with `gspo serve --resume {run}`" in err, err
