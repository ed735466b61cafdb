"""The dispatch layer's order (``service.dispatch.Dispatcher``) with a recording worker, one rank:
per model by seq_id whatever the arrival order, other models unaffected by one that waits for a
missing seq_id, a repeated seq_id refused, a bad operation answered without stopping the rest."""

import threading

import pytest

from torchtitan_rl.service.dispatch import Dispatcher
from torchtitan_rl.service.operations import Operation, UserError


class RecordingWorker:
    max_len = 64
    base_models = ["m"]

    def __init__(self):
        self.ran: list[tuple[str | None, int | None]] = []

    def check(self, op: Operation) -> Operation:
        if op.args.get("bad"):
            raise UserError("bad: refused")
        return op

    def execute(self, op: Operation):
        self.ran.append((op.model_id, op.seq_id))
        return op.seq_id


@pytest.fixture
def running():
    worker = RecordingWorker()
    dispatcher = Dispatcher(worker, None, keepalive_seconds=0.05)
    thread = threading.Thread(target=dispatcher.run, daemon=True)
    thread.start()
    yield dispatcher, worker
    dispatcher.stop()
    thread.join(5)
    assert not thread.is_alive()


class Results:
    def __init__(self):
        self.values: dict[str, object] = {}
        self.event = threading.Condition()

    def done_for(self, key: str):
        def done(value):
            with self.event:
                self.values[key] = value
                self.event.notify_all()

        return done

    def wait(self, *keys: str) -> None:
        with self.event:
            assert self.event.wait_for(lambda: all(k in self.values for k in keys), timeout=5), keys


def op(model: str, seq: int, kind: str = "forward_backward", **args) -> Operation:
    return Operation(f"{model}-{seq}", kind, model, seq, args)


def test_a_models_operations_run_in_seq_id_order(running):
    dispatcher, worker = running
    results = Results()
    for seq in (3, 1, 2):
        dispatcher.submit(op("a", seq), results.done_for(f"a{seq}"))
    results.wait("a1", "a2", "a3")
    assert worker.ran == [("a", 1), ("a", 2), ("a", 3)]
    assert [results.values[f"a{s}"] for s in (1, 2, 3)] == [1, 2, 3]


def test_a_model_waiting_for_a_missing_seq_id_blocks_no_other(running):
    dispatcher, worker = running
    results = Results()
    dispatcher.submit(op("a", 2), results.done_for("a2"))  # a's seq 1 never comes (a client that died)
    dispatcher.submit(op("b", 1), results.done_for("b1"))
    dispatcher.submit(Operation("s", "sample", None, None, {}), results.done_for("s"))
    results.wait("b1", "s")
    assert "a2" not in results.values and worker.ran == [("b", 1), (None, None)]


def test_repeated_seq_id_and_bad_operations_are_user_errors(running):
    dispatcher, worker = running
    results = Results()
    dispatcher.submit(op("a", 1), results.done_for("first"))
    results.wait("first")
    dispatcher.submit(op("a", 1), results.done_for("again"))
    dispatcher.submit(op("a", 2, bad=True), results.done_for("bad"))
    dispatcher.submit(op("a", 3), results.done_for("next"))
    dispatcher.submit(Operation("x", "no_such_kind"), results.done_for("unknown"))
    results.wait("again", "bad", "next", "unknown")
    assert isinstance(results.values["again"], UserError) and "seq_id" in str(results.values["again"])
    assert isinstance(results.values["bad"], UserError)
    assert isinstance(results.values["unknown"], UserError) and "no_such_kind" in str(results.values["unknown"])
    assert results.values["next"] == 3 and worker.ran == [("a", 1), ("a", 3)]


def test_a_skipped_request_answers_its_error_and_keeps_the_model_going(running):
    """The HTTP layer's stand-in for a request it refused holds the seq_id's place."""
    dispatcher, worker = running
    results = Results()
    dispatcher.submit(op("a", 2), results.done_for("a2"))
    dispatcher.submit(op("a", 1, kind="skip", error=UserError("data: malformed")), results.done_for("a1"))
    results.wait("a1", "a2")
    assert isinstance(results.values["a1"], UserError) and results.values["a2"] == 2
    assert worker.ran == [("a", 2)]
