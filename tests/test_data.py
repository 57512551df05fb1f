"""Examples, built-in tasks, user data loading, eval split, prompt formatting and the stream of gspo.data."""

from __future__ import annotations

import csv
import json
import re
import sys

import pytest

from gspo.rollout.data import (
    TASKS,
    DataError,
    Example,
    PromptStream,
    arithmetic_task,
    batch_fields,
    count_letter_task,
    format_prompt,
    load_examples,
    split_eval,
)

ARITHMETIC = re.compile(r"What is (.+)\? Answer with just the number\.")
COUNT_LETTER = re.compile(r'How many times does the letter "(.)" appear in the word "(\w+)"\?')


# ---------------------------------------------------------------------------------------------------------
# arithmetic


@pytest.mark.parametrize(
    ("operations", "num_operands", "operand_min", "operand_max"),
    [("+", 2, 0, 9), ("-", 2, 0, 9), ("*", 2, 0, 9), ("+-*", 3, -5, 12), ("-*", 4, 10, 99)],
)
def test_arithmetic_answers_match_python(operations, num_operands, operand_min, operand_max):
    examples = arithmetic_task(
        100,  # all of them for the single-digit cases
        operations=operations,
        num_operands=num_operands,
        operand_min=operand_min,
        operand_max=operand_max,
        seed=3,
    )
    assert len(examples) == 100
    assert len({e.prompt for e in examples}) == 100
    seen_ops = set()
    for example in examples:
        expression = ARITHMETIC.fullmatch(example.prompt).group(1)
        # Python's own parser and precedence are the independent check.
        assert example.fields == {"answer": str(eval(expression))}
        operands = [int(x) for x in re.findall(r"\(?(-?\d+)\)?", expression)]
        assert len(operands) == num_operands
        assert all(operand_min <= x <= operand_max for x in operands)
        ops = re.findall(r" ([-+*]) ", expression)
        assert len(ops) == num_operands - 1 and set(ops) <= set(operations)
        seen_ops.update(ops)
    assert seen_ops == set(operations)


def test_arithmetic_deterministic_per_seed():
    assert arithmetic_task(50, seed=1) == arithmetic_task(50, seed=1)
    assert arithmetic_task(50, seed=1) != arithmetic_task(50, seed=2)


def test_arithmetic_exhausts_the_space_without_repeats():
    # operands 0..2, "+": exactly 3 * 3 = 9 problems.
    examples = arithmetic_task(9, operand_min=0, operand_max=2)
    expressions = {ARITHMETIC.fullmatch(e.prompt).group(1) for e in examples}
    assert expressions == {f"{a} + {b}" for a in range(3) for b in range(3)}
    with pytest.raises(ValueError, match=r"10 examples.*only 9 distinct.*widen the operand range"):
        arithmetic_task(10, operand_min=0, operand_max=2)


def test_arithmetic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="operations"):
        arithmetic_task(1, operations="+/")
    with pytest.raises(ValueError, match="operand_min"):
        arithmetic_task(1, operand_min=5, operand_max=1)
    with pytest.raises(ValueError, match="num_operands"):
        arithmetic_task(1, num_operands=1)


# ---------------------------------------------------------------------------------------------------------
# count_letter


def test_count_letter_answers_are_counts():
    examples = count_letter_task(300, seed=5)
    assert len({e.prompt for e in examples}) == 300
    for example in examples:
        letter, word = COUNT_LETTER.match(example.prompt).groups()
        count = sum(1 for character in word.lower() if character == letter)
        assert count >= 1
        assert example.fields == {"answer": str(count)}
    assert any(int(e.fields["answer"]) >= 3 for e in examples)
    assert count_letter_task(20, seed=5) == count_letter_task(20, seed=5)


def test_count_letter_custom_words_and_limits():
    examples = count_letter_task(4, words=["Noon", "abc"], seed=0)  # n, o + a, b, c = 5 problems
    answers = {COUNT_LETTER.match(e.prompt).groups(): e.fields["answer"] for e in examples}
    expected = {("n", "Noon"): "2", ("o", "Noon"): "2", ("a", "abc"): "1", ("b", "abc"): "1"}
    expected[("c", "abc")] = "1"
    assert answers.items() <= expected.items()
    with pytest.raises(ValueError, match=r"6 examples.*only 5 distinct"):
        count_letter_task(6, words=["Noon", "abc"])
    with pytest.raises(ValueError, match="letters only"):
        count_letter_task(1, words=["ice cream"])


