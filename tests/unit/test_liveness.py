"""Heartbeats (``distributed/liveness.py``) in one process: two ranks' ``Liveness`` on a local
store. A wait on a peer that keeps beating lasts as long as the awaited thing takes, however
long; a peer that stops beating is named about ``silent_seconds`` later (measured)."""

import threading
import time

import pytest
import torch.distributed as dist

from torchtitan_rl.distributed.liveness import Liveness, PeerSilentError

SILENT_SECONDS = 1.0


@pytest.fixture
def ranks():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pair = [
        Liveness(store, "test/", rank, [1 - rank], SILENT_SECONDS, "test.silent", lambda r: f"worker {r}")
        for rank in (0, 1)
    ]
    yield pair
    for liveness in pair:
        liveness.close()


def test_a_wait_on_a_busy_peer_outlasts_the_timeout(ranks):
    waiter, _ = ranks
    done = threading.Event()
    timer = threading.Timer(3 * SILENT_SECONDS, done.set)  # the peer's long healthy work
    start = time.monotonic()
    timer.start()
    waiter.wait_until(done.is_set, "waiting for the peer's warm-up")
    assert time.monotonic() - start >= 3 * SILENT_SECONDS


def test_a_silent_peer_is_named_after_the_timeout(ranks):
    waiter, peer = ranks
    with peer.paused():
        start = time.monotonic()
        with pytest.raises(PeerSilentError, match=r"waiting for the step: worker 1 sent no heartbeat .*test\.silent=1"):
            waiter.wait_until(lambda: False, "waiting for the step")
        elapsed = time.monotonic() - start
    # Silent from a beat before the pause on: named once a look finds it still for the timeout.
    assert SILENT_SECONDS - peer.period <= elapsed <= SILENT_SECONDS + 3 * waiter.period + 0.5, elapsed
