"""Whether the peers a rank waits on are alive: heartbeats through the launch's key-value store.

A rank may wait on a peer for as long as that peer has healthy work to do (an SFT warm-up,
loading or saving a checkpoint, an evaluation, an export, generating steps ahead): a time limit
on the wait itself would have to exceed all of them. What should stop a run is a peer that went
silent: a stopped process, one frozen in a hang, a lost host. So every rank runs a thread that
adds 1 to its own counter in the store every ``period`` seconds, and a waiting rank reads its
peers' counters: one that has not moved for ``silent_seconds`` is named in the error that stops
the run, whichever rank it is (not only the one this rank waits on directly).

The counters live in the store, not in a process group: a heartbeat never queues behind a
collective, and a rank that gives up a wait leaves no operation posted on a group (a gloo group
with a pending operation cannot be torn down). A process that holds Python's GIL for longer than
``silent_seconds`` without a break (a C extension that never releases it) looks silent too. A
rank that fails can say so in the store (``report_failure``): the waiting ranks stop with its
error instead of waiting for what it will never send.
"""

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from torchtitan_rl.distributed.utils import PeerFailedError

logger = logging.getLogger(__name__)

MAX_PERIOD_SECONDS = 5.0  # the slowest heartbeat, whatever the timeout
_MAX_POLL_SECONDS = 0.05  # the longest pause between two looks at what a wait waits for


class PeerSilentError(RuntimeError):
    """A peer sent no heartbeat for ``silent_seconds``; the message names it."""


class Liveness:
    """This rank's heartbeat, and the watch over ``peers``' heartbeats while it waits.

    ``store``: a store that every rank of ``peers`` reaches; the keys go under ``prefix``. This
    object opens clients of its own (``clone()``), so neither the heartbeat thread nor a wait
    queues behind the process's other uses of the store. ``setting`` names the config key of
    ``silent_seconds`` in errors, ``describe(rank)`` a rank. ``close()`` stops the heartbeat.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        peers: list[int],
        silent_seconds: float,
        setting: str,
        describe: Callable[[int], str] = lambda rank: f"rank {rank}",
    ):
        self.rank, self.peers, self.silent_seconds = rank, list(peers), silent_seconds
        self.setting, self.describe = setting, describe
        # Ten beats per timeout: a waiting rank sees a live peer's counter move several times
        # between two of its looks, even when a beat comes late.
        self.period = min(silent_seconds / 10, MAX_PERIOD_SECONDS)
        self._store = dist.PrefixStore(prefix, store.clone())
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (its count, when it last moved)
        self._last_look = -math.inf
        self._reported = False
        self._stop = threading.Event()
        self._paused = threading.Event()
        self.add(self._key(rank), 1)
        beat_store = dist.PrefixStore(prefix, store.clone())
        self._thread = threading.Thread(target=self._beat, args=(beat_store,), name="heartbeat", daemon=True)
        self._thread.start()

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` of the store (0 reads it); its new value."""
        return self._store.add(key, amount)

    def wait_until(self, is_done: Callable[[], bool], what: str) -> None:
        """Return once ``is_done()``, however long that takes while every peer is alive; stop
        with a ``PeerSilentError`` (``what``: what this rank waited for) when a peer is silent
        first, or a ``PeerFailedError`` when a rank reported a failure."""
        pause = 0.001
        while not is_done():
            self.check(what)
            time.sleep(pause)
            pause = min(2 * pause, _MAX_POLL_SECONDS, self.period)

    def check(self, what: str) -> None:
        """Read the peers' counters (at most once a period) and raise naming one that has not
        moved for ``silent_seconds``, or a failure a rank reported (``report_failure``)."""
        now = time.monotonic()
        if now - self._last_look < self.period:
            return
        self._last_look = now
        if not self._reported and self._store.check(["failed"]):
            rank, error = json.loads(self._store.get("failed"))
            raise PeerFailedError(rank, error)
        for peer in self.peers:
            count = self.add(self._key(peer), 0)
            seen = self._seen.get(peer)
            if seen is None or seen[0] != count:
                self._seen[peer] = (count, now)
            elif now - seen[1] > self.silent_seconds:
                raise PeerSilentError(
                    f"{what}: {self.describe(peer)} sent no heartbeat for {now - seen[1]:.0f} s "
                    f"({self.setting}={self.silent_seconds:g}); it is stopped, hung or lost. Stopping the run"
                )

    def report_failure(self, rank: int, error: str) -> None:
        """Tell the ranks that wait (``wait_until``) that ``rank`` failed with ``error``: they stop
        with a ``PeerFailedError``, also where they wait on something the failure never brings."""
        self._store.set("failed", json.dumps([rank, error]))
        self._reported = True  # this rank's own waits go on: it stops with its own error

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No heartbeat during the block: what a stopped process looks like to its peers (tests).
        Beats at its end, so that a peer's next look finds this rank alive."""
        self._paused.set()
        try:
            yield
        finally:
            self._paused.clear()
            self.add(self._key(self.rank), 1)

    def close(self) -> None:
        """Stop the heartbeat (the peers that still wait on this rank will name it)."""
        self._stop.set()
        self._thread.join()

    def _key(self, rank: int) -> str:
        return f"alive/{rank}"

    def _beat(self, store: dist.Store) -> None:
        key = self._key(self.rank)
        while not self._stop.wait(self.period):
            if self._paused.is_set():
                continue
            try:
                store.add(key, 1)
            except RuntimeError as err:  # the store is gone: the launch is ending
                logger.warning("rank %d: heartbeat stopped: %s", self.rank, err)
                return
