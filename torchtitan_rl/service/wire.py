"""The service's wire formats: ``forward_backward`` requests in and ``forward`` /
``forward_backward`` / ``sample`` results out as protobuf, in the schema of the SDK's own
generated module (``tinker.proto.tinker_public_pb2``) and the byte layouts its converters read
and write; the JSON shapes of the same results for clients that do not ask for protobuf; and the
``sample`` operation's args of a JSON sample request.

Byte layouts (little-endian, as numpy writes them): token ids int32; tensors in their declared
dtype (float32, int64; int32 and bfloat16 are widened to int64 and float32 on the way in); a
sparse CSR tensor's row pointers and column indices int64; per-datum outputs concatenated, with
int64 *byte* offsets (one more than the datums); sampled log-probs float32, a missing prompt
log-prob NaN.
"""

import math
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from torchtitan_rl.service.operations import ForwardBackwardResult, SampleResult, TinkerDatum, UserError

PROTOBUF = "application/x-protobuf"

# The element count a decoded tensor may have: a sparse tensor's dense size comes from its
# declared shape alone, so a few bytes of request could otherwise ask for any amount of memory.
MAX_TENSOR_ELEMENTS = 1 << 26

_WIRE_DTYPES = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The request message; a body that is not one is the client's mistake."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as error:
        raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({error})") from None
    return message


def forward_backward_args(message: pb.ForwardBackwardRequest) -> dict[str, Any]:
    """The ``forward_backward`` operation's args (see ``operations``) of a parsed request."""
    return {
        "data": [_decode_datum(datum, f"data[{i}]") for i, datum in enumerate(message.data)],
        "loss_fn": message.loss_fn,
        "loss_fn_config": _loss_fn_config(message),
        "forward_only": message.forward_only,
    }


