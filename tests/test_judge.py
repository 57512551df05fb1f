"""The LLM judge as a reward (gspo.rewards.judge), against a small OpenAI-compatible server on loopback: one
chat completion per group, the request it sends (the template filled with the prompt and the numbered
completions), the scores it parses, in order, and the one line of an answer it cannot use."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gspo.config import ConfigError, load_config
from gspo.rewards.calling import RewardError
from gspo.rewards.judge import Judge, groups_of, parse_scores
from gspo.rewards.resolve import resolve_rewards
from gspo.rewards.scoring import compute_rewards

TEMPLATE = """Judge the answers to: $prompt

$completions

Give each of the $n answers a score in [0, 1], as JSON: {"scores": [...]}.
"""


class JudgeServer:
    """A chat-completions endpoint that records each request and answers with `answer(request)`."""

    def __init__(self, answer) -> None:
        self.requests: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
                content = outer.answer(body)
                reply = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", "judge"),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": "stop",
                        }
                    ],
                }
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.answer = answer
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def _by_length(body: dict) -> str:
    """Scores the numbered answers by their length, longest 1.0, after some reasoning text."""
    message = body["messages"][0]["content"]
    answers = [block.split("\n", 1)[1] for block in message.split("--- ")[1:]]
    answers = [a.split("\n\nGive each")[0].strip() for a in answers]
    longest = max(len(a) for a in answers)
    return "Thinking... " + json.dumps({"scores": [round(len(a) / longest, 3) for a in answers]})


@pytest.fixture
def server() -> Iterator[JudgeServer]:
    running = JudgeServer(_by_length)
    yield running
    running.close()


PROMPTS = ["What is 2+3?"] * 3 + ["Name a colour."] * 2
COMPLETIONS = ["5", "It is 5.", "five", "blue", "a deep blue"]
GROUPS = [0, 0, 0, 1, 1]


def test_each_group_is_judged_in_one_request_and_its_scores_come_back_in_order(
    server, tmp_path: Path
) -> None:
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    judge = Judge(server.url, template, model="referee", api_key="sk-test", max_tokens=64)
    _, per_function = compute_rewards([("judge", judge, 1.0)], PROMPTS, COMPLETIONS, {}, group_ids=GROUPS)
    assert per_function["judge"].tolist() == pytest.approx([0.125, 1.0, 0.5, 4 / 11, 1.0], abs=1e-3)
    assert len(server.requests) == 2  # one call per group
    by_prompt = {r["messages"][0]["content"].split("\n")[0]: r for r in server.requests}
    first = by_prompt["Judge the answers to: What is 2+3?"]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer sk-test"
    assert (first["model"], first["max_tokens"], first["temperature"]) == ("referee", 64, 0.0)
    assert "--- 1\n5\n--- 2\nIt is 5.\n--- 3\nfive" in first["messages"][0]["content"]
    assert "Give each of the 3 answers" in first["messages"][0]["content"]
    # structured outputs: the answer's schema, 3 numbers in [0, 1], as OpenAI's API takes it
    schema = first["response_format"]["json_schema"]["schema"]
    assert first["response_format"]["type"] == "json_schema"
    assert schema["properties"]["scores"] == {
        "type": "array",
        "items": {"type": "number", "minimum": 0, "maximum": 1},
        "minItems": 3,
        "maxItems": 3,
    }
    assert schema["required"] == ["scores"]
    # JSON mode with the schema beside it, as llama-cpp-python's server takes it; none for gspo serve
    mode = Judge(server.url, template, response_format="json_object").request("What is 2+3?", ["5", "6"])
    assert mode["response_format"] == {
        "type": "json_object",
        "schema": {
            **schema,
            "properties": {"scores": {**schema["properties"]["scores"], "minItems": 2, "maxItems": 2}},
        },
    }
    plain = Judge(server.url, template, response_format="none").request("What is 2+3?", ["5"])
    assert "response_format" not in plain


def test_the_template_may_name_the_examples_fields_and_an_unknown_one_is_one_line(
    server, tmp_path: Path
) -> None:
    """$answer, a reference for the judge, is the group's own; a name the examples lack stops the run."""
    template = tmp_path / "judge.txt"
    template.write_text("The right answer is $answer.\n" + TEMPLATE)
    judge = Judge(server.url, template)
    answers = ["5"] * 3 + ["blue"] * 2
    compute_rewards(
        [("judge", judge, 1.0)], PROMPTS, COMPLETIONS, {"answer": answers, "level": [1] * 5}, group_ids=GROUPS
    )
    firsts = sorted(r["messages"][0]["content"].split("\n")[0] for r in server.requests)
    assert firsts == ["The right answer is 5.", "The right answer is blue."]
    with pytest.raises(
        RewardError,
        match=r"judge.template names \$answer, which the examples do not have: "
        r".*\(level\)",
    ):
        compute_rewards([("judge", judge, 1.0)], PROMPTS, COMPLETIONS, {"level": [1] * 5}, group_ids=GROUPS)


