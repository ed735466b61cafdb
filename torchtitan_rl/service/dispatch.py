"""The dispatch layer: one order of operations for all ranks.

The HTTP layer (rank 0, its own threads) calls ``Dispatcher.submit``. Operations of one training
model run in ``seq_id`` order (the SDK numbers each client's operations 1, 2, ... and may post
them concurrently, or leave a gap while it computes a custom loss): an operation waits until its
model's previous ``seq_id`` ran. Sampling operations and those that create a model run in arrival
order. Rank 0's main thread takes the next runnable operation, checks it (a UserError is
answered at once, no rank involved), sends it to every rank over a process group of its own and
runs it; the other ranks run ``follow`` (rollout ranks too, with a worker that executes the
sampling operations alone: ``service.rollout_sampling``). While nothing is queued rank 0 sends a keep-alive every
``keepalive_seconds``, so that a rank waits in a collective only as long as its timeout allows
when rank 0 is gone, never because the service is idle.
"""

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from torchtitan_rl.service.operations import OPERATION_KINDS, Operation, UserError
from torchtitan_rl.service.worker import ServiceWorker

logger = logging.getLogger(__name__)

_KEEPALIVE = "keepalive"
_STOP = "stop"
# Operations that belong to a training model's sequence (the others carry no seq_id order).
# A "skip" holds the place of a request the HTTP layer refused (its args' "error" is the answer),
# so that the model's later operations do not wait for it.
SEQUENCED_KINDS = ("forward_backward", "optim_step", "save_weights", "save_weights_for_sampler", "load_weights", "skip")


class Executor(Protocol):
    """What a rank that follows rank 0 runs each operation with."""

    def execute(self, op: Operation) -> Any: ...


@dataclass
class _Pending:
    op: Operation
    done: Callable[[Any], None]


class Dispatcher:
    def __init__(self, worker: ServiceWorker, group: dist.ProcessGroup | None, keepalive_seconds: float):
        self.worker = worker
        self.group = group  # None: a single rank
        self.keepalive_seconds = keepalive_seconds
        self._lock = threading.Condition()
        self._ready: deque[_Pending] = deque()
        self._waiting: dict[str, dict[int, _Pending]] = {}  # model id -> seq_id -> operation
        self._next_seq: dict[str, int] = {}  # model id -> the seq_id that runs next
        self._stopping = False

    # ---- the HTTP layer's side (any thread) --------------------------------------------------

    def submit(self, op: Operation, done: Callable[[Any], None]) -> None:
        if op.kind not in OPERATION_KINDS:
            done(UserError(f"type: unknown operation {op.kind!r}"))
            return
        with self._lock:
            pending = _Pending(op, done)
            if op.kind in SEQUENCED_KINDS and op.seq_id is not None:
                expected = self._next_seq.setdefault(op.model_id, 1)
                if op.seq_id < expected or op.seq_id in self._waiting.get(op.model_id, {}):
                    done(UserError(f"seq_id: {op.seq_id} of model {op.model_id} was already submitted"))
                    return
                self._waiting.setdefault(op.model_id, {})[op.seq_id] = pending
                self._release(op.model_id)
            else:
                self._ready.append(pending)
            self._lock.notify()

    def _release(self, model_id: str) -> None:
        """Move the model's operations whose turn has come to the ready queue (lock held)."""
        waiting = self._waiting.get(model_id, {})
        while self._next_seq[model_id] in waiting:
            self._ready.append(waiting.pop(self._next_seq[model_id]))
            self._next_seq[model_id] += 1

    def model_info(self, model_id: str) -> dict[str, Any]:
        return self.worker.model_info(model_id)

    def sampler_info(self, sampling_session_id: str) -> dict[str, Any]:
        return self.worker.sampler_info(sampling_session_id)

    def capabilities(self) -> list[dict[str, Any]]:
        return [
            {"model_name": name, "max_context_length": self.worker.max_len, "trainable": True, "sampleable": True}
            for name in self.worker.base_models
        ]

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()

    # ---- rank 0's main thread ----------------------------------------------------------------

    def run(self) -> None:
        """Run operations until ``stop``; then tell the other ranks to stop."""
        while True:
            with self._lock:
                if not self._ready and not self._stopping:
                    self._lock.wait(self.keepalive_seconds)
                if self._stopping:
                    break
                pending = self._ready.popleft() if self._ready else None
            if pending is None:
                self._send(_KEEPALIVE)
                continue
            self._run_one(pending)
        try:
            self._send(_STOP)
        except RuntimeError as err:
            # Stopped by a signal that torchrun sent every rank: the others may be gone already.
            logger.info("the other ranks did not take the stop (%s): they have stopped already", err)

    def _run_one(self, pending: _Pending) -> None:
        if pending.op.kind == "skip":
            pending.done(pending.op.args["error"])
            return
        try:
            op = self.worker.check(pending.op)
        except UserError as err:
            pending.done(err)
            return
        self._send(op)
        try:
            result = self.worker.execute(op)
        except UserError as err:
            # Found by every rank alike (their tables agree), after the check: still an answer.
            pending.done(err)
            return
        except Exception as err:  # the launch goes down with it: the client learns why first
            pending.done(err)
            raise
        pending.done(result)

    def _send(self, message: Operation | str) -> None:
        if self.group is not None:
            dist.broadcast_object_list([message], src=0, group=self.group)


def follow(worker: Executor, group: dist.ProcessGroup) -> None:
    """A rank other than 0: run what rank 0 sends until it says stop."""
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        message = box[0]
        if message == _STOP:
            return
        if message == _KEEPALIVE:
            continue
        try:
            worker.execute(message)
        except UserError:
            pass  # rank 0 answers it; every rank found it alike
