"""Encoding and decoding: one msgpack encoder, one decoder per direction of each channel,
length-prefixed frames for the stream sockets, and decode failures mapped to error codes."""

from __future__ import annotations

import msgspec

from .client import ClientMsg, Error, ServerMsg
from .common import FRAME_HEADER, ErrorCode, _Msg
from .status import MetricsReply, StatusMsg, StatusReply
from .workers import DaemonToWorkerMsg, WorkerMsg

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

client_decoder = msgspec.msgpack.Decoder(ClientMsg)
server_decoder = msgspec.msgpack.Decoder(ServerMsg)
status_decoder = msgspec.msgpack.Decoder(StatusMsg)
status_reply_decoder = msgspec.msgpack.Decoder(StatusReply | MetricsReply | Error)
worker_decoder = msgspec.msgpack.Decoder(WorkerMsg)
to_worker_decoder = msgspec.msgpack.Decoder(DaemonToWorkerMsg)

#: Everything a decoder may raise on hostile input: malformed msgpack, a shape or value
#: the schema rejects, and nesting deeper than the decoder's recursion limit (msgspec
#: raises RecursionError for that, e.g. inside the free-form ``Register.profile``), and a
#: msgpack string that is not valid UTF-8 (msgspec raises UnicodeDecodeError).
DecodeError = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError)


def frame(msg: _Msg) -> bytes:
    """Encode one message as a length-prefixed frame for a stream socket."""
    body = _encoder.encode(msg)
    return FRAME_HEADER.pack(len(body)) + body


def classify_decode_error(exc: Exception) -> tuple[ErrorCode, str]:
    """Map a decode failure to an (error code, message) pair for the peer."""
    text = str(exc)
    if isinstance(exc, RecursionError):
        return "bad_frame", "msgpack nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return "bad_request", f"a string is not valid UTF-8: {exc.reason} at byte {exc.start}"
    if isinstance(exc, msgspec.ValidationError) and ("$.type" in text or "field `type`" in text):
        return "unknown_type", text
    if isinstance(exc, msgspec.ValidationError):
        return "bad_request", text
    return "bad_frame", f"malformed msgpack: {text}"
