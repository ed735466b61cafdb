"""The service's HTTP layer driven by the real tinker SDK (0.38) over loopback, in front of a fake
backend whose results are simple formulas of the request: every number the SDK gets back is
compared with the fake's own and with the formula computed here."""

import math
import queue
import threading
import time

import httpx
import numpy as np
import pytest
import torch
import zstandard

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import _tensor_data_to_proto, forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from torchtitan_rl.service import wire  # noqa: E402
from torchtitan_rl.service.futures import FutureStore  # noqa: E402
from torchtitan_rl.service.http import ServiceServer, build_app  # noqa: E402
from torchtitan_rl.service.operations import (  # noqa: E402
    ForwardBackwardResult,
    SampledSequence,
    SampleResult,
    UserError,
)

BASE = "Qwen/Qwen3-8B"
KEY = "tml-test"
STOP_TOKEN = 7
POLL_S = 0.1
RETRIEVED_TTL_S = 0.5


def fake_logprobs(targets: torch.Tensor) -> torch.Tensor:
    return -0.5 * targets.to(torch.float32) / 1000


class FakeBackend:
    """Runs operations on a thread of its own, each model's in seq_id order (as the dispatch layer
    does), with results that are formulas of the request."""

    def __init__(self):
        self.ops = []  # every operation, in the order it ran
        self.results = {}  # request id -> what the fake answered
        self.fail_next: dict[str, Exception] = {}  # kind -> error for its next operation
        self.delay_s: dict[str, float] = {}
        self.models: dict[str, dict] = {}
        self.checkpoints: dict[str, dict] = {}
        self.samplers: dict[str, dict] = {}
        self._next_seq: dict[str, int] = {}
        self._waiting: dict[str, dict[int, tuple]] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, op, done):
        with self._lock:
            if op.seq_id is None or op.model_id is None:
                self._queue.put((op, done))
                return
            self._waiting.setdefault(op.model_id, {})[op.seq_id] = (op, done)
            waiting = self._waiting[op.model_id]
            while self._next_seq.setdefault(op.model_id, 1) in waiting:
                self._queue.put(waiting.pop(self._next_seq[op.model_id]))
                self._next_seq[op.model_id] += 1

    def _loop(self):
        while True:
            op, done = self._queue.get()
            time.sleep(self.delay_s.get(op.kind, 0.0))
            self.ops.append(op)
            try:
                if op.kind in self.fail_next:
                    raise self.fail_next.pop(op.kind)
                result = getattr(self, f"_{op.kind}")(op, op.args)
            except Exception as error:
                result = error
            self.results[op.request_id] = result
            done(result)

    def _skip(self, op, args):
        raise args["error"]

    def _create_model(self, op, args):
        self.models[op.model_id] = {"base_model": args["base_model"], "lora_rank": args["lora_rank"], "steps": 0}
        return {"model_id": op.model_id}

    def _forward_backward(self, op, args):
        logprobs, loss = [], 0.0
        for datum in args["data"]:
            lp = fake_logprobs(datum.inputs["target_tokens"])
            weights = datum.inputs.get("weights", torch.ones_like(lp))
            loss += float((-lp * weights).sum())
            logprobs.append(lp)
        return ForwardBackwardResult(logprobs, {"loss:sum": loss, "num_datums:sum": float(len(logprobs))})

    def _optim_step(self, op, args):
        self.models[op.model_id]["steps"] += 1
        return {"metrics": {"learning_rate:mean": args["learning_rate"]}}

    def _save_weights(self, op, args):
        path = f"tinker://{op.model_id}/weights/{args['name']}"
        self.checkpoints[path] = dict(self.models[op.model_id])
        return {"path": path}

    def _load_weights(self, op, args):
        if args["path"] not in self.checkpoints:
            raise UserError(f"path: no checkpoint at {args['path']!r}")
        self.models[op.model_id] = dict(self.checkpoints[args["path"]])
        return {"path": args["path"]}

    def _save_weights_for_sampler(self, op, args):
        base = self.models[op.model_id]["base_model"]
        if args["name"] is None:
            self.samplers[args["sampling_session_id"]] = {"base_model": base, "model_path": None}
            return {"sampling_session_id": args["sampling_session_id"]}
        path = f"tinker://{op.model_id}/sampler_weights/{args['name']}"
        self.checkpoints[path] = {"base_model": base}
        return {"path": path}

    def _create_sampling_session(self, op, args):
        if args["model_path"] is not None:
            if args["model_path"] not in self.checkpoints:
                raise UserError(f"model_path: nothing saved at {args['model_path']!r}")
            base = self.checkpoints[args["model_path"]]["base_model"]
        elif args["base_model"] != BASE:
            raise UserError(f"base_model: {args['base_model']!r} is not served")
        else:
            base = BASE
        self.samplers[args["sampling_session_id"]] = {"base_model": base, "model_path": args["model_path"]}
        return {"sampling_session_id": args["sampling_session_id"]}

    def _sample(self, op, args):
        """Even samples stop on the stop token, odd ones run to max_tokens."""
        prompt, sequences = args["prompt"], []
        for i in range(args["num_samples"]):
            if i % 2 == 0:
                tokens, reason = [prompt[-1] + 1 + i, STOP_TOKEN], "stop"
            else:
                tokens, reason = [100 + i] * args["max_tokens"], "length"
            sequences.append(SampledSequence(tokens, fake_logprobs(torch.tensor(tokens)).tolist(), reason))
        prompt_logprobs = None
        if args["prompt_logprobs"]:
            prompt_logprobs = [None] + fake_logprobs(torch.tensor(prompt[1:])).tolist()
        return SampleResult(sequences, prompt_logprobs)

    def model_info(self, model_id):
        if model_id not in self.models:
            raise UserError(f"model_id: unknown model {model_id!r}")
        return {"base_model": self.models[model_id]["base_model"], "lora_rank": self.models[model_id]["lora_rank"]}

    def sampler_info(self, sampling_session_id):
        if sampling_session_id not in self.samplers:
            raise UserError(f"sampling_session_id: unknown {sampling_session_id!r}")
        return self.samplers[sampling_session_id]

    def capabilities(self):
        return [{"model_name": BASE, "max_context_length": 64, "trainable": True, "sampleable": True}]


