"""The HTTP layer's futures: one record per accepted request, found by the request id the SDK
polls ``retrieve_future`` with and by the key that makes a retried POST find the first one's
record (``(model_id, seq_id)`` for a training model, ``(sampling_session_id, seq_id)`` for a
sample).

Memory stays bounded by the work in flight plus a short tail: a finished record is dropped
``retrieved_ttl_s`` after its result was first handed out (long enough for the SDK to poll again
when a response was lost on the way), or ``unretrieved_ttl_s`` after it finished when no one
asked for it (a client that went away). A record still running is never dropped.

Every method runs on the server's event loop; the dispatch layer's ``done`` callbacks, which come
from its own threads, hop onto that loop (``completer``).
"""

import asyncio
import hashlib
import math
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

# How often at most the store looks for records to drop (each look walks all records).
_SWEEP_INTERVAL_S = 1.0


@dataclass
class FutureRecord:
    request_id: str
    kind: str  # the operation kind; decides how the result is written
    key: Hashable | None
    digest: str  # of the request body: a reused key with another body is a client bug
    context: dict[str, Any] = field(default_factory=dict)  # what writing the result needs
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    value: Any = None  # the result, or the exception the operation failed with
    expires_at: float = math.inf


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class FutureStore:
    def __init__(self, retrieved_ttl_s: float = 120.0, unretrieved_ttl_s: float = 3600.0):
        self.retrieved_ttl_s = retrieved_ttl_s
        self.unretrieved_ttl_s = unretrieved_ttl_s
        self._by_id: dict[str, FutureRecord] = {}
        self._by_key: dict[Hashable, FutureRecord] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str) -> FutureRecord | None:
        self._sweep()
        return self._by_id.get(request_id)

    def find(self, key: Hashable) -> FutureRecord | None:
        self._sweep()
        return self._by_key.get(key)

    def create(
        self, kind: str, key: Hashable | None, digest: str, context: dict[str, Any] | None = None
    ) -> FutureRecord:
        record = FutureRecord(uuid.uuid4().hex, kind, key, digest, dict(context or {}))
        self._by_id[record.request_id] = record
        if key is not None:
            self._by_key[key] = record
        return record

    def finish(self, record: FutureRecord, value: Any) -> None:
        """Set the result (or exception) once; later calls are ignored."""
        if record.finished.is_set():
            return
        record.value = value
        record.expires_at = time.monotonic() + self.unretrieved_ttl_s
        record.finished.set()

    def completer(self, record: FutureRecord) -> Callable[[Any], None]:
        """The ``done`` callback of ``record``'s operation, callable from any thread."""
        loop = asyncio.get_running_loop()

        def done(value: Any) -> None:
            try:
                loop.call_soon_threadsafe(self.finish, record, value)
            except RuntimeError:  # the server has stopped: no one can ask for the result any more
                pass

        return done

    def retrieved(self, record: FutureRecord) -> None:
        record.expires_at = min(record.expires_at, time.monotonic() + self.retrieved_ttl_s)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(_SWEEP_INTERVAL_S, self.retrieved_ttl_s, self.unretrieved_ttl_s)
        for record in [r for r in self._by_id.values() if r.expires_at <= now]:
            del self._by_id[record.request_id]
            if record.key is not None and self._by_key.get(record.key) is record:
                del self._by_key[record.key]