def test_an_answer_without_usable_scores_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    for answer, why in (
        ("I like them all.", 'no JSON object with "scores"'),
        ('{"scores": [0.5]}', r'"scores" holds \[0\.5\], not 3 numbers'),
        ('{"scores": [0.5, 2, 0.1]}', r'"scores" \[0\.5, 2, 0\.1\] are not numbers in \[0, 1\]'),
    ):
        running = JudgeServer(lambda body, answer=answer: answer)
        try:
            judge = Judge(running.url, template)
            with pytest.raises(
                RewardError, match=f"the judge at {running.url} answered without usable scores \\({why}"
            ):
                compute_rewards(
                    [("judge", judge, 1.0)], PROMPTS[:3], COMPLETIONS[:3], {}, group_ids=GROUPS[:3]
                )
        finally:
            running.close()


def test_two_adjacent_groups_of_one_prompt_are_judged_apart(server, tmp_path: Path) -> None:
    """Groups come with their ids: two groups of the same prompt side by side (dynamic sampling may draw a
    prompt again) are two requests, each judging its own completions against each other."""
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    judge = Judge(server.url, template)
    prompts, completions = ["What is 2+3?"] * 4, ["5", "It is 5.", "five", "5!"]
    _, per_function = compute_rewards(
        [("judge", judge, 1.0)], prompts, completions, {}, group_ids=[0, 0, 1, 1]
    )
    assert len(server.requests) == 2
    assert [r["messages"][0]["content"].count("--- ") for r in server.requests] == [2, 2]
    # each group's longest answer scores 1: "It is 5." in the first, "five" in the second
    assert per_function["judge"].tolist() == pytest.approx([0.125, 1.0, 1.0, 0.5], abs=1e-3)


