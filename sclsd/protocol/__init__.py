"""Every message on every socket, in one package: one module per channel.

Three channels share this schema:

* **Client API** (stream Unix socket). Frames are a 4-byte big-endian length
  followed by one msgpack map. Client -> daemon: :class:`Generate`,
  :class:`Cancel`, :class:`Ping`, and the admin message :class:`DrainWorker`.
  Daemon -> client: :class:`Accepted`, :class:`Delta`, :class:`Done`,
  :class:`Error`, :class:`Pong`, :class:`WorkerStateReply`.
* **Status socket** (stream Unix socket, same framing, read-only):
  :class:`StatusRequest` / :class:`MetricsRequest` answered by
  :class:`StatusReply` / :class:`MetricsReply`.
* **Daemon <-> worker** (ZeroMQ ROUTER/DEALER, one msgpack map per message):
  :class:`Register`, :class:`Heartbeat`, :class:`Tokens`, :class:`Result` (worker ->
  daemon) and :class:`Welcome`, :class:`BatchMsg`, :class:`Release`, :class:`Drain`,
  :class:`Resume`, :class:`Reregister`, :class:`Shutdown` (daemon -> worker).

Every message is a msgpack map whose ``type`` field names the struct. Decoding
validates types and value ranges and rejects unknown types and unknown fields,
so a handler only ever sees well-formed structures. msgpack is the only serialisation.

Modules: :mod:`.common` (the protocol version, framing constants, shared field types and
the base of every message), :mod:`.client`, :mod:`.status` and :mod:`.workers` (one per
channel), :mod:`.codec` (encoder, decoders, frames). Import the names from here:
``from sclsd import protocol as P``.
"""

from __future__ import annotations

from .client import (
    GENERATE_FEATURES,
    Accepted,
    Cancel,
    ChatMessage,
    ClientMsg,
    Delta,
    Done,
    DrainWorker,
    Error,
    Generate,
    Ping,
    Pong,
    ServerMsg,
    Structured,
    Timings,
    Usage,
    WorkerStateReply,
)
from .codec import (
    DecodeError,
    classify_decode_error,
    client_decoder,
    encode,
    frame,
    server_decoder,
    status_decoder,
    status_reply_decoder,
    to_worker_decoder,
    worker_decoder,
)
from .common import (
    DEFAULT_MAX_FRAME,
    FRAME_HEADER,
    MAX_TOKEN_LIST,
    PROTOCOL_VERSION,
    ErrorCode,
    Logprob,
    LossReason,
    NonNegFloat,
    NonNegInt,
    PosInt,
    RequestId,
    TokenId,
    TokenLogprobs,
    WorkerStateName,
    _Msg,
)
from .status import (
    EstimatedVsMeasured,
    EstimatorError,
    Limits,
    LoadingWorker,
    MetricsReply,
    MetricsRequest,
    StatusMsg,
    StatusReply,
    StatusRequest,
    StatusSnapshot,
    WorkerLosses,
    WorkerStatus,
)
from .workers import (
    BatchAck,
    BatchMsg,
    BatchRequest,
    BatchStats,
    ContinueRow,
    DaemonToWorkerMsg,
    Drain,
    EngineCaps,
    Forget,
    GrammarLimits,
    Heartbeat,
    Keepalive,
    Register,
    Release,
    RequestOutput,
    Reregister,
    Result,
    Resume,
    Shutdown,
    Tokens,
    Welcome,
    WorkerMsg,
)

__all__ = [
    "Accepted",
    "BatchAck",
    "BatchMsg",
    "BatchRequest",
    "BatchStats",
    "Cancel",
    "ChatMessage",
    "ClientMsg",
    "DEFAULT_MAX_FRAME",
    "GENERATE_FEATURES",
    "MAX_TOKEN_LIST",
    "DaemonToWorkerMsg",
    "DecodeError",
    "Delta",
    "Done",
    "Drain",
    "DrainWorker",
    "EngineCaps",
    "Error",
    "ErrorCode",
    "EstimatedVsMeasured",
    "EstimatorError",
    "FRAME_HEADER",
    "Generate",
    "GrammarLimits",
    "Heartbeat",
    "Keepalive",
    "Limits",
    "LoadingWorker",
    "Logprob",
    "MetricsReply",
    "MetricsRequest",
    "NonNegFloat",
    "NonNegInt",
    "PROTOCOL_VERSION",
    "Ping",
    "Pong",
    "PosInt",
    "Register",
    "Release",
    "ContinueRow",
    "Forget",
    "RequestId",
    "RequestOutput",
    "Reregister",
    "Result",
    "Resume",
    "ServerMsg",
    "Structured",
    "Shutdown",
    "StatusMsg",
    "StatusReply",
    "StatusRequest",
    "StatusSnapshot",
    "Timings",
    "TokenId",
    "TokenLogprobs",
    "Tokens",
    "Usage",
    "Welcome",
    "WorkerMsg",
    "WorkerStateName",
    "LossReason",
    "WorkerLosses",
    "WorkerStateReply",
    "WorkerStatus",
    "_Msg",
    "classify_decode_error",
    "client_decoder",
    "encode",
    "frame",
    "server_decoder",
    "status_decoder",
    "status_reply_decoder",
    "to_worker_decoder",
    "worker_decoder",
]
