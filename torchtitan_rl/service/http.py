"""The service's HTTP layer: the routes of the tinker SDK (0.38) that the ServiceClient,
TrainingClient, SamplingClient and RestClient call in the cookbook's loops, served by FastAPI
on a uvicorn thread (``ServiceServer``).

Each request that does work becomes one ``Operation`` handed to the backend (the dispatch layer
on rank 0), which runs it in its model's ``seq_id`` order and completes it from its own thread.
The POST answers at once with a request id; the SDK then polls ``retrieve_future``, which waits
up to ``poll_timeout_s`` (under the SDK's 45 s poll timeout) and otherwise answers ``try_again``.
A retried POST (same ``(model_id, seq_id)``, or ``(sampling_session_id, seq_id)`` for a sample)
gets the first one's future; the backend sees it once.

Errors: a request the service refuses comes back as the SDK's user error naming the field, as a
failed future (``{"error": ..., "category": "user"}``, raised as ``RequestFailedError``) where
the SDK expects one, else as a 4xx whose body says the same. A malformed request of a training
model still takes its place in the model's sequence (a ``skip`` operation), so the model's next
requests run.
"""

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import uvicorn
import zstandard
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from tinker import types

from torchtitan_rl.service import wire
from torchtitan_rl.service.futures import FutureRecord, FutureStore, body_digest
from torchtitan_rl.service.operations import Backend, Operation, SampleResult, UserError

logger = logging.getLogger(__name__)

API = "/api/v1"
# The most samples one sample request may ask for (each gets an id in the POST's answer).
MAX_NUM_SAMPLES = 4096
# How long a route that answers with the result itself (create_sampling_session) waits for it,
# under the SDK's 60 s request timeout; past it the answer is 408, which the SDK retries.
DIRECT_WAIT_S = 50.0

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # no JWT exchange: the X-API-Key header is the credential
    "use_pyqwest_transport": False,  # plain httpx
    # Chunks of one forward_backward may be posted concurrently: the dispatch layer runs them in
    # seq_id order anyway.
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,  # plain bodies by default; a zstd one is taken too
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,  # forward_backward_custom runs in the client
    "sample_join_sampling_session": False,
}
# Sampling cancellation stays off: the SDK then never calls the cancel route, which is not served.
DYNAMIC_CLIENT_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

_NO_RETRY = {"x-should-retry": "false"}  # the SDK's HTTP client would retry a 5xx otherwise