class Tap:
    """Wraps the app: records the path of every request, and answers the next request to a path
    in ``lose`` with a 503 after the app handled it (a response lost on the way)."""

    def __init__(self, app):
        self.app = app
        self.paths: list[str] = []
        self.lose: set[str] = set()

    async def __call__(self, scope, receive, send):
        self.paths.append(scope["path"])
        if scope["path"] not in self.lose:
            return await self.app(scope, receive, send)
        self.lose.discard(scope["path"])

        async def nowhere(message):
            pass

        await self.app(scope, receive, nowhere)
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"lost"})


@pytest.fixture(scope="module")
def service():
    backend = FakeBackend()
    app = build_app(
        backend,
        api_key=KEY,
        poll_timeout_s=POLL_S,
        retrieved_ttl_s=RETRIEVED_TTL_S,
        client_config={"fwdbwd_max_chunk_len": 2},
    )
    wrapped = Tap(app)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        with ServiceServer(wrapped) as server:
            yield server, backend, wrapped, app


@pytest.fixture
def client(service):
    server = service[0]
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as service_client:
        yield service_client


def datum(tokens: list[int], targets, weights) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def make_batch() -> list[types.Datum]:
    """One-dimensional datums and a top-K one whose (N, K) weights travel as sparse CSR."""
    top_k_targets = torch.arange(24, dtype=torch.int64).reshape(6, 4) * 37 + 11
    top_k_weights = torch.zeros(6, 4)
    top_k_weights[[0, 2, 3, 5], [1, 0, 3, 2]] = torch.tensor([0.25, 1.5, -2.0, 0.75])
    return [
        datum([1, 2, 3, 4], torch.tensor([2, 3, 4, 5]), torch.tensor([0.0, 1.0, 1.0, 0.5])),
        datum([9, 8, 7, 6, 5, 4], top_k_targets, top_k_weights),
        datum([11, 12, 13], torch.tensor([12, 13, 900]), torch.tensor([1.0, -1.0, 2.0])),
    ]


