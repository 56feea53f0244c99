"""Every message on every socket, in one module.

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
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .core.request import FinishReason

#: Bumped on any incompatible change to a message below. 2: workers authenticate
#: (``Register.auth``), acknowledge batches (:class:`BatchAck`) and hear
#: :class:`Keepalive`; the status reply is the typed :class:`StatusSnapshot`. 3: workers
#: stream tokens during a slice (:class:`Tokens`), keep KV across slices (``kv_tokens``,
#: ``kv_evicted``) and hear :class:`Release`. 4: ``generate`` grows the parameters of
#: OpenAI-style clients (``min_p``, the penalties, ``logprobs``/``top_logprobs``, ``user``,
#: ``max_tokens = None`` and ``cap_max_tokens``), ``delta``/``done`` carry ``logprobs`` and
#: batch rows/results the same. Older clients are still served: every new field has a
#: default, and the daemon sends a new field only to a request that asked for it.
PROTOCOL_VERSION = 4

#: Default cap on one client / status frame (bytes of msgpack).
DEFAULT_MAX_FRAME = 4 * 1024 * 1024
#: A stream frame's header: the body's length, 4 bytes big-endian.
FRAME_HEADER = struct.Struct(">I")

NonNegFloat = Annotated[float, Meta(ge=0.0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
RequestId = Annotated[str, Meta(min_length=1, max_length=128)]

#: Every ``Error.code`` the daemon sends (docs/protocol.md says when).
ErrorCode = Literal[
    "bad_request", "bad_frame", "frame_too_large", "unknown_type", "prompt_too_long",
    "duplicate_id", "unknown_id", "overloaded", "draining", "shutdown", "forbidden",
    "unknown_worker", "no_workers", "timeout", "internal", "starting",
]
WorkerStateName = Literal["active", "draining", "drained"]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    """Base of every message: tagged by ``type``, unknown fields rejected."""


# --------------------------------------------------------------------------- client API


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn; the daemon applies the model's chat template."""

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Meta(max_length=1_000_000)]


class Generate(_Msg, tag="generate"):
    """Submit one request. Exactly one of ``prompt``, ``prompt_ids``, ``messages``."""

    prompt: str | None = None
    """Prompt text, tokenized by the daemon."""
    prompt_ids: list[TokenId] | None = None
    """Prompt as token ids (used as is)."""
    messages: list[ChatMessage] | None = None
    """Chat turns, rendered with the model's chat template."""
    id: RequestId | None = None
    """Client-chosen request id (unique per daemon); assigned when absent."""
    max_tokens: PosInt | None = 128
    """Most new tokens to generate; None: up to the daemon's limit ``model.max_gen``."""
    cap_max_tokens: bool = True
    """A ``max_tokens`` above ``model.max_gen`` is lowered to it (True; the ``done`` then ends
    with ``length`` at the limit) or refused with ``bad_request`` naming max_tokens (False)."""
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    """0 means greedy decoding."""
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNegInt = 0
    """0 disables top-k."""
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one (0: off)."""
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    """Subtracted from the logit of every token already generated (OpenAI's definition)."""
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    """Subtracted from a token's logit once per time it was already generated."""
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or the output
    (transformers' and vLLM's definition; 1: off)."""
    seed: int | None = None
    """Seed for sampling; the same seed gives the same output."""
    stop: list[Annotated[str, Meta(min_length=1, max_length=256)]] = []
    """Stop strings: generation ends when the text contains one (it is cut off, and the
    tokens after the one that completed it are dropped from the output and the usage)."""
    stop_token_ids: list[TokenId] = []
    """Extra token ids that end generation (the model's EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    logprobs: bool = False
    """Return the log-probability of each generated token (``delta``/``done`` ``logprobs``)."""
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] = 0
    """Also return this many most likely tokens at each position (implies ``logprobs``)."""
    user: Annotated[str, Meta(max_length=256)] | None = None
    """An end-user id, logged with the request (OpenAI's ``user``)."""
    stream: bool = True
    """Send :class:`Delta` events as tokens are generated (coalesced to about 20 ms)."""
    priority: int = 0
    timeout: NonNegFloat | None = None
    """Seconds from acceptance after which the request ends with finish_reason ``timeout``."""


class Cancel(_Msg, tag="cancel"):
    """Cancel a request of this connection by id."""

    id: RequestId
    any_connection: bool = False
    """Admin only (see :class:`DrainWorker`): cancel a request of any connection."""


class Ping(_Msg, tag="ping"):
    """Liveness check, answered by :class:`Pong`."""

    nonce: int = 0


class DrainWorker(_Msg, tag="drain_worker"):
    """Admin: take a worker out of rotation without losing its work, or put it back.

    The worker gets no new batches and finishes those it holds; answered by
    :class:`WorkerStateReply`. Only peers whose uid is an admin (``daemon.admin_uids``;
    by default root and the daemon's own uid) may send it; others get ``forbidden``.
    """

    worker: Annotated[str, Meta(min_length=1, max_length=64)]
    resume: bool = False
    """Put a drained worker back into rotation instead."""


ClientMsg = Generate | Cancel | Ping | DrainWorker


class Accepted(_Msg, tag="accepted"):
    """The request is queued; exactly one :class:`Done` or :class:`Error` will follow."""

    id: str
    prompt_tokens: int


class Logprob(msgspec.Struct, array_like=True, forbid_unknown_fields=True, omit_defaults=True):
    """A token and its log-probability (an array ``[id, logprob, token?]`` on the wire).
    Workers send ids; the daemon adds ``token``, the token's text, for its clients."""

    id: int
    logprob: float
    token: str = ""


class TokenLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True, omit_defaults=True):
    """One generated position: the chosen token and the ``top_logprobs`` most likely ones.

    Log-probabilities are the log-softmax of the model's logits at that position (the row
    the engine samples from, before penalties, temperature and truncation; vLLM's default).
    """

    chosen: Logprob
    top: list[Logprob] = []


