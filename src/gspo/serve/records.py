"""The server's memory of what it sampled: one `Record` per choice, kept for training, bounded and expiring.

A record holds a completion's exact prompt and completion token ids, the sampler's per-token log-probs and
the policy versions that sampled it. A train call names completions by their ids; a chat request's
assistant message is matched to the record it came from by its prompt tokens and its text (or its
completion id), so the server renders the conversation with the tokens it sampled, not a re-tokenisation.
Token ids are kept as compact arrays: 20,000 records of 2,000 tokens take about 160 MB.
"""

from __future__ import annotations

import array
import collections
import hashlib
import secrets
import threading
import time
from dataclasses import dataclass


def token_array(ids: list[int]) -> array.array:
    return array.array("i", ids)


def float_array(values: list[float]) -> array.array:
    return array.array("d", values)


def prefix_key(ids: array.array | list[int]) -> bytes:
    """A digest of a token sequence (a prompt), for looking records up by the prompt they continued."""
    data = ids.tobytes() if isinstance(ids, array.array) else array.array("i", ids).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def new_completion_id() -> str:
    return "gspo-" + secrets.token_hex(12)


@dataclass
class Record:
    """One sampled choice, as the engine produced it.

    prompt_ids, completion_ids: exact token ids (the completion's stop token included when it stopped on
    one); logprobs: log pi_sampler of each completion token at `temperature`; versions: the first and last
    policy version its tokens were drawn from (equal unless the weights changed while it was in flight);
    content: the text the response gave for it (matched against later assistant messages); finish_reason:
    "stop", "length", "tool_calls" or "cancelled".
    """

    id: str
    prompt_ids: array.array
    completion_ids: array.array
    logprobs: array.array
    versions: tuple[int, int]
    temperature: float
    greedy: bool
    content: str
    finish_reason: str
    created: float = 0.0
    """When it was stored (time.monotonic; set by RecordStore.add)."""
    trained_in: int | None = None
    """The policy version whose update trained it: a completion is trained once."""

    @property
    def version(self) -> int:
        """The oldest policy version among its tokens (what staleness is measured from)."""
        return self.versions[0]


class RecordStore:
    """Records by completion id, at most `max_records`, each kept `ttl` seconds (thread-safe)."""

    def __init__(self, max_records: int, ttl: float) -> None:
        self.max_records, self.ttl = max_records, ttl
        self._lock = threading.Lock()
        self._records: collections.OrderedDict[str, Record] = collections.OrderedDict()
        self._by_turn: dict[tuple[bytes, str], str] = {}  # (prompt digest, content) -> newest id
        self.expired = 0
        """Records dropped for age or room so far."""

    def add(self, record: Record) -> None:
        with self._lock:
            record.created = time.monotonic()
            self._records[record.id] = record
            self._by_turn[(prefix_key(record.prompt_ids), record.content)] = record.id
            self._expire()

    def get(self, completion_id: str) -> Record | None:
        with self._lock:
            self._expire()
            return self._records.get(completion_id)

    def match(self, prompt_ids: list[int], content: str) -> Record | None:
        """The newest record that continued exactly `prompt_ids` and whose text was `content`."""
        with self._lock:
            found = self._records.get(self._by_turn.get((prefix_key(prompt_ids), content), ""))
        if found is None or list(found.prompt_ids) != prompt_ids:  # a digest collision is not a match
            return None
        return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        while self._records:
            oldest = next(iter(self._records.values()))
            if len(self._records) <= self.max_records and oldest.created >= cutoff:
                break
            self._records.popitem(last=False)
            key = (prefix_key(oldest.prompt_ids), oldest.content)
            if self._by_turn.get(key) == oldest.id:
                del self._by_turn[key]
            self.expired += 1