def expected_loss(batch: list[types.Datum]) -> float:
    """sum(-logprob * weight) computed here, in float64, from the datums as the client holds them."""
    total = 0.0
    for d in batch:
        targets = d.loss_fn_inputs["target_tokens"].to_numpy().astype(np.float64)
        weights = d.loss_fn_inputs["weights"].to_numpy().astype(np.float64)
        total += float((0.5 * targets / 1000 * weights).sum())
    return total


def ops_of(backend: FakeBackend, model_id: str, kind: str) -> list:
    return [op for op in backend.ops if op.model_id == model_id and op.kind == kind]


def test_forward_and_forward_backward_carry_every_datum_exactly(service, client):
    _, backend, _, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=8, seed=3, train_unembed=False).result()
    info = trainer.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 8 and info.is_lora
    create = ops_of(backend, trainer.model_id, "create_model")[0]
    assert create.seq_id is None
    assert create.args == {
        "base_model": BASE, "lora_rank": 8, "seed": 3, "train_unembed": False, "train_mlp": True, "train_attn": True,
    }  # fmt: skip

    batch = make_batch()
    assert batch[1].loss_fn_inputs["weights"].sparse_crow_indices is not None  # the CSR path is exercised
    for forward_only in (True, False):
        call = trainer.forward if forward_only else trainer.forward_backward
        output = call(batch, "cross_entropy", {"clip_low_threshold": 0.5}).result()
        ran = ops_of(backend, trainer.model_id, "forward_backward")[-2:]  # 3 datums in chunks of 2
        assert [len(op.args["data"]) for op in ran] == [2, 1]
        assert [op.seq_id for op in ran] == ([1, 2] if forward_only else [3, 4])
        for op in ran:
            assert op.args["forward_only"] is forward_only
            assert op.args["loss_fn"] == "cross_entropy" and op.args["loss_fn_config"] == {"clip_low_threshold": 0.5}
        sent = [d for op in ran for d in op.args["data"]]
        for d, original in zip(sent, batch, strict=True):
            assert d.tokens == original.model_input.to_ints()
            for name, tensor in original.loss_fn_inputs.items():
                assert torch.equal(d.inputs[name], tensor.to_torch())
        faked = [lp for op in ran for lp in backend.results[op.request_id].logprobs]
        for got, fake, original in zip(output.loss_fn_outputs, faked, batch, strict=True):
            assert torch.equal(got["logprobs"].to_torch(), fake)
            assert got["logprobs"].to_torch().shape == original.loss_fn_inputs["target_tokens"].to_torch().shape
        fake_sum = sum(backend.results[op.request_id].metrics["loss:sum"] for op in ran)
        assert output.metrics["loss:sum"] == fake_sum
        assert math.isclose(output.metrics["loss:sum"], expected_loss(batch), rel_tol=1e-6)
        assert output.metrics["num_datums:sum"] == 3


def test_optim_step_hands_adam_params_to_the_backend(service, client):
    _, backend, _, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    trainer.forward_backward(make_batch()[:1], "cross_entropy")  # posted before, not awaited
    params = types.AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-9, weight_decay=0.01, grad_clip_norm=1.5)
    result = trainer.optim_step(params).result()
    assert result.metrics == {"learning_rate:mean": 3e-3}
    (step,) = ops_of(backend, trainer.model_id, "optim_step")
    assert step.seq_id == 2
    assert step.args == params.model_dump()


