"""Prompts for training: examples, built-in verifiable tasks, user data, eval split, a resumable stream.

An :class:`Example` is a user message, or a conversation (chat messages, TRL's conversational form: a
per-row system prompt, earlier turns), plus the fields a reward function needs (``{"answer": "8"}``). The
trainer formats the prompt with :func:`format_prompt` (the tokenizer's chat template) and passes the fields
to reward functions as keyword lists aligned with the completions (:func:`batch_fields`).

Built-in tasks (``TASKS``) generate examples deterministically from a seed, without duplicate prompts:

- ``arithmetic``: "What is 3 + 5? Answer with just the number.", usual precedence (``*`` before ``+ -``).
- ``count_letter``: "How many times does the letter "r" appear in the word "strawberry"? ...".

``reasoning_gym`` (gspo.rollout.reasoning_gym) draws problems from a reasoning-gym dataset the same way.

User data comes from JSONL, CSV or a ``datasets`` directory saved with ``save_to_disk``
(:func:`load_examples`). :class:`PromptStream` serves batches forever, one reshuffled pass per epoch, and its
``state_dict`` resumes it exactly.
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TASKS",
    "DataError",
    "Example",
    "PromptStream",
    "arithmetic_task",
    "batch_fields",
    "count_letter_task",
    "format_prompt",
    "jsonl_lines",
    "load_examples",
    "rows_examples",
    "split_eval",
    "surrogate_problem",
]

ANSWER_INSTRUCTION = "Answer with just the number."


class DataError(ValueError):
    """Training data that cannot be used; the message names the file and the row."""


@dataclass(frozen=True)
class Example:
    """One training prompt.

    Attributes:
        prompt: the user message, or the chat messages (``{"role": ..., "content": ...}`` mappings, the last
            one a user, tool or assistant message) that the completion continues; no chat template applied.
        fields: what reward functions receive for this prompt, e.g. ``{"answer": "12"}``; each key becomes a
            keyword argument holding one value per completion.
        source: where it came from, for error messages (``"data.csv row 7"``); empty for generated ones.
    """

    prompt: str | list[dict[str, Any]]
    fields: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)


# ---------------------------------------------------------------------------------------------------------
# Built-in tasks


def _check_count(num_examples: int, available: int, task: str, fix: str) -> None:
    if num_examples < 0:
        raise ValueError(f"{task}: num_examples must be >= 0, got {num_examples}")
    if num_examples > available:
        raise ValueError(
            f"{task}: asked for {num_examples} examples but only {available} distinct problems exist; {fix}"
        )


def _evaluate(operands: Sequence[int], operations: Sequence[str]) -> int:
    """Value of ``operands[0] op operations[0] operands[1] ...`` with ``*`` binding tighter than ``+ -``."""
    total, sign, product = 0, 1, operands[0]
    for operation, operand in zip(operations, operands[1:], strict=True):
        if operation == "*":
            product *= operand
        else:
            total += sign * product
            sign, product = (1 if operation == "+" else -1), operand
    return total + sign * product


def arithmetic_task(
    num_examples: int,
    *,
    operand_min: int = 0,
    operand_max: int = 9,
    operations: str = "+",
    num_operands: int = 2,
    seed: int = 0,
) -> list[Example]:
    """Arithmetic problems with integer answers, e.g. "What is 3 + 5? Answer with just the number.".

    Operands are drawn uniformly from ``[operand_min, operand_max]`` (negative ones are written in
    parentheses), operators from ``operations`` (any of ``"+-*"``); the answer (``fields["answer"]``, a
    string such as ``"8"`` or ``"-2"``) follows the usual precedence. The same seed gives the same list,
    and no prompt repeats: problems are drawn without replacement from all
    ``(operand range) ** num_operands * len(operations) ** (num_operands - 1)`` of them.
    """
    if operand_min > operand_max:
        raise ValueError(f"arithmetic_task: operand_min ({operand_min}) > operand_max ({operand_max})")
    if num_operands < 2:
        raise ValueError(f"arithmetic_task: num_operands must be >= 2, got {num_operands}")
    unknown = sorted(set(operations) - set("+-*"))
    if not operations or unknown:
        raise ValueError(
            f"arithmetic_task: operations must be a non-empty string of '+-*', got {operations!r}"
        )
    ops = sorted(set(operations), key="+-*".index)
    span = operand_max - operand_min + 1
    available = span**num_operands * len(ops) ** (num_operands - 1)
    _check_count(
        num_examples,
        available,
        "arithmetic_task",
        "widen the operand range, add operations or operands, or ask for fewer examples",
    )

    examples = []
    for index in _distinct_indices(available, num_examples, seed):
        operands = []
        for _ in range(num_operands):
            index, digit = divmod(index, span)
            operands.append(operand_min + digit)
        chosen_ops = []
        for _ in range(num_operands - 1):
            index, digit = divmod(index, len(ops))
            chosen_ops.append(ops[digit])
        text = " ".join(
            [_operand_text(operands[0])]
            + [f"{op} {_operand_text(x)}" for op, x in zip(chosen_ops, operands[1:], strict=True)]
        )
        answer = _evaluate(operands, chosen_ops)
        examples.append(Example(f"What is {text}? {ANSWER_INSTRUCTION}", {"answer": str(answer)}))
    return examples


def _distinct_indices(available: int, count: int, seed: int) -> list[int]:
    """`count` distinct draws from range(available), deterministic per seed."""
    rng = random.Random(seed)
    if available <= sys.maxsize:  # random.sample over a range draws without materialising it
        return rng.sample(range(available), count)
    # a space past len()'s limit (wide operands): draws by rejection, which the space's size makes rare
    chosen: dict[int, None] = {}
    while len(chosen) < count:
        chosen.setdefault(rng.randrange(available))
    return list(chosen)


def _operand_text(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


# Common English words with repeated letters, so that counts above 1 are frequent.
_COUNT_LETTER_WORDS_TEXT = """
    strawberry banana apple cherry coffee balloon bookkeeper committee mississippi address accommodate
    necessary tomorrow pepper letter little bottle puzzle success possess assessment occurrence parallel
    millennium embarrass giraffe hippopotamus elephant alligator butterfly caterpillar grasshopper kangaroo
    cinnamon broccoli spaghetti zucchini avocado pineapple raspberry blueberry watermelon tangerine
    lemonade marshmallow chocolate vanilla caramel popcorn muffin pancake waffle sandwich
    engineering programming algorithm referee teepee toffee sassafras barrel mirror
    terrier errors corridor referral current carrot arrow narrow sorrow borrow
    assistant possession mattress glasses passenger message pressure lesson classroom dessert
    beginning running swimming shopping stopping dinner summer hammer bubble pebble
    freedom sleeping coordinate volunteer cookbook doorknob raccoon scooter balloonist woodpecker
    bandana savanna papaya alpaca cabbage grammar calendar database javascript
    keyboard notebook computer internet telephone television radiator refrigerator
    reassessment unnecessary irresistible independence international intelligence opportunity
    everything nevertheless cheeseburger peppermint mammoth mummy yummy happiness goodness seventeen