def test_tasks_registry():
    assert TASKS["arithmetic"] is arithmetic_task
    assert TASKS["count_letter"] is count_letter_task


# ---------------------------------------------------------------------------------------------------------
# user data


ROWS = [
    {"question": "What is 2 + 2?", "answer": "4", "unit": "apples"},
    {"question": "Spell cat.", "answer": "cat", "unit": "letters"},
]


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({**ROWS[1], "answer": 7}) + "\n")
    examples = load_examples(path, prompt_field="question", answer_fields=("answer", "unit"))
    assert examples == [
        Example("What is 2 + 2?", {"answer": "4", "unit": "apples"}),
        Example("Spell cat.", {"answer": 7, "unit": "letters"}),  # JSON types are kept
    ]


def test_csv_round_trip(tmp_path):
    path = tmp_path / "data.csv"
    with path.open("w", newline="", encoding="utf-8-sig") as handle:  # with a BOM, as Excel writes
        writer = csv.DictWriter(handle, fieldnames=["question", "answer", "unit"])
        writer.writeheader()
        writer.writerows(ROWS)
    examples = load_examples(str(path), prompt_field="question", answer_fields="answer")
    assert examples == [Example("What is 2 + 2?", {"answer": "4"}), Example("Spell cat.", {"answer": "cat"})]


def test_missing_field_names_file_row_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"prompt": "b", "x": 1}))
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 2 has no field 'answer'.*\['prompt', 'x'\]"):
        load_examples(path)

    path = tmp_path / "bad.csv"
    path.write_text("question,answer\nfirst,1\nsecond,2\n")
    with pytest.raises(ValueError, match=r"bad\.csv: row 1 has no field 'prompt'.*\['answer', 'question'\]"):
        load_examples(path)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.jsonl"):
        load_examples(tmp_path / "nowhere.jsonl")
    (tmp_path / "data.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"\.txt"):
        load_examples(tmp_path / "data.txt")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: row 2 is not valid JSON"):
        load_examples(tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no examples"):
        load_examples(tmp_path / "empty.jsonl")


def test_datasets_directory_without_datasets_names_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        load_examples(tmp_path)


def test_datasets_directory_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets", reason="`datasets` is not installed (optional)")
    directory = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(directory))
    examples = load_examples(directory, prompt_field="question")
    assert examples == [Example("What is 2 + 2?", {"answer": "4"}), Example("Spell cat.", {"answer": "cat"})]
    with pytest.raises(ValueError, match=r"row 1 has no field 'solution'"):
        load_examples(directory, prompt_field="question", answer_fields=("solution",))


# ---------------------------------------------------------------------------------------------------------
# eval split and batch fields


def test_split_eval_disjoint_and_sized():
    examples = arithmetic_task(30, seed=0)
    train, evaluation = split_eval(examples, 8, seed=1)
    assert len(train) == 22 and len(evaluation) == 8
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in evaluation)
    assert sorted(e.prompt for e in train + evaluation) == sorted(e.prompt for e in examples)
    assert split_eval(examples, 8, seed=1) == (train, evaluation)
    assert split_eval(examples, 8, seed=2)[1] != evaluation
    assert split_eval(examples, 0) == (examples, [])
    with pytest.raises(ValueError, match=r"between 0 and 29.*30.*got 30"):
        split_eval(examples, 30)


def test_batch_fields_repeats_per_group():
    examples = [Example("a", {"answer": "1"}), Example("b", {"answer": "2"})]
    assert batch_fields(examples, repeat=3) == {"answer": ["1", "1", "1", "2", "2", "2"]}
    with pytest.raises(ValueError, match="example 1"):
        batch_fields([Example("a", {"answer": "1"}), Example("b", {"solution": "2"})])


# ---------------------------------------------------------------------------------------------------------
# format_prompt


def _tiny_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template
    return tokenizer


TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<sys>You are helpful.</sys>{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_format_prompt_with_chat_template():
    tokenizer = _tiny_tokenizer(TEMPLATE)
    assert format_prompt(tokenizer, "What is 1 + 1?") == (
        "<sys>You are helpful.</sys><user>What is 1 + 1?</user><assistant>"
    )
    assert format_prompt(tokenizer, "Hi", system_prompt="Be brief.") == (
        "<system>Be brief.</system><user>Hi</user><assistant>"
    )


def test_format_prompt_without_chat_template():
    tokenizer = _tiny_tokenizer(None)
    assert format_prompt(tokenizer, "What is 1 + 1?") == "What is 1 + 1?"
    assert format_prompt(tokenizer, "Hi", system_prompt="Be brief.") == "Be brief.\n\nHi"


# ---------------------------------------------------------------------------------------------------------
# PromptStream


def _prompts(batches):
    return [[e.prompt for e in batch] for batch in batches]


def test_stream_covers_each_example_once_per_epoch():
    examples = [Example(str(i)) for i in range(7)]
    stream = PromptStream(examples, 3, seed=4)
    flat = [e.prompt for _ in range(7) for e in stream.next_batch()]  # 21 = 3 epochs of 7
    epochs = [flat[i : i + 7] for i in range(0, 21, 7)]
    for epoch in epochs:
        assert sorted(epoch) == [str(i) for i in range(7)]
    assert len({tuple(epoch) for epoch in epochs}) == 3  # reshuffled each epoch
    assert stream.state_dict() == {"epoch": 2, "position": 7}


def test_stream_deterministic_and_batch_larger_than_data():
    examples = [Example(str(i)) for i in range(5)]
    first = PromptStream(examples, 2, seed=0)
    second = PromptStream(examples, 2, seed=0)
    assert _prompts(first.next_batch() for _ in range(6)) == _prompts(second.next_batch() for _ in range(6))
    other = PromptStream(examples, 2, seed=1)
    assert _prompts(other.next_batch() for _ in range(6)) != _prompts(
        PromptStream(examples, 2, seed=0).next_batch() for _ in range(6)
    )
    big = PromptStream(examples, 12, seed=0)
    batch = [e.prompt for e in big.next_batch()]
    assert len(batch) == 12 and sorted(batch[:5]) == sorted(batch[5:10]) == [str(i) for i in range(5)]


def test_stream_resume_continues_exactly():
    examples = [Example(str(i)) for i in range(10)]
    uninterrupted = PromptStream(examples, 4, seed=7)
    reference = _prompts(uninterrupted.next_batch() for _ in range(9))

    interrupted = PromptStream(examples, 4, seed=7)
    before = _prompts(interrupted.next_batch() for _ in range(4))
    state = json.loads(json.dumps(interrupted.state_dict()))  # as a checkpoint would store it
    assert state == {"epoch": 1, "position": 6}
    resumed = PromptStream(examples, 4, seed=7)
    resumed.load_state_dict(state)
    assert before + _prompts(resumed.next_batch() for _ in range(5)) == reference

    with pytest.raises(ValueError, match="10 examples"):
        resumed.load_state_dict({"epoch": 0, "position": 11})


def test_stream_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one example"):
        PromptStream([], 2)
    with pytest.raises(ValueError, match="batch_size"):
        PromptStream([Example("a")], 0)


def test_text_that_is_not_utf8_names_the_file_and_the_line(tmp_path):
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_bytes(
        b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n{"prompt": "caf\xe9"}\n'
    )
    with pytest.raises(DataError, match=r"data\.jsonl: line 3 is not UTF-8 text \(byte 0xe9\)"):
        load_examples(jsonl)
    table = tmp_path / "data.csv"
    table.write_bytes(b"prompt,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,\xff4\n")
    with pytest.raises(DataError, match=r"data\.csv: line 3 is not UTF-8 text \(byte 0xff\)"):
        load_examples(table)


def test_loaded_examples_remember_their_file_and_row(tmp_path):
    table = tmp_path / "data.csv"
    table.write_text("prompt,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    assert [ex.source for ex in load_examples(table)] == [f"{table} row 1", f"{table} row 2"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "prompt,answer\nWhat is 1 + 1?,2,extra\n",
            r"ragged\.csv: line 2 \(row 1\) has 3 cells, the header 2",
        ),
        ("prompt,answer\nWhat is 1 + 1?\n", r"ragged\.csv: line 2 \(row 1\) has 1 cells, the header 2"),
        ("\nprompt,answer\n\na,1\nb\n", r"ragged\.csv: line 5 \(row 2\) has 1 cells, the header 2"),
        ("prompt,answer,answer\na,1,2\n", r"ragged\.csv: line 1: the header names the column 'answer' more"),
    ],
)
def test_ragged_rows_and_ambiguous_csv_headers_name_the_file_and_the_line(tmp_path, text, message):
    """Surplus cells were dropped, missing ones read as a missing field, and a repeated
    column name silently took its last cell."""
    path = tmp_path / "ragged.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        load_examples(path)