def test_save_and_load_state_and_create_from_state(service, client):
    _, backend, _, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    trainer.forward_backward(make_batch()[:1], "cross_entropy")
    trainer.optim_step(types.AdamParams()).result()
    saved = trainer.save_state("step-1").result()
    assert saved.path == f"tinker://{trainer.model_id}/weights/step-1"
    with pytest.warns(FutureWarning):
        loaded = trainer.load_state(saved.path).result()
    assert loaded.path == saved.path
    assert ops_of(backend, trainer.model_id, "load_weights")[0].args == {"path": saved.path, "optimizer": False}

    resumed = client.create_training_client_from_state_with_optimizer(saved.path).result()
    session_id = trainer.model_id.split(":train:")[0]
    assert resumed.model_id.startswith(f"{session_id}:train:") and resumed.model_id != trainer.model_id
    (load,) = ops_of(backend, resumed.model_id, "load_weights")
    assert load.seq_id is None
    assert load.args == {"path": saved.path, "optimizer": True, "base_model": None}
    assert backend.models[resumed.model_id]["steps"] == 1
    assert resumed.get_info().model_data.model_name == BASE
    resumed.forward_backward(make_batch()[:1], "cross_entropy").result()  # its sequence starts at 1
    assert ops_of(backend, resumed.model_id, "forward_backward")[0].seq_id == 1

    with pytest.raises(tinker.RequestFailedError, match="path: no checkpoint"):
        client.create_training_client_from_state("tinker://nowhere/weights/x").result()


def check_samples(response, prompt, num_samples, max_tokens):
    assert len(response.sequences) == num_samples
    ids = [s.sequence_id for s in response.sequences]
    assert len(set(ids)) == num_samples and all(isinstance(i, str) for i in ids)
    for i, sequence in enumerate(response.sequences):
        if i % 2 == 0:
            assert sequence.tokens == [prompt[-1] + 1 + i, STOP_TOKEN] and sequence.stop_reason == "stop"
        else:
            assert sequence.tokens == [100 + i] * max_tokens and sequence.stop_reason == "length"
        assert sequence.logprobs == fake_logprobs(torch.tensor(sequence.tokens)).tolist()


def test_sampling_clients_of_every_kind(service, client):
    _, backend, _, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    prompt = [5, 6, 7, 8]
    params = types.SamplingParams(max_tokens=3, stop=[STOP_TOKEN], temperature=0.7, top_k=5, top_p=0.9, seed=11)
    named = trainer.save_weights_for_sampler("policy").result()
    assert named.path == f"tinker://{trainer.model_id}/sampler_weights/policy"
    samplers = [
        client.create_sampling_client(model_path=named.path).result(),
        trainer.save_weights_and_get_sampling_client().result(),
        client.create_sampling_client(base_model=BASE).result(),
    ]
    for num_samples, sampler in zip((3, 1, 4), samplers, strict=True):
        response = sampler.sample(types.ModelInput.from_ints(prompt), num_samples, params).result()
        check_samples(response, prompt, num_samples, 3)
        assert response.prompt_logprobs is None
    (ephemeral,) = ops_of(backend, trainer.model_id, "save_weights_for_sampler")[1:]
    session_id = trainer.model_id.split(":train:")[0]
    assert ephemeral.args["name"] is None and ephemeral.args["sampling_session_id"].startswith(f"{session_id}:sample:")
    sample_ops = [op for op in backend.ops if op.kind == "sample"][-3:]
    assert sample_ops[0].args == {
        "sampling_session_id": sample_ops[0].args["sampling_session_id"], "prompt": prompt, "num_samples": 3,
        "max_tokens": 3, "seed": 11, "stop": [STOP_TOKEN], "temperature": 0.7, "top_k": 5, "top_p": 0.9,
        "prompt_logprobs": False,
    }  # fmt: skip
    assert backend.samplers[sample_ops[0].args["sampling_session_id"]]["model_path"] == named.path

    string_stop = types.SamplingParams(max_tokens=2, stop="\n\nUser:")
    samplers[2].sample(types.ModelInput.from_ints(prompt), 1, string_stop).result()
    assert backend.ops[-1].args["stop"] == ["\n\nUser:"]

    logprobs = samplers[0].compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert logprobs[0] is None and logprobs[1:] == fake_logprobs(torch.tensor(prompt[1:])).tolist()
    last = samplers[0].compute_logprobs(types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=2).result()
    assert last[:2] == [None, None] and last[2:] == logprobs[2:]

    with pytest.raises(tinker.RequestFailedError, match="topk_prompt_logprobs"):
        samplers[2].sample(types.ModelInput.from_ints(prompt), 1, params, topk_prompt_logprobs=2).result()
    with pytest.raises(tinker.BadRequestError, match="model_path: nothing saved"):
        client.create_sampling_client(model_path="tinker://x:train:0/sampler_weights/none").result()