class Delta(_Msg, tag="delta"):
    """New tokens of a streaming request."""

    id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    """With ``logprobs``: those of ``token_ids`` (or of tokens streamed earlier, when a
    worker sent their tokens before their log-probabilities), in order."""


class Usage(msgspec.Struct, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int


class Timings(msgspec.Struct, forbid_unknown_fields=True):
    """Seconds measured by the daemon's clock."""

    queued_s: float
    """From acceptance to the first dispatch to a worker."""
    ttft_s: float | None
    """From acceptance to the first generated token reaching the daemon."""
    e2e_s: float
    """From acceptance to this event."""
    slices: int
    """Number of slices (batches) the request was served in."""


class Done(_Msg, tag="done"):
    """Terminal event of an accepted request."""

    id: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    text: str | None = None
    """Whole output text (non-streaming requests)."""
    token_ids: list[int] | None = None
    """Whole output token ids (non-streaming requests)."""
    worker: str | None = None
    """Worker that served the last slice."""
    logprobs: list[TokenLogprobs] | None = None
    """Non-streaming requests with ``logprobs``: one entry per token of ``token_ids``."""


class Error(_Msg, tag="error"):
    """Refusal or failure. Terminal for ``id`` when ``id`` names an accepted request."""

    code: ErrorCode
    """Machine-readable: one of :data:`ErrorCode`."""
    message: str
    id: str | None = None


class Pong(_Msg, tag="pong"):
    nonce: int = 0
    protocol: int = PROTOCOL_VERSION


class WorkerStateReply(_Msg, tag="worker_state"):
    """Answer to :class:`DrainWorker`: the worker's state after the change."""

    worker: str
    state: WorkerStateName
    """``draining``: out of rotation, batches still in flight; ``drained``: none left."""
    batches_inflight: int = 0


ServerMsg = Accepted | Delta | Done | Error | Pong | WorkerStateReply


# --------------------------------------------------------------------------- status socket


class StatusRequest(_Msg, tag="status"):
    """Ask for the daemon's state as a :class:`StatusReply`."""


class MetricsRequest(_Msg, tag="metrics"):
    """Ask for Prometheus text exposition as a :class:`MetricsReply`."""


StatusMsg = StatusRequest | MetricsRequest


class WorkerStatus(msgspec.Struct, forbid_unknown_fields=True):
    """One registered worker, as the status socket shows it."""

    id: str
    engine: str
    model: str
    device: str
    pid: int
    state: WorkerStateName
    load_s: float
    """Estimated seconds of work queued on the worker (the offloader's view)."""
    batches_inflight: int
    """Batches sent and not yet answered."""
    queued_batches: int
    """Batches in the worker's local queue (its last heartbeat)."""
    busy: bool
    """Serving a batch (its last heartbeat)."""
    batches_done: int
    tokens_done: int
    heartbeat_age_s: float
    """Seconds since the worker was last heard from."""


class LoadingWorker(msgspec.Struct, forbid_unknown_fields=True):
    """A worker the daemon spawned that has not registered yet (it is loading its model)."""

    id: str
    pid: int
    age_s: float
    """Seconds since it was spawned."""
    step: str = ""
    """Its latest loading step, as it logged it ("" before the first)."""


class EstimatedVsMeasured(msgspec.Struct, forbid_unknown_fields=True):
    est_s: float
    measured_s: float


class EstimatorError(msgspec.Struct, forbid_unknown_fields=True):
    """Measured minus estimated batch serving time over the latest batches."""

    batches: int
    mean_error_s: float | None
    mean_abs_error_s: float | None
    last: list[EstimatedVsMeasured]


class Limits(msgspec.Struct, forbid_unknown_fields=True):
    max_queued_requests: int
    max_queued_tokens: int


class StatusSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    """The daemon's state, built in one place (``sclsd.daemon.status``) and read by the
    status socket, ``sclsctl status/top`` and the Prometheus gauges."""

    version: str
    protocol: int
    uptime_s: float
    draining: bool
    model: str
    policy: str
    slice_len: int
    interval_s: float
    """Current scheduling interval T."""
    pool_size: int
    """Requests waiting in the pool for a slice."""
    live_requests: int
    running_requests: int
    """Requests in batches on workers."""
    admitting: int
    """Requests between their frame and admission (tokenizing)."""
    queued_tokens: int
    """Prompt tokens of live requests."""
    limits: Limits
    connections: int
    metrics_http: str | None
    workers: list[WorkerStatus]
    estimator: dict[str, Any]
    """The serving-time estimator's coefficients (``sclsd.core.estimator``)."""
    estimator_error: EstimatorError
    counters: dict[str, int]
    """Scheduler and daemon event counts since start (docs/operations.md lists them)."""
    serving: bool = True
    """False when no worker can serve (e.g. local workers crash-looping) or while the daemon
    is ``starting``: see ``why``."""
    why: str | None = None
    starting: bool = False
    """The daemon listens but does not serve yet (loading the tokenizer, downloading the
    model): ``generate`` is answered with error ``starting``."""
    loading: list[LoadingWorker] = []
    """Spawned workers that have not registered yet."""


class StatusReply(_Msg, tag="status_reply"):
    """Snapshot of the daemon."""

    status: StatusSnapshot


class MetricsReply(_Msg, tag="metrics_reply"):
    text: str


# --------------------------------------------------------------------------- daemon <-> worker


class Register(_Msg, tag="register"):
    """First message of a worker. The daemon answers :class:`Welcome`."""

    worker_id: Annotated[str, Meta(min_length=1, max_length=64)]
    engine: str
    model: str
    device: str
    kv_bytes_per_token: NonNegInt
    """Δ: KV-cache bytes per token (model architecture and dtype)."""
    mem_available: NonNegInt
    """M_ava in bytes: memory left for KV after weights and engine overhead."""
    pid: int
    protocol: int = PROTOCOL_VERSION
    eos_token_ids: list[int] = []
    vocab_size: NonNegInt = 0
    """Size of the worker's vocabulary (0: unknown); checked against the daemon's tokenizer."""
    auth: Annotated[str, Meta(max_length=256)] = ""
    """The daemon's worker secret (hex), for workers without CURVE: spawned workers read it
    from a file only the daemon's user can read; others from ``daemon.worker_secret_file``."""
    profile: dict[str, Any] | None = None
    """Fitted estimator profile (see sclsd.core.estimator), if the worker has one."""
    kv_page_tokens: PosInt = 1
    """The engine allocates KV in pages of this many tokens (paged caches; 1: per token):
    slice grants reserve whole pages."""


class Keepalive(_Msg, tag="keepalive"):
    """Sent by the daemon to each registered worker every heartbeat interval: a worker
    that hears nothing for its silence timeout drops its queue and registers again."""


class BatchAck(_Msg, tag="batch_ack"):
    """A worker received :class:`BatchMsg` ``batch_id`` and queued it."""

    worker_id: str
    batch_id: int


class Welcome(_Msg, tag="welcome"):
    heartbeat_interval_s: float
    protocol: int = PROTOCOL_VERSION


class Heartbeat(_Msg, tag="heartbeat"):
    worker_id: str
    queued_batches: int = 0
    busy: bool = False


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One request inside a batch: its whole context so far, by token ids."""

    rid: str
    token_ids: list[int]
    """Prompt + tokens generated in earlier slices (continuation by ids, never text)."""
    max_new_tokens: PosInt
    """Budget left for this request; the engine stops the row there."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    generated: int = 0
    """Tokens generated in earlier slices (keeps sampling streams reproducible)."""
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    """Both over the tokens generated so far: the last ``generated`` of ``token_ids`` and
    those of this slice."""
    repetition_penalty: float = 1.0
    """Over the whole context (prompt and generated tokens)."""
    logprobs: bool = False
    """Send ``RequestOutput.logprobs`` for this row."""
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] = 0