def test_json_nested_past_the_readers_depth_names_the_file_and_the_row(tmp_path):
    """Deep nesting raised RecursionError, with a traceback."""
    path = tmp_path / "deep.jsonl"
    path.write_text(
        '{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": ' + "[" * 5000 + "]" * 5000 + "}\n"
    )
    with pytest.raises(DataError, match=r"deep\.jsonl: row 2 is nested too deeply for Python's JSON reader"):
        load_examples(path)


def test_arithmetic_operands_beyond_a_machine_word_draw_distinct_problems():
    """A space of problems larger than sys.maxsize: random.sample(range(...)) overflowed."""
    examples = arithmetic_task(5, operand_min=-(10**12), operand_max=10**12, num_operands=3, seed=1)
    assert len({e.prompt for e in examples}) == 5
    for example in examples:
        expression = example.prompt.removeprefix("What is ").split("?")[0]
        assert str(eval(expression)) == example.fields["answer"]  # the operands and + only


def test_a_lone_surrogate_names_the_file_the_row_and_the_field(tmp_path) -> None:
    """JSON's "\\ud800" escape reads as a lone surrogate, which no tokenizer can encode."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "fine", "answer": "1"}\n{"prompt": "2+\\ud8003", "answer": "5"}\n')
    with pytest.raises(
        DataError,
        match=r"data\.jsonl: row 2: field 'prompt' holds a lone surrogate \(U\+D800 at character 2\)",
    ):
        load_examples(path)


# ---------------------------------------------------------------------------------------------------------
# Conversational prompts: a column of chat messages, TRL's standard form

CHAT_ROWS = [
    {
        "prompt": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
        "a": 1,
    },
    {"prompt": [{"role": "user", "content": "2+2?"}], "a": 2},
    {
        "prompt": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Bl"}],
        "a": 3,
    },
]


def test_chat_message_prompts_are_read_and_templated_as_trl_does(tmp_path) -> None:
    """A row's own system prompt, a plain user turn, and an assistant turn to continue: each rendered as
    TRL's own maybe_apply_chat_template renders it; the rows survive the run folder's data.jsonl."""
    from gspo.models import tiny_tokenizer
    from gspo.rollout.data import jsonl_lines, rows_examples

    trl_data = pytest.importorskip("trl.data_utils", reason="the dev extra installs TRL")
    tokenizer = tiny_tokenizer()
    examples = rows_examples(CHAT_ROWS, answer_fields=["a"])
    assert [e.prompt for e in examples] == [r["prompt"] for r in CHAT_ROWS]
    for example, row in zip(examples, CHAT_ROWS, strict=True):
        expected = trl_data.maybe_apply_chat_template({"prompt": row["prompt"]}, tokenizer)["prompt"]
        assert format_prompt(tokenizer, example.prompt) == expected
    assert format_prompt(tokenizer, examples[1].prompt).endswith("<|im_start|>assistant\n")
    assert format_prompt(tokenizer, examples[2].prompt).endswith("<|im_start|>assistant\nBl")
    # task.system_prompt fills in for rows without one; a row's own wins
    with_system = format_prompt(tokenizer, examples[1].prompt, system_prompt="Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "Be brief." not in format_prompt(tokenizer, examples[0].prompt, system_prompt="Be brief.")
    path = tmp_path / "data.jsonl"
    path.write_text(jsonl_lines(examples, "prompt"))
    assert load_examples(path, answer_fields=["a"]) == examples


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "an empty list of messages"),
        (["Hi"], "message 0, which is not a mapping with a 'role'"),
        ([{"role": "robot", "content": "Hi"}], "message 0 of role 'robot', not one of system, user"),
        ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "message 0 without text 'content'"),
        ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "x"}], "a last message of role"),
        (7, "int"),
    ],
)
def test_a_prompt_that_is_no_text_and_no_conversation_names_the_row(tmp_path, prompt, message) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps({"prompt": "fine", "answer": "1"}) + "\n" + json.dumps({"prompt": prompt, "answer": "2"})
    )
    with pytest.raises(DataError) as error:
        load_examples(path)
    assert (
        f"data.jsonl: row 2: field 'prompt' must be a string or a list of chat messages, got {message}"
        in str(error.value)
    )


def test_chat_messages_need_a_chat_template() -> None:
    with pytest.raises(
        DataError, match="the prompts are chat messages, and this model's tokenizer has no chat"
    ):
        format_prompt(_tiny_tokenizer(None), [{"role": "user", "content": "Hi"}])