def test_server_capabilities(service):
    rest = tinker.RestClient(base_url=service[0].url, api_key=KEY)
    capabilities = rest.get_server_capabilities().result()
    assert [m.model_name for m in capabilities.supported_models] == [BASE]
    assert capabilities.supported_models[0].max_context_length == 64


def test_user_errors_name_the_field_and_the_model_goes_on(service, client):
    _, backend, _, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    backend.fail_next["optim_step"] = UserError("learning_rate: must be positive")
    with pytest.raises(tinker.RequestFailedError, match="learning_rate: must be positive") as failure:
        trainer.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    assert failure.value.category == types.RequestErrorCategory.User

    # Refused by the wire layer itself: the request still takes its turn in the model's sequence.
    image = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.ImageChunk(data=b"x", format="png")])
    bad = types.Datum(model_input=image, loss_fn_inputs={"target_tokens": torch.tensor([2, 3, 4])})
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\]\.model_input chunk 1 is image"):
        trainer.forward([bad], "cross_entropy").result()
    output = trainer.forward(make_batch()[:1], "cross_entropy").result(timeout=10)  # not stuck behind it
    assert output.metrics["loss:sum"] == pytest.approx(expected_loss(make_batch()[:1]))
    assert [op.kind for op in backend.ops if op.model_id == trainer.model_id][-3:] == [
        "optim_step", "skip", "forward_backward",
    ]  # fmt: skip

    with pytest.raises(tinker.BadRequestError, match="base_model: 'nope/nope' is not served"):
        client.create_sampling_client(base_model="nope/nope").result()


def test_a_retried_post_runs_once(service, client):
    server, backend, tap, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    tap.lose.add("/api/v1/forward_backward")
    before = tap.paths.count("/api/v1/forward_backward")
    output = trainer.forward_backward(make_batch()[:1], "cross_entropy").result(timeout=10)
    assert tap.paths.count("/api/v1/forward_backward") == before + 2  # the SDK posted it again
    assert len(ops_of(backend, trainer.model_id, "forward_backward")) == 1
    assert output.metrics["loss:sum"] == pytest.approx(expected_loss(make_batch()[:1]))

    # The same (model_id, seq_id) with the same body: the same future; with another body: refused.
    body = {"model_id": trainer.model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.5}, "type": "optim_step"}
    headers = {"X-API-Key": KEY}
    first = httpx.post(f"{server.url}/api/v1/optim_step", json=body, headers=headers).json()
    again = httpx.post(f"{server.url}/api/v1/optim_step", json=body, headers=headers).json()
    assert first == again and first["model_id"] == trainer.model_id
    other = httpx.post(
        f"{server.url}/api/v1/optim_step", json={**body, "adam_params": {"learning_rate": 0.25}}, headers=headers
    ).json()
    assert other["request_id"] != first["request_id"]
    retrieve = f"{server.url}/api/v1/retrieve_future"
    answer = httpx.post(retrieve, json={"request_id": other["request_id"]}, headers=headers).json()
    assert answer["category"] == "user" and answer["error"].startswith("seq_id:")
    while (answer := httpx.post(retrieve, json={"request_id": first["request_id"]}, headers=headers).json()).get(
        "type"
    ) == "try_again":
        pass
    assert answer["metrics"] == {"learning_rate:mean": 0.5}
    assert [op.args["learning_rate"] for op in ops_of(backend, trainer.model_id, "optim_step")] == [0.5]