class _Refused(Exception):
    """A request answered with an HTTP error status at once (no future)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error_body(error: BaseException) -> dict[str, str]:
    if isinstance(error, UserError):
        return {"error": str(error), "category": "user"}
    return {"error": f"{type(error).__name__}: {error}", "category": "server"}


def _validation_message(error: ValidationError, route: str) -> str:
    problems = [f"{'.'.join(str(part) for part in e['loc']) or '(body)'}: {e['msg']}" for e in error.errors()]
    return f"{route}: " + "; ".join(problems)


def _validate(model: type[BaseModel], body: dict, route: str) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise UserError(_validation_message(error, route)) from None


def build_app(
    backend: Backend,
    *,
    api_key: str | None = None,
    poll_timeout_s: float = 30.0,
    retrieved_ttl_s: float = 120.0,
    unretrieved_ttl_s: float = 3600.0,
    client_config: dict[str, Any] | None = None,
) -> FastAPI:
    """The FastAPI app of the service in front of ``backend``.

    ``api_key``: when set, every route but ``healthz`` answers 401 unless the request's
    ``X-API-Key`` header is this key. ``poll_timeout_s``: how long one ``retrieve_future`` waits
    for a result before answering ``try_again``. ``retrieved_ttl_s`` / ``unretrieved_ttl_s``: how
    long a finished future is kept after its result was handed out / when no one asks for it
    (``futures.FutureStore``); ``app.state.futures`` is the store. ``client_config``: flags of
    the SDK's ``ClientConfigResponse`` to set over ``CLIENT_CONFIG`` (e.g. ``fwdbwd_max_chunk_len``,
    the most datums the SDK puts in one forward_backward request).
    """
    app = FastAPI(title="torchtitan_rl Tinker-compatible service", docs_url=None, redoc_url=None, openapi_url=None)
    store = FutureStore(retrieved_ttl_s, unretrieved_ttl_s)
    finished: dict[str, bool] = {}  # session id -> whether the client finished it
    config = {**CLIENT_CONFIG, **(client_config or {})}
    app.state.futures = store

    # ---- plumbing ---------------------------------------------------------------------------

    @app.exception_handler(_Refused)
    async def refused(request: Request, error: _Refused) -> JSONResponse:
        return JSONResponse({"error": str(error), "category": "user"}, error.status, headers=_NO_RETRY)

    @app.exception_handler(UserError)
    async def user_error(request: Request, error: UserError) -> JSONResponse:
        return JSONResponse(_error_body(error), 400, headers=_NO_RETRY)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(_error_body(error), 500, headers=_NO_RETRY)

    if api_key is not None:

        @app.middleware("http")
        async def check_api_key(request: Request, call_next: Callable) -> Response:
            given = request.headers.get("x-api-key", "").encode()
            if request.url.path != f"{API}/healthz" and not hmac.compare_digest(given, api_key.encode()):
                body = {"error": "X-API-Key: missing, or not this service's key", "category": "user"}
                return JSONResponse(body, 401, headers=_NO_RETRY)
            return await call_next(request)

    async def json_body(request: Request) -> tuple[bytes, dict]:
        raw = await request.body()
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise _Refused(400, f"{request.url.path}: the body is not JSON") from None
        if not isinstance(body, dict):
            raise _Refused(400, f"{request.url.path}: the body is not a JSON object")
        return raw, body

    def check_session(session_id: str) -> None:
        if session_id not in finished:
            raise UserError(f"session_id: unknown session {session_id!r} (create one with create_session)")
        if finished[session_id]:
            raise UserError(f"session_id: session {session_id!r} is finished")

    def submit(record: FutureRecord, op: Operation) -> None:
        try:
            backend.submit(op, store.completer(record))
        except Exception as error:  # the backend refused at once (e.g. shutting down)
            store.finish(record, error)

    def failed(kind: str, key: Any, digest: str, error: UserError) -> FutureRecord:
        record = store.create(kind, key, digest)
        store.finish(record, error)
        return record

    def future_response(record: FutureRecord, model_id: str | None = None) -> dict:
        answer: dict[str, Any] = {"request_id": record.request_id}
        if model_id is not None:
            answer["model_id"] = model_id
        if "sample_sequence_ids" in record.context:
            answer["sample_sequence_ids"] = record.context["sample_sequence_ids"]
        return answer

    def accept(
        kind: str,
        key: Any,
        digest: str,
        make_op: Callable[[str], Operation],
        context: dict[str, Any] | None = None,
    ) -> FutureRecord:
        """The record of a request: the first one's when this is a retry, else a new one whose
        operation ``make_op(request_id)`` goes to the backend (a UserError fails it at once)."""
        if key is not None:
            existing = store.find(key)
            if existing is not None:
                if existing.digest == digest:
                    return existing
                return failed(kind, None, digest, UserError(f"seq_id: {key} was already used by another request"))
        record = store.create(kind, key, digest, context)
        try:
            op = make_op(record.request_id)
        except UserError as error:
            store.finish(record, error)
            return record
        submit(record, op)
        return record

    async def sequenced(request: Request, kind: str, model: type[BaseModel], make_args: Callable) -> dict:
        """A JSON request in a training model's sequence (optim_step, save_weights, ...)."""
        raw, body = await json_body(request)
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        if not (isinstance(model_id, str) and type(seq_id) is int and seq_id >= 1):
            _validate(model, body, kind)  # names what is wrong when the body is malformed
            raise UserError(f"{kind}: model_id and seq_id >= 1 are required, got {model_id!r}, {seq_id!r}")

        def make_op(request_id: str) -> Operation:
            try:
                args = make_args(_validate(model, body, kind))
            except UserError as error:  # keep the model's sequence going past this request
                return Operation(request_id, "skip", model_id, seq_id, {"error": error})
            return Operation(request_id, kind, model_id, seq_id, args)

        record = accept(kind, (model_id, seq_id), body_digest(raw), make_op)
        return future_response(record, model_id)

    # ---- client setup and sessions ------------------------------------------------------------

    @app.get(f"{API}/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post(f"{API}/client/config")
    async def get_client_config() -> dict:
        return config

    @app.post(f"{API}/client/dynamic_config")
    async def client_dynamic_config() -> dict:
        return DYNAMIC_CLIENT_CONFIG

    @app.post(f"{API}/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict:
        _, body = await json_body(request)
        _validate(types.CreateSessionRequest, body, "create_session")
        session_id = uuid.uuid4().hex[:16]
        finished[session_id] = False
        return {"type": "create_session", "session_id": session_id}

    @app.post(f"{API}/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict:
        _, body = await json_body(request)
        session_id = _validate(types.SessionHeartbeatRequest, body, "session_heartbeat").session_id
        if session_id not in finished:
            raise _Refused(404, f"session_id: unknown session {session_id!r}")
        if finished[session_id]:
            raise _Refused(410, f"session_id: session {session_id!r} is finished")  # the SDK stops beating
        return {"type": "session_heartbeat"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str) -> dict:
        if session_id not in finished:
            raise _Refused(404, f"session_id: unknown session {session_id!r}")
        finished[session_id] = True
        return {}

    @app.get(f"{API}/get_server_capabilities")
    async def get_server_capabilities() -> dict:
        return {"supported_models": await run_in_threadpool(backend.capabilities)}

    # ---- training models --------------------------------------------------------------------

    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict:
        raw, body = await json_body(request)
        create = _validate(types.CreateModelRequest, body, "create_model")
        model_id = f"{create.session_id}:train:{create.model_seq_id}"

        def make_op(request_id: str) -> Operation:
            check_session(create.session_id)
            _check_adamw(create.optimizer_config, "optimizer_config")
            lora = create.lora_config
            if lora is None:
                raise UserError("lora_config: required; this service trains LoRA adapters")
            args = {
                "base_model": create.base_model,
                "lora_rank": lora.rank,
                "seed": lora.seed,
                "train_unembed": lora.train_unembed,
                "train_mlp": lora.train_mlp,
                "train_attn": lora.train_attn,
            }
            return Operation(request_id, "create_model", model_id, None, args)

        record = accept("create_model", (model_id, "create"), body_digest(raw), make_op, {"model_id": model_id})
        return future_response(record, model_id)

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict:
        _, body = await json_body(request)
        model_id = _validate(types.GetInfoRequest, body, "get_info").model_id
        info = await run_in_threadpool(backend.model_info, model_id)
        model_data = {
            "model_name": info["base_model"],
            "tokenizer_id": info.get("tokenizer_id"),
            "arch": info.get("arch"),
        }
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {k: v for k, v in model_data.items() if v is not None},
            "model_name": info["base_model"],
            "is_lora": True,
            "lora_rank": info.get("lora_rank"),
        }

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        if wire.PROTOBUF not in request.headers.get("content-type", ""):
            raise _Refused(415, f"forward_backward: the body must be a {wire.PROTOBUF} ForwardBackwardRequest")
        raw = await request.body()
        if request.headers.get("content-encoding", "") == "zstd":
            try:
                raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
            except zstandard.ZstdError as error:
                raise _Refused(400, f"forward_backward: the zstd body does not decompress ({error})") from None
        message = wire.parse_forward_backward(raw)
        model_id, seq_id = message.model_id, message.seq_id
        if not model_id or seq_id < 1:
            raise UserError(f"forward_backward: model_id and seq_id >= 1 are required, got {model_id!r}, {seq_id}")

        def make_op(request_id: str) -> Operation:
            try:
                args = wire.forward_backward_args(message)
            except UserError as error:
                return Operation(request_id, "skip", model_id, seq_id, {"error": error})
            return Operation(request_id, "forward_backward", model_id, seq_id, args)

        digest = body_digest(message.SerializeToString(deterministic=True))
        record = accept("forward_backward", (model_id, seq_id), digest, make_op)
        return future_response(record, model_id)

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict:
        def args(step: types.OptimStepRequest) -> dict:
            params = _check_adamw(step.optim_params, "adam_params")
            return {name: getattr(params, name) for name in types.AdamParams.model_fields}

        return await sequenced(request, "optim_step", types.OptimStepRequest, args)

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict:
        def args(save: types.SaveWeightsRequest) -> dict:
            if not save.path:
                raise UserError("path: the checkpoint's name is required")
            return {"name": save.path}

        return await sequenced(request, "save_weights", types.SaveWeightsRequest, args)

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        # "inflight" promises sampling on the weights of the save or newer ones: a snapshot keeps it.
        def args(save: types.SaveWeightsForSamplerRequest) -> dict:
            if save.path:
                return {"name": save.path, "sampling_session_id": None}
            if save.sampling_session_seq_id is None:
                raise UserError("save_weights_for_sampler: give path (a name) or sampling_session_seq_id")
            session_id = save.model_id.rsplit(":train:", 1)[0]  # same counter as create_sampling_session
            return {"name": None, "sampling_session_id": f"{session_id}:sample:{save.sampling_session_seq_id}"}

        return await sequenced(request, "save_weights_for_sampler", types.SaveWeightsForSamplerRequest, args)

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict:
        raw, body = await json_body(request)
        if body.get("model_id") is not None:  # load_state: an operation of an existing model
            return await sequenced(request, "load_weights", types.LoadWeightsRequest, _load_args)
        load = _validate(types.LoadWeightsRequest, body, "load_weights")
        if load.session_id is None or load.model_seq_id is None:
            raise UserError("load_weights: give model_id and seq_id, or session_id and model_seq_id")
        model_id = f"{load.session_id}:train:{load.model_seq_id}"

        def make_op(request_id: str) -> Operation:  # create from state: the model's first operation
            check_session(load.session_id)
            _check_adamw(load.optimizer_config, "optimizer_config")
            args = {**_load_args(load), "base_model": load.base_model}
            return Operation(request_id, "load_weights", model_id, None, args)

        record = accept("load_weights", (model_id, "create"), body_digest(raw), make_op, {"model_id": model_id})
        return future_response(record, model_id)

    # ---- sampling ---------------------------------------------------------------------------

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> JSONResponse:
        raw, body = await json_body(request)
        create = _validate(types.CreateSamplingSessionRequest, body, "create_sampling_session")
        check_session(create.session_id)
        sampling_session_id = f"{create.session_id}:sample:{create.sampling_session_seq_id}"
        args = {
            "sampling_session_id": sampling_session_id,
            "base_model": create.base_model,
            "model_path": create.model_path,
        }

        def make_op(request_id: str) -> Operation:
            return Operation(request_id, "create_sampling_session", None, None, args)

        record = accept("create_sampling_session", ("sampling_session", sampling_session_id), body_digest(raw), make_op)
        try:
            await asyncio.wait_for(record.finished.wait(), DIRECT_WAIT_S)
        except asyncio.TimeoutError:
            return JSONResponse({"error": "create_sampling_session: still running; retry"}, 408)
        store.retrieved(record)
        if isinstance(record.value, BaseException):
            status = 400 if isinstance(record.value, UserError) else 500
            return JSONResponse(_error_body(record.value), status, headers=_NO_RETRY)
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sampling_session_id})

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str) -> dict:
        info = await run_in_threadpool(backend.sampler_info, sampler_id)
        return {"sampler_id": sampler_id, "base_model": info["base_model"], "model_path": info.get("model_path")}

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict:
        raw, body = await json_body(request)
        sample = _validate(types.SampleRequest, body, "asample")
        session = sample.sampling_session_id
        if session is None:
            raise UserError("sampling_session_id: required (create a sampling client first)")
        if not 1 <= sample.num_samples <= MAX_NUM_SAMPLES:
            raise UserError(f"num_samples: {sample.num_samples} is not in [1, {MAX_NUM_SAMPLES}]")
        seq = sample.seq_id if sample.seq_id is not None else uuid.uuid4().hex
        context = {
            "sample_sequence_ids": [f"{session}:{seq}:{i}" for i in range(sample.num_samples)],
            "num_samples": sample.num_samples,
            "prompt_logprobs_last_n": sample.prompt_logprobs_last_n,
        }

        def make_op(request_id: str) -> Operation:
            return Operation(request_id, "sample", None, sample.seq_id, wire.sample_args(sample))

        key = ("sample", session, sample.seq_id) if sample.seq_id is not None else None
        return future_response(accept("sample", key, body_digest(raw), make_op, context))

    # ---- results ----------------------------------------------------------------------------

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        _, body = await json_body(request)
        request_id = _validate(types.FutureRetrieveRequest, body, "retrieve_future").request_id
        record = store.get(request_id)
        if record is None:
            return JSONResponse({"error": f"request_id: unknown or expired request {request_id!r}", "category": "user"})
        if not record.finished.is_set():
            try:
                await asyncio.wait_for(record.finished.wait(), poll_timeout_s)
            except asyncio.TimeoutError:
                return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        store.retrieved(record)
        try:
            return _result_response(record, wire.PROTOBUF in request.headers.get("accept", ""))
        except Exception as error:  # a result the wire cannot carry is the service's fault
            logger.exception("cannot write the result of %s %s", record.kind, request_id)
            return JSONResponse(_error_body(RuntimeError(f"cannot write the {record.kind} result: {error}")))

    return app