class BatchMsg(_Msg, tag="batch"):
    """Serve these requests for at most ``slice_len`` decoding iterations."""

    batch_id: int
    slice_len: PosInt
    requests: list[BatchRequest]
    kv_reuse: bool = True
    """Use KV kept from the rows' earlier slices and keep theirs after this one (the daemon's
    ``scheduler.kv_reuse``); False: prefill in full and keep nothing (the paper's slicing)."""


class RequestOutput(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    rid: str
    token_ids: list[int]
    """Tokens generated in this slice."""
    finish_reason: Literal["stop", "length"] | None = None
    """``stop``: EOS or a stop token; ``length``: its max_new_tokens reached; None: slice ended."""
    logprobs: list[TokenLogprobs] = []
    """Rows asked for ``logprobs``: one entry per token of ``token_ids``."""
    kv_tokens: NonNegInt = 0
    """In a :class:`Result`: tokens of this request's context whose KV the worker keeps after
    the slice (its next slice there prefills only the rest); 0: none kept."""


class BatchStats(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    prefill_s: float = 0.0
    decode_s: float = 0.0
    iterations: int = 0
    pad_tokens: int = 0
    """Left-padding tokens in the prefill."""
    invalid_tokens: int = 0
    """Tokens computed for rows that had already finished."""
    peak_memory: int = 0
    batch_size: int = 0
    input_len: int = 0
    """Batch input length L_i (longest context in the batch)."""
    queue_wait_s: float = 0.0
    """Time the batch waited in the worker's local queue."""
    prefill_tokens: int = 0
    """Context tokens the prefill computed (padding excluded)."""
    reused_tokens: int = 0
    """Context tokens whose KV came from the worker's retained caches instead."""
    preemptions: int = 0
    """Requests the engine preempted (offloaded or dropped to recompute) to make room,
    counted since the engine started; continuous engines only (0 under grants)."""
    kv_peak_tokens: int = 0
    """The most tokens of KV the engine held at once (running and kept requests' contexts),
    since it started; continuous engines only."""


class Result(_Msg, tag="result"):
    worker_id: str
    batch_id: int
    outputs: list[RequestOutput] = []
    stats: BatchStats = msgspec.field(default_factory=BatchStats)
    error: str | None = None
    """Set when the engine failed: the batch's requests go back to the pool."""
    kv_evicted: list[str] = []
    """Requests whose retained KV the worker dropped to make room since its last result."""


class Tokens(_Msg, tag="tokens"):
    """Tokens of a running batch, sent as they are generated (coalesced: at most one per
    batch every ~20 ms, the first as soon as the prefill produced the first tokens).

    Each output holds only the tokens generated since the previous ``tokens`` of this
    batch; ``finish_reason`` is set once a row has finished. Advisory: the batch's
    :class:`Result` still carries every token of the slice and is authoritative.
    """

    worker_id: str
    batch_id: int
    outputs: list[RequestOutput]


class Release(_Msg, tag="release"):
    """Drop the retained KV of these requests (they ended or moved to another worker)."""

    rids: list[str]


class Drain(_Msg, tag="drain"):
    """Stop taking new batches; finish the local queue."""


class Shutdown(_Msg, tag="shutdown"):
    """Exit after the current batch (its result is still sent)."""


class Resume(_Msg, tag="resume"):
    """Take new batches again after a :class:`Drain`."""


class Reregister(_Msg, tag="reregister"):
    """The daemon does not know this worker (it was declared dead, e.g. after a
    heartbeat timeout, or the daemon restarted): send :class:`Register` again.
    Batches the worker still holds were already given back to the pool."""


WorkerMsg = Register | Heartbeat | Result | BatchAck | Tokens
DaemonToWorkerMsg = Welcome | BatchMsg | Drain | Shutdown | Resume | Reregister | Keepalive | Release


# --------------------------------------------------------------------------- codecs

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