def test_a_zstd_body_and_a_json_result_for_clients_that_ask_for_json(service, client):
    server, backend, _, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=make_batch()[:2], loss_fn="cross_entropy"),
        model_id=trainer.model_id,
        seq_id=1,
    )
    body = zstandard.ZstdCompressor().compress(forward_backward_request_to_proto(request).SerializeToString())
    headers = {"X-API-Key": KEY, "content-type": wire.PROTOBUF, "content-encoding": "zstd"}
    future = httpx.post(f"{server.url}/api/v1/forward_backward", content=body, headers=headers).json()
    retrieve = {"request_id": future["request_id"]}
    while (answer := httpx.post(f"{server.url}/api/v1/retrieve_future", json=retrieve, headers=headers).json()).get(
        "type"
    ) == "try_again":
        pass
    fake = backend.results[future["request_id"]]
    assert answer["metrics"] == fake.metrics
    assert [o["logprobs"]["data"] for o in answer["loss_fn_outputs"]] == [lp.ravel().tolist() for lp in fake.logprobs]
    assert [o["logprobs"]["shape"] for o in answer["loss_fn_outputs"]] == [[4], [6, 4]]


def test_a_slow_operation_completes_through_try_again(service, client):
    _, backend, tap, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    backend.delay_s["optim_step"] = 4 * POLL_S
    try:
        before = tap.paths.count("/api/v1/retrieve_future")
        assert trainer.optim_step(types.AdamParams(learning_rate=0.125)).result().metrics == {
            "learning_rate:mean": 0.125
        }
        assert tap.paths.count("/api/v1/retrieve_future") - before >= 3
    finally:
        backend.delay_s.clear()


def test_wrong_or_missing_api_key_is_refused(service):
    server = service[0]
    with pytest.raises(tinker.AuthenticationError, match="X-API-Key"):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").create_lora_training_client(BASE).result()
    assert httpx.post(f"{server.url}/api/v1/create_session", json={}).status_code == 401
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}


def test_bad_requests_get_clear_answers_and_the_server_keeps_serving(service):
    server = service[0]
    headers = {"X-API-Key": KEY}
    post = lambda route, headers=headers, **kw: httpx.post(f"{server.url}/api/v1/{route}", headers=headers, **kw)  # noqa: E731
    unknown = post("retrieve_future", json={"request_id": "nope"}).json()
    assert unknown == {"error": "request_id: unknown or expired request 'nope'", "category": "user"}
    extra = post("retrieve_future", json={"request_id": "x", "bogus": 1})
    assert extra.status_code == 400 and "bogus: Extra inputs are not permitted" in extra.json()["error"]
    assert post("get_info", json={"model_id": "x:train:9"}).json()["error"] == "model_id: unknown model 'x:train:9'"
    assert post("session_heartbeat", json={"session_id": "nope"}).status_code == 404
    garbage = post("forward_backward", content=b"\xff\xff", headers={**headers, "content-type": wire.PROTOBUF})
    assert garbage.status_code == 400 and "not a ForwardBackwardRequest" in garbage.json()["error"]
    assert post("forward_backward", json={}).status_code == 415
    assert post("optim_step", content=b"{").status_code == 400
    assert httpx.get(f"{server.url}/api/v1/healthz").status_code == 200


def test_finished_futures_are_forgotten_after_the_retry_window(service, client):
    server, backend, _, _ = service
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    for _ in range(5):
        trainer.forward(make_batch()[:1], "cross_entropy").result()
    ids = [op.request_id for op in ops_of(backend, trainer.model_id, "forward_backward")]
    headers = {"X-API-Key": KEY, "accept": wire.PROTOBUF}

    def retrieve(request_id):
        return httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)

    again = retrieve(ids[-1])  # asked again at once (an answer lost on the way): still there
    assert again.headers["content-type"] == wire.PROTOBUF
    assert deserialize_forward_backward_output(again.content).metrics == backend.results[ids[-1]].metrics
    time.sleep(RETRIEVED_TTL_S + 0.1)
    for request_id in ids:
        assert retrieve(request_id).json()["error"] == f"request_id: unknown or expired request {request_id!r}"