def _loss_fn_config(message: pb.ForwardBackwardRequest) -> dict[str, float]:
    # The SDK writes every number to both maps and text only to v2; v2 wins where both are set.
    config = {key: float(value) for key, value in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise UserError(f"loss_fn_config[{key!r}] is text ({value.text!r}); the built-in losses take numbers")
        config[key] = float(value.number)
    return config


def _decode_datum(datum: pb.Datum, where: str) -> TinkerDatum:
    tokens: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(
                f"{where}.model_input chunk {j} is {kind or 'empty'}: only encoded_text chunks are supported"
            )
        tokens.extend(_frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"), f"{where}.model_input[{j}]").tolist())
    inputs = {
        name: _decode_tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]")
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return TinkerDatum(tokens=tokens, inputs=inputs)


def _frombuffer(data: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise UserError(f"{where}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(data, dtype=dtype)


def _decode_tensor(tensor: pb.Tensor, where: str) -> torch.Tensor:
    """A dense CPU tensor of the declared shape (1-D when none is declared); int64 or float32."""
    dtype = _WIRE_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise UserError(f"{where}: unsupported dtype {tensor.dtype} (float32 or int64 expected)")
    shape = list(tensor.shape)
    if any(size < 0 for size in shape) or math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise UserError(f"{where}: invalid shape {shape}")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        array = _densify_csr(tensor.sparse_csr, dtype, shape, where)
    else:
        array = _frombuffer(tensor.dense, dtype, where)
        if shape and array.size != math.prod(shape):
            raise UserError(f"{where}: {array.size} values for shape {shape}")
        array = array.reshape(shape or [array.size])
    if tensor.dtype == pb.DTYPE_BFLOAT16:  # the upper half of a float32
        array = (array.astype(np.uint32) << 16).view(np.float32)
    wide = np.int64 if array.dtype.kind in "iu" else np.float32
    return torch.from_numpy(np.ascontiguousarray(array, dtype=wide).copy())


def _densify_csr(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    """Unlisted entries are 0, the pad value the SDK's automatic sparsification leaves out."""
    if len(shape) != 2:
        raise UserError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    values = _frombuffer(csr.values, dtype, f"{where}.values")
    row_pointers = _frombuffer(csr.crow_indices, np.dtype("<i8"), f"{where}.crow_indices")
    columns = _frombuffer(csr.col_indices, np.dtype("<i8"), f"{where}.col_indices")
    num_rows, num_columns = shape
    counts = np.diff(row_pointers)
    if (
        len(row_pointers) != num_rows + 1
        or row_pointers[0] != 0
        or row_pointers[-1] != len(values)
        or len(columns) != len(values)
        or (counts < 0).any()
    ):
        raise UserError(
            f"{where}: inconsistent CSR layout ({len(row_pointers)} row pointers for {num_rows} rows, "
            f"{len(columns)} column indices, {len(values)} values)"
        )
    rows = np.repeat(np.arange(num_rows), counts)
    same_row = rows[1:] == rows[:-1]
    if ((columns < 0) | (columns >= num_columns)).any() or (same_row & (columns[1:] <= columns[:-1])).any():
        raise UserError(f"{where}: CSR column indices out of range or not increasing within a row")
    dense = np.zeros(shape, dtype=dtype)
    dense[rows, columns] = values
    return dense


def forward_backward_output_proto(result: ForwardBackwardResult) -> bytes:
    """A ``ForwardBackwardOutput``: the metrics, and each datum's ``logprobs`` in records of
    consecutive datums whose trailing shape agrees ((N,) outputs make one record)."""
    output = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=_metrics(result.metrics))
    logprobs = [torch.as_tensor(lp, dtype=torch.float32).cpu() for lp in result.logprobs]
    start = 0
    while start < len(logprobs):
        trailing = tuple(logprobs[start].shape[1:])
        stop = start + 1
        while stop < len(logprobs) and tuple(logprobs[stop].shape[1:]) == trailing:
            stop += 1
        arrays = [lp.numpy().astype("<f4").ravel() for lp in logprobs[start:stop]]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        record = output.loss_fn_outputs.add(num_datums=stop - start)
        field = record.fields["logprobs"]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.astype("<i8").tobytes()
        field.dtype = pb.DTYPE_FLOAT32
        field.trailing_shape.extend(trailing)
        start = stop
    return output.SerializeToString()


def forward_backward_output_json(result: ForwardBackwardResult) -> dict[str, Any]:
    outputs = []
    for lp in result.logprobs:
        lp = torch.as_tensor(lp, dtype=torch.float32).cpu()
        outputs.append({"logprobs": {"data": lp.ravel().tolist(), "dtype": "float32", "shape": list(lp.shape)}})
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": _metrics(result.metrics)}


def _metrics(metrics: dict[str, float]) -> dict[str, float]:
    # The SDK splits every key at its one ":" to find how to combine chunks' metrics.
    bad = [key for key in metrics if key.count(":") != 1]
    if bad:
        raise RuntimeError(f"metric keys must be 'name:reduction', got {bad}")
    return {key: float(value) for key, value in metrics.items()}


def sample_response_proto(result: SampleResult) -> bytes:
    response = pb.SampleResponse()
    for sequence in result.sequences:
        response.sequences.add(
            stop_reason=_stop_reason(sequence.stop_reason),
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype="<f4").tobytes(),
        )
    if result.prompt_logprobs is not None:
        values = [math.nan if lp is None else lp for lp in result.prompt_logprobs]
        response.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return response.SerializeToString()


def sample_response_json(result: SampleResult) -> dict[str, Any]:
    sequences = [
        {"stop_reason": s.stop_reason, "tokens": list(s.tokens), "logprobs": list(s.logprobs)} for s in result.sequences
    ]
    return {"type": "sample", "sequences": sequences, "prompt_logprobs": result.prompt_logprobs}


def _stop_reason(reason: str) -> int:
    if reason not in _STOP_REASONS:
        raise RuntimeError(f"stop_reason must be one of {sorted(_STOP_REASONS)}, got {reason!r}")
    return _STOP_REASONS[reason]


# Sample request fields this service does not compute, and the values that ask for nothing.
_UNSERVED_SAMPLE_FIELDS = {
    "topk_prompt_logprobs": (0,),
    "topk_sample_logprobs": (0,),
    "target_prompt_logprobs": (None,),
    "prompt_alt_tokens_k": (0,),
    "record_stability_info": (None, False),  # the provenance stable_reinforce reads
}


def sample_args(sample: types.SampleRequest) -> dict[str, Any]:
    """The ``sample`` operation's args (see ``operations``) of a validated request."""
    for name, nothing in _UNSERVED_SAMPLE_FIELDS.items():
        if getattr(sample, name) not in nothing:
            raise UserError(f"{name}: not supported by this service")
    prompt: list[int] = []
    for j, chunk in enumerate(sample.prompt.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise UserError(f"prompt.chunks[{j}]: only encoded_text chunks are supported, got {chunk.type!r}")
        prompt.extend(chunk.tokens)
    last_n = sample.prompt_logprobs_last_n
    if last_n is not None and (not sample.prompt_logprobs or not 1 <= last_n <= len(prompt) - 1):
        raise UserError(f"prompt_logprobs_last_n: {last_n} needs prompt_logprobs and 1 <= n <= len(prompt) - 1")
    params = sample.sampling_params
    stop = params.stop
    return {
        "sampling_session_id": sample.sampling_session_id,
        "prompt": prompt,
        "num_samples": sample.num_samples,
        "max_tokens": params.max_tokens,
        "seed": params.seed,
        "stop": [stop] if isinstance(stop, str) else None if stop is None else list(stop),
        "temperature": float(params.temperature),
        "top_k": params.top_k,
        "top_p": float(params.top_p),
        "prompt_logprobs": bool(sample.prompt_logprobs),
    }