def _check_adamw(optimizer: Any, field: str) -> Any:
    if optimizer is not None and not isinstance(optimizer, types.AdamOptimizerConfig | types.AdamParams):
        raise UserError(f"{field}: only AdamW is served, got {getattr(optimizer, 'type', optimizer)!r}")
    return optimizer


def _load_args(load: types.LoadWeightsRequest) -> dict:
    return {"path": load.path, "optimizer": load.optimizer}


def _result_response(record: FutureRecord, protobuf: bool) -> Response:
    value = record.value
    if isinstance(value, BaseException):
        return JSONResponse(_error_body(value))
    if record.kind == "forward_backward":
        if protobuf:
            return Response(wire.forward_backward_output_proto(value), media_type=wire.PROTOBUF)
        return JSONResponse(wire.forward_backward_output_json(value))
    if record.kind == "sample":
        if len(value.sequences) != record.context["num_samples"]:
            raise RuntimeError(f"{len(value.sequences)} sequences for num_samples={record.context['num_samples']}")
        last_n = record.context["prompt_logprobs_last_n"]
        if last_n is not None and value.prompt_logprobs is not None:  # scored whole, handed out in part
            keep = len(value.prompt_logprobs) - last_n
            value = SampleResult(value.sequences, [None] * keep + list(value.prompt_logprobs[keep:]))
        if protobuf:
            return Response(wire.sample_response_proto(value), media_type=wire.PROTOBUF)
        return JSONResponse(wire.sample_response_json(value))
    answer = dict(value) if isinstance(value, dict) else {}
    if "model_id" in record.context:
        answer["model_id"] = record.context["model_id"]
    answer["type"] = record.kind
    return JSONResponse(answer)


class ServiceServer:
    """An ASGI ``app`` served by uvicorn on a daemon thread, on ``host``:``port`` (0: a free
    port, read back in ``port`` once started). ``start`` returns once it accepts connections;
    ``stop`` ends it (requests still open get ``graceful_s`` seconds)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, graceful_s: int = 1):
        self.host = host
        self.port = port
        self._config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=graceful_s,
        )  # fmt: skip
        self._server = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServiceServer":
        # Bound here, so that port 0 resolves before serving. As a TCP socket (proto IPPROTO_TCP,
        # which uvicorn's bind_socket leaves 0): only then does asyncio set TCP_NODELAY on the
        # connections it accepts, without which every response waits ~40 ms for a delayed ACK.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="tinker-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.url} stopped while starting (see the log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the HTTP server on {self.url} did not stop within {timeout_s} s")
        self._thread = None

    def __enter__(self) -> "ServiceServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
