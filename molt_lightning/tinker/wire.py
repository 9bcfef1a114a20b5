"""The Tinker SDK's protobuf bodies, to and from plain arrays.

``forward_backward`` requests arrive as ``tinker_public.ForwardBackwardRequest`` and its results, like ``asample``'s,
go back as protobuf (the SDK 0.38 rejects JSON for those two). The message classes are the SDK's own
(``tinker.proto.tinker_public_pb2``), so the bytes are what it writes and reads; a request's tensors are decoded with
the SDK's own reader (``response_conv._tensor_data_from_proto``: dense or sparse CSR), pinned with ``tinker==0.38.0``.
Everything else the SDK sends is JSON. What is refused here (images, audio, a tensor whose length does not match the
tokens) raises ``UserError``: the client gets it as a ``RequestFailedError`` of category ``user``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto


class UserError(ValueError):
    """A request the server will not run as asked; the message names what to change."""


@dataclass
class Datum:
    tokens: np.ndarray  # (N,) int64: the model input
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, each (N,) (or (N, ...)): target_tokens, weights, logprobs, ...
    sampled: list[tuple[str, int, int]] = field(default_factory=list)  # (sequence_id, offset, length) of loss inputs


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]
    error: UserError | None = None  # a datum that cannot be read: the op fails in its turn (its seq_id is known)


def read_forward_backward(body: bytes) -> ForwardBackward:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise UserError(f"the forward_backward body is not a ForwardBackwardRequest protobuf ({e})") from None
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    fb = ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, [])
    try:
        fb.data = [_datum(d, i) for i, d in enumerate(msg.data)]
    except UserError as e:
        fb.error = e
    return fb


def _datum(d: pb.Datum, index: int) -> Datum:
    tokens = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"datum {index}: a {kind or 'empty'} chunk in model_input; molt tinker trains on token "
                            "chunks (EncodedTextChunk) only")
        tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    ids = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
    if ids.size == 0:
        raise UserError(f"datum {index} has an empty model_input")
    inputs = {}
    for name, tensor in d.loss_fn_inputs.items():
        try:
            array = _tensor_data_from_proto(tensor).to_numpy()
        except Exception as e:
            raise UserError(f"datum {index}: loss_fn_inputs[{name!r}] is no readable tensor ({e})") from None
        if array.shape[:1] != ids.shape:
            raise UserError(f"datum {index}: loss_fn_inputs[{name!r}] has shape {list(array.shape)} but the model "
                            f"input has {ids.size} tokens: each loss input holds one value per input position")
        inputs[name] = array
    sampled = [(s.sampled_tokens.sequence_id, s.sampled_tokens.offset, s.sampled_tokens.length)
               for s in d.loss_fn_input_spans if s.HasField("sampled_tokens")]
    return Datum(ids, inputs, sampled)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: one ArrayRecord holding every datum's per-token ``logprobs``. Every metric key
    must read ``name:reduction`` (the SDK splits on the one ``:`` to merge chunks)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    field_ = record.fields["logprobs"]
    field_.data = np.concatenate([lp.astype(np.float32) for lp in logprobs]).tobytes() if logprobs else b""
    field_.offsets = np.cumsum([0] + [4 * lp.size for lp in logprobs]).astype(np.int64).tobytes()
    field_.dtype = pb.DTYPE_FLOAT32
    for key, value in metrics.items():
        assert key.count(":") == 1, key
        out.metrics[key] = float(value)
    return out.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # True: a stop (end of turn or a stop sequence); False: max_tokens


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()