def test_groups_and_scores_are_read_as_documented() -> None:
    assert groups_of([0, 0, 1, 0, 2]) == [[0, 1, 3], [2], [4]]
    assert parse_scores('first {"scores": [0.2]} then {"note": 1} and {"scores": [1, 0]}', 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not numbers in"):
        parse_scores('{"scores": [true, 0]}', 2)


def test_the_config_names_the_judge(server, tmp_path: Path) -> None:
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(f"rewards: {{judge: 1.0}}\njudge:\n  url: {server.url}\n  template: judge.txt\n")
    config = load_config(config_file)
    assert config.judge.template == str(template)  # read relative to the config file's folder
    ((name, function, _),) = resolve_rewards(config, None)
    _, per_function = compute_rewards(
        [(name, function, 1.0)], PROMPTS[3:], COMPLETIONS[3:], {}, group_ids=GROUPS[3:]
    )
    assert per_function["judge"].tolist() == pytest.approx([4 / 11, 1.0], abs=1e-3)
    with pytest.raises(ConfigError, match=r"rewards names judge: set judge\.url and judge\.template"):
        load_config(None, ["rewards={judge: 1.0}"])
    (tmp_path / "bad.txt").write_text("Judge: $completions")
    with pytest.raises(ValueError, match=r"names no \$prompt"):
        Judge(server.url, tmp_path / "bad.txt")


def test_the_judge_example_trains_against_a_judge_on_loopback(tmp_path: Path) -> None:
    """examples/judge/config.yaml and judge.txt, as run.sh runs them, on the tiny model: each group is one
    request built from the example's template, and the judge's scores are the run's only reward."""
    from gspo import train

    def digits_first(body: dict) -> str:
        blocks = body["messages"][0]["content"].split("\n\nReply with JSON")[0].split("--- ")[1:]
        answers = [block.split("\n", 1)[1].strip() if "\n" in block else "" for block in blocks]
        return json.dumps({"scores": [float(a[:1].isdigit()) for a in answers]})

    running = JudgeServer(digits_first)
    try:
        example = Path(__file__).resolve().parents[1] / "examples" / "judge" / "config.yaml"
        overrides = [f"output_dir={tmp_path / 'run'}", f"judge.url={running.url}", "model.tiny=llama"]
        overrides += ["train.steps=2", "eval.every=0", "task.num_eval=4", "rollout.prompts_per_step=2"]
        overrides += ["rollout.dynamic_sampling=false"]  # a flat group would be drawn again: a request more
        result = train(load_config(example, overrides))
    finally:
        running.close()
    # 2 groups a batch, 2 batches; at the first and last evaluation each of the 4 held-out prompts alone
    sizes = sorted(r["messages"][0]["content"].count("\n--- ") for r in running.requests)
    assert sizes == [1] * 8 + [8] * 4
    assert all('Reply with JSON: {"scores": [...]}' in r["messages"][0]["content"] for r in running.requests)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["kind"] == "train"]
    assert [r["reward_mean"] for r in trained] == [r["reward/judge"] for r in trained]  # the only weight
    assert result["eval_accuracy_last"] is not None


class RawServer:
    """An endpoint that answers every POST with a status, headers and body of the test's choosing, and
    records the paths and hosts it was asked on."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.paths: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                outer.paths.append(self.path)
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET = _answer

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def _judged(url: str, tmp_path: Path) -> None:
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    judge = Judge(url, template, api_key="sk-secret")
    compute_rewards([("judge", judge, 1.0)], PROMPTS[:3], COMPLETIONS[:3], {}, group_ids=GROUPS[:3])


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_the_judge_follows_no_redirect(tmp_path: Path, status: int) -> None:
    """A judge that redirects: nothing goes to the other origin (no prompt, no completion, no key), and the
    line names the redirect and the fix."""
    elsewhere = RawServer(200, b'{"choices": [{"message": {"content": "{\\"scores\\": [1, 1, 1]}"}}]}')
    judge = RawServer(status, b"", {"Location": elsewhere.url + "/chat/completions"})
    try:
        with pytest.raises(
            RewardError, match=rf"the judge at {judge.url} answered with a redirect \(HTTP {status} to "
        ):
            _judged(judge.url, tmp_path)
        assert elsewhere.paths == [] and judge.paths == ["/v1/models", "/v1/chat/completions"]
    finally:
        judge.close()
        elsewhere.close()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"choices": [', "not JSON"),
        (b"<html><body>502 Bad Gateway</body></html>", "not JSON"),
        (b"[1, 2, 3]", "not a chat completion \\(a list"),
        (b'{"id": "x", "object": "chat.completion"}', "not a chat completion \\(a keys \\['id', 'object'\\]"),
        (b'{"choices": [{"message": {"content": ["a"]}}]}', "content is a list, not text"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        (b"x" * (5 * 2**20), "more than 4,194,304 bytes"),
    ],
    ids=["truncated", "html", "list", "no-choices", "content-list", "deep", "huge"],
)
def test_every_malformed_judge_answer_is_one_line_naming_the_url(
    tmp_path: Path, body: bytes, why: str
) -> None:
    server = RawServer(200, body, {"Content-Type": "application/json"})
    try:
        with pytest.raises(RewardError, match=rf"the judge at {server.url} answered .*{why}"):
            _judged(server.url, tmp_path)
    finally:
        server.close()