def test_unretrieved_futures_expire():
    store = FutureStore(retrieved_ttl_s=10.0, unretrieved_ttl_s=0.05)
    record = store.create("optim_step", ("m", 1), "digest")
    time.sleep(0.1)
    assert store.get(record.request_id) is record  # still running: kept
    store.finish(record, {"metrics": {}})
    time.sleep(0.1)
    assert store.get(record.request_id) is None and store.find(("m", 1)) is None


# ---- the byte layouts, against the SDK's own converters ------------------------------------------


def test_tensors_decode_as_the_sdk_encodes_them():
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(8, 6, generator=generator)
    sparse = dense * (torch.rand(8, 6, generator=generator) < 0.25)
    for tensor in (types.TensorData.from_torch_sparse(sparse), types.TensorData.from_torch(dense)):
        decoded = wire._decode_tensor(_tensor_data_to_proto(tensor), "t")
        assert torch.equal(decoded, tensor.to_torch()) and decoded.dtype == torch.float32
    assert types.TensorData.from_torch_sparse(sparse).sparse_crow_indices is not None
    widened = pb.Tensor(dense=np.array([1, -2], "<i4").tobytes(), dtype=pb.DTYPE_INT32)
    assert torch.equal(wire._decode_tensor(widened, "t"), torch.tensor([1, -2]))
    bf16 = pb.Tensor(dense=np.array([0x3F80, 0xC000], "<u2").tobytes(), dtype=pb.DTYPE_BFLOAT16, shape=[2])
    assert torch.equal(wire._decode_tensor(bf16, "t"), torch.tensor([1.0, -2.0]))

    bad = _tensor_data_to_proto(types.TensorData.from_torch_sparse(sparse))
    bad.sparse_csr.col_indices = np.array([9] * (len(bad.sparse_csr.col_indices) // 8), "<i8").tobytes()
    with pytest.raises(UserError, match=r"w\['weights'\]: CSR column indices out of range"):
        wire._decode_tensor(bad, "w['weights']")
    with pytest.raises(UserError, match="3 values for shape"):
        wire._decode_tensor(pb.Tensor(dense=b"\0" * 12, dtype=pb.DTYPE_FLOAT32, shape=[2, 2]), "t")
    with pytest.raises(UserError, match="invalid shape"):
        wire._decode_tensor(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1 << 20, 1 << 20], sparse_csr=pb.SparseCsr()), "t")


def test_results_encode_as_the_sdk_decodes_them():
    logprobs = [torch.tensor([-0.5, -1.25]), torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]), torch.tensor([-7.0])]
    output = deserialize_forward_backward_output(
        wire.forward_backward_output_proto(ForwardBackwardResult(logprobs, {"loss:sum": 2.5}))
    )
    assert output.metrics == {"loss:sum": 2.5}
    assert [torch.equal(o["logprobs"].to_torch(), lp) for o, lp in zip(output.loss_fn_outputs, logprobs)] == [True] * 3
    with pytest.raises(RuntimeError, match="name:reduction"):
        wire.forward_backward_output_proto(ForwardBackwardResult(logprobs, {"loss": 1.0}))

    result = SampleResult(
        [SampledSequence([3, 7], [-0.25, -0.5], "stop"), SampledSequence([], [], "length")], [None, -1.5]
    )
    sample = deserialize_sample_response(wire.sample_response_proto(result))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([3, 7], [-0.25, -0.5], "stop"), ([], None, "length"),
    ]  # fmt: skip
    assert sample.prompt_logprobs == [None, -1.5]