"""
COUNT_LETTER_WORDS: tuple[str, ...] = tuple(_COUNT_LETTER_WORDS_TEXT.split())


def count_letter_task(
    num_examples: int, *, words: Sequence[str] | None = None, seed: int = 0
) -> list[Example]:
    """Letter counting: 'How many times does the letter "r" appear in the word "strawberry"? ...'.

    Each problem is a (word, letter) pair with the letter taken from the word, so answers are >= 1;
    counting ignores case. ``words`` replaces the built-in list (``COUNT_LETTER_WORDS``). The answer is
    ``fields["answer"]``, a string such as ``"3"``. Deterministic per seed, no prompt repeats.
    """
    pool = list(dict.fromkeys(COUNT_LETTER_WORDS if words is None else words))
    not_alpha = [w for w in pool if not w.isalpha()]
    if not_alpha:
        raise ValueError(f"count_letter_task: words must be letters only, got {not_alpha[:5]}")
    problems = [(word, letter) for word in pool for letter in sorted(set(word.lower()))]
    _check_count(
        num_examples, len(problems), "count_letter_task", "pass more words or ask for fewer examples"
    )
    examples = []
    for word, letter in random.Random(seed).sample(problems, num_examples):
        prompt = (
            f'How many times does the letter "{letter}" appear in the word "{word}"? {ANSWER_INSTRUCTION}'
        )
        examples.append(Example(prompt, {"answer": str(word.lower().count(letter))}))
    return examples


TASKS: dict[str, Callable[..., list[Example]]] = {
    "arithmetic": arithmetic_task,
    "count_letter": count_letter_task,
}


# ---------------------------------------------------------------------------------------------------------
# User data


def surrogate_problem(text: str) -> str | None:
    """What makes `text` no text, or None: a lone surrogate (JSON's "\\ud800" escape reads as one), half of a
    UTF-16 pair, which no tokenizer can encode (its own error is an internal type message)."""
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (
        f"holds a lone surrogate (U+{ord(found.group()):04X} at character {found.start()}), half of a UTF-16 "
        "pair and not text: write the character it was meant to be"
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def load_examples(
    path: str | Path, *, prompt_field: str = "prompt", answer_fields: Sequence[str] = ("answer",)
) -> list[Example]:
    """Read examples from a ``.jsonl`` file, a ``.csv`` file (with a header), or a ``datasets`` directory.

    Each row needs ``prompt_field`` (the user message) and every name in ``answer_fields``; those become
    ``Example.fields`` with their values as stored (CSV values are strings, JSONL keeps JSON types). A null
    or absent value counts as missing. Rows are numbered from 1: the line number for JSONL, the data row
    (after the header) for CSV, the row index + 1 for ``datasets``.
    """
    path = Path(path)
    if isinstance(answer_fields, str):  # a lone name is a common slip for a one-element tuple
        answer_fields = (answer_fields,)
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.is_dir():
        rows = _dataset_rows(path)
    elif path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif path.suffix == ".csv":
        rows = _csv_rows(path)
    else:
        raise DataError(
            f"{path}: unsupported data format {path.suffix!r}; use .jsonl, .csv, or a directory saved "
            "with datasets' save_to_disk"
        )

    return _examples(rows, str(path), prompt_field, tuple(answer_fields))


def rows_examples(
    rows: Any, *, prompt_field: str = "prompt", answer_fields: Sequence[str] = ("answer",)
) -> list[Example]:
    """Examples from rows in memory, as `load_examples` reads a file's: a `datasets.Dataset` (a
    DatasetDict's "train" split), or a list of mappings. Errors name the row as "data row N"."""
    if isinstance(rows, (str, Path)):
        raise DataError(
            f"data={str(rows)!r} is a path: data= takes the rows themselves (a datasets.Dataset or a list of "
            "dicts); a file goes in task.data_path"
        )
    if hasattr(rows, "keys") and hasattr(rows, "column_names"):  # a DatasetDict: splits by name
        rows = _train_split(rows, "data")
    if not hasattr(rows, "__iter__") or isinstance(rows, dict):
        raise DataError(
            f"data= takes rows (a datasets.Dataset or a list of dicts), got a {type(rows).__name__}"
        )
    if isinstance(answer_fields, str):
        answer_fields = (answer_fields,)
    return _examples(enumerate(rows, start=1), "data", prompt_field, tuple(answer_fields))


def _examples(
    rows: Iterable[tuple[int, Any]], where: str, prompt_field: str, answer_fields: tuple[str, ...]
) -> list[Example]:
    """One Example per (row number, row); a row without a field, or with a prompt that is not text, is a
    DataError naming `where` and the row."""
    examples = []
    for row_number, row in rows:
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: row {row_number} is a {type(row).__name__}, expected an object")
        for name in (prompt_field, *answer_fields):
            if row.get(name) is None:
                raise DataError(
                    f"{where}: row {row_number} has no field {name!r} (or it is null); "
                    f"the row has fields {sorted(row)} (set task.prompt_field, task.answer_fields)"
                )
        prompt = row[prompt_field]
        problem = messages_problem(prompt) if isinstance(prompt, list) else None
        if problem is not None or not isinstance(prompt, (str, list)):
            raise DataError(
                f"{where}: row {row_number}: field {prompt_field!r} must be a string or a list of chat "
                f"messages, got {problem or type(prompt).__name__}"
            )
        if isinstance(prompt, list):  # plain dicts: a datasets row's, or JSON's, whatever their mapping type
            prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
        fields = {name: row[name] for name in answer_fields}
        texts = [m["content"] for m in prompt] if isinstance(prompt, list) else [prompt]
        for name, value in [*((prompt_field, text) for text in texts), *fields.items()]:
            if isinstance(value, str) and (problem := surrogate_problem(value)):
                raise DataError(f"{where}: row {row_number}: field {name!r} {problem}")
        examples.append(Example(prompt, fields, source=f"{where} row {row_number}"))
    if not examples:
        raise DataError(f"{where}: no examples found")
    return examples


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles of a conversational prompt's messages (TRL's); the last is a user, tool or assistant message."""


def messages_problem(messages: list[Any]) -> str | None:
    """What keeps `messages` from being a conversational prompt, or None: a non-empty list of mappings, each
    with a role of `CHAT_ROLES` and text content, the last not a system message."""
    if not messages:
        return "an empty list of messages"
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return f"message {index}, which is not a mapping with a 'role' (a list of chat messages?)"
        if message["role"] not in CHAT_ROLES:
            return f"message {index} of role {message['role']!r}, not one of {', '.join(CHAT_ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {index} without text 'content' (images and content parts are not supported)"
    if messages[-1]["role"] == "system":
        return "a last message of role 'system' (it is followed by the user's)"
    return None


def jsonl_lines(examples: Sequence[Example], prompt_field: str) -> str:
    """The examples as a JSONL file's text that `load_examples` reads back as the same examples (in order):
    where a run keeps the rows it was given in memory. A value JSON cannot hold is a DataError."""
    lines = []
    for example in examples:
        row = {prompt_field: example.prompt, **example.fields}
        try:
            lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
        except (TypeError, ValueError) as error:
            raise DataError(
                f"{example.source}: {error}: the run folder keeps the rows as JSON lines; convert the value "
                "to a number, a string, a list or a mapping"
            ) from None
    return "".join(lines)


def _read_text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark dropped); bytes that are not UTF-8 are an error
    naming the line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(
            f"{path}: line {line} is not UTF-8 text (byte {data[error.start]:#04x}): save the file as UTF-8"
        ) from None


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    for line_number, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}: row {line_number} is not valid JSON: {error}") from error
        except RecursionError:  # Python's reader recurses per level
            raise DataError(
                f"{path}: row {line_number} is nested too deeply for Python's JSON reader (about 1000 "
                "levels): flatten it"
            ) from None
        yield line_number, row


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    try:
        header = next((cells for cells in reader if cells), None)  # the first line that is not blank
        if header is None:
            return
        repeated = sorted({name for name in header if header.count(name) > 1})
        if repeated:
            columns = [i + 1 for i, name in enumerate(header) if name == repeated[0]]
            raise DataError(
                f"{path}: line {reader.line_num}: the header names the column {repeated[0]!r} more than once (columns "
                f"{columns}): which one is meant is ambiguous; rename or drop one"
            )
        row_number = 0
        for cells in reader:
            if not cells:  # a blank line
                continue
            row_number += 1
            if len(cells) != len(header):
                raise DataError(
                    f"{path}: line {reader.line_num} (row {row_number}) has {len(cells)} cells, the header "
                    f"{len(header)}: every row needs one cell per column (quote a cell holding a comma)"
                )
            yield row_number, dict(zip(header, cells, strict=True))
    except csv.Error as error:
        raise DataError(f"{path}: line {reader.line_num}: not valid CSV ({error})") from None


def _dataset_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"{path} is a directory, read as a `datasets` dataset, which needs: pip install datasets"
        ) from error
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        dataset = _train_split(dataset, str(path))
    for index, row in enumerate(dataset):
        yield index + 1, row


def _train_split(splits: Any, where: str) -> Any:
    """The "train" split of a DatasetDict."""
    if "train" not in splits:
        raise DataError(
            f"{where}: a DatasetDict without a 'train' split (splits: {sorted(splits)}); pass the split to "
            "use, dataset[split]"
        )
    return splits["train"]


def split_eval(
    examples: Sequence[Example], eval_size: int, *, seed: int = 0
) -> tuple[list[Example], list[Example]]:
    """Hold out ``eval_size`` examples chosen at random (deterministic per seed): ``(train, eval)``.

    Both lists keep the original order; together they are ``examples``, with no example in both.
    """
    if not 0 <= eval_size < len(examples):
        raise ValueError(
            f"eval_size must be between 0 and {len(examples) - 1} (the number of examples, "
            f"{len(examples)}, minus one for training); got {eval_size}"
        )
    held_out = set(random.Random(seed).sample(range(len(examples)), eval_size))
    train = [example for index, example in enumerate(examples) if index not in held_out]
    evaluation = [example for index, example in enumerate(examples) if index in held_out]
    return train, evaluation


def batch_fields(examples: Sequence[Example], repeat: int = 1) -> dict[str, list[Any]]:
    """Fields of a batch as reward keyword lists, each value repeated ``repeat`` times in a row.

    ``repeat`` is the group size G when every prompt gets G consecutive completions.
    """
    if not examples:
        return {}
    names = list(examples[0].fields)
    for index, example in enumerate(examples):
        if sorted(example.fields) != sorted(names):
            raise ValueError(
                f"example {index} has fields {sorted(example.fields)}, example 0 has {sorted(names)}"
            )
    return {name: [e.fields[name] for e in examples for _ in range(repeat)] for name in names}


# ---------------------------------------------------------------------------------------------------------
# Prompt formatting


def format_prompt(
    tokenizer: Any, prompt: str | list[dict[str, Any]], *, system_prompt: str | None = None
) -> str:
    """The text the policy continues: the chat template applied with a generation prompt, when any.

    A text prompt is the user message. With a template, ``system_prompt=None`` sends no system message, so
    a template's own default system message (SmolLM2's, for instance) stays. Without a template the prompt
    is returned as is, after ``system_prompt + "\\n\\n"`` when a system prompt is given.

    Chat messages (a conversational row) are templated as TRL does: with a generation prompt after a user
    or tool message, continuing the last message when it is the assistant's; ``system_prompt`` goes first
    unless the row has a system message of its own, which wins. They need a chat template.
    """
    if isinstance(prompt, list):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "the prompts are chat messages, and this model's tokenizer has no chat template to render "
                "them: use text prompts, or a model with a chat template"
            )
        messages = list(prompt)
        if system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        continued = messages[-1]["role"] == "assistant"
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not continued, continue_final_message=continued
        )
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}"


# ---------------------------------------------------------------------------------------------------------
# Prompt stream


class PromptStream:
    """Batches of examples forever; each epoch visits every example once, in a fresh order.

    Epoch ``e``'s order is a permutation drawn from ``(seed, e)`` alone, so a stream restored with
    :meth:`load_state_dict` continues exactly where the saved one was. A batch that reaches the end of an
    epoch is completed from the start of the next one.
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, *, seed: int = 0) -> None:
        if not examples:
            raise ValueError("PromptStream needs at least one example")
        if batch_size < 1:
            raise ValueError(f"PromptStream batch_size must be >= 1, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        # A string seed is hashed with SHA-512 by random.seed: stable across runs and Python versions.
        random.Random(f"gspo.PromptStream:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[Example]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self.examples):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self.examples) - self.position)
            batch.extend(self.examples[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def __iter__(self) -> Iterator[list[Example]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "position": p}``: the next batch starts at index p of epoch e's order."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.examples):
            raise ValueError(
                f"PromptStream state {state} does not fit a stream of {len(self.examples)} examples"
            )
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
