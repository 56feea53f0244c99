"""Daemon <-> worker (ZeroMQ ROUTER/DEALER): worker -> daemon :class:`Register`,
:class:`Heartbeat`, :class:`BatchAck`, :class:`Tokens`, :class:`Result`; daemon -> worker
:class:`Welcome`, :class:`BatchMsg`, :class:`Release`, :class:`Forget`, :class:`CancelRows`,
:class:`Drain`, :class:`Resume`,
:class:`Reregister`, :class:`Shutdown`, :class:`Keepalive`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .common import PROTOCOL_VERSION, NonNegInt, PosInt, TokenLogprobs, _Msg


class EngineCaps(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a worker's engine can do, sent once at register (``Register.caps``)."""

    batching: Literal["static", "continuous"] = "static"
    """``static``: one padded batch per slice (policy ``scls``); ``continuous``: rows join
    and leave every iteration, so the worker takes slice grants (policy ``scls-cb``)."""
    sampling: bool = True
    """Per-request temperature, top-p, top-k and min-p (False: greedy rows only)."""
    seeded: bool = True
    """Per-request seeds, reproducible across slicing."""
    max_context: NonNegInt = 0
    """Longest context (prompt + generated) the engine takes; 0: unknown."""
    max_rows: NonNegInt = 0
    """Continuous batching: the most rows the engine decodes in one step (0: as many as its KV
    memory holds). The daemon sends a worker no more grants than this, plus a small lookahead
    (``scheduler.grant_lookahead``), so the rest of the line waits in the daemon, where fair
    turns, cancels and the offloader still decide."""
    kv_page_tokens: PosInt = 1
    """The engine allocates KV in pages of this many tokens (1: per token): slice grants
    reserve whole pages."""
    graph_batch_sizes: list[PosInt] = []
    """Batch sizes whose decode step runs as a captured graph (ascending; empty: none)."""
    graph_cache_tokens: list[PosInt] = []
    """Cache lengths (context + slice) captured for each of those batch sizes (ascending):
    a batch is served from the smallest bucket that holds it."""
    min_tokens: bool = True
    """Rows' ``min_tokens`` are applied."""
    logit_bias: bool = True
    """Rows' ``logit_bias`` is applied."""
    grammar: bool = False
    """Rows' ``grammar`` is enforced (structured output)."""
    prompt_logprobs: bool = False
    """Rows' ``prompt_logprobs`` are computed (``RequestOutput.prompt_logprobs``)."""
    shared_prefixes: bool = False
    """A finished row's KV may stay cached, and a later request whose context begins with it
    starts from a copy (``share_prefixes``): the daemon sends a new request, where the loads
    allow, to the worker that last served a context beginning with its prompt."""


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
    caps: EngineCaps = msgspec.field(default_factory=EngineCaps)
    """What the engine can do: the daemon's batcher, admission and grant policy read this,
    never the engine's name."""


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
    """Sent by a welcomed worker every heartbeat interval, from its receive thread."""

    worker_id: str
    queued_batches: int = 0
    busy: bool = False
    batches: list[int] = []
    """Batches the worker holds, queued or running, by id: naming one says it arrived (as
    its :class:`BatchAck` does), and with ``stalled_s`` that it is moving."""
    stalled_s: Annotated[float, Meta(ge=0)] = 0.0
    """Seconds since the engine last made progress (took a batch, produced tokens, ended a
    batch) while the worker held a batch; 0 when it holds none."""


class GrammarLimits(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """llguidance's limits for building a row's grammar matcher (the daemon's ``[grammar]``
    keys of the same names; llguidance's own defaults here)."""

    max_grammar_size: PosInt = 500_000
    max_items_in_row: PosInt = 2000
    initial_lexer_fuel: PosInt = 1_000_000
    step_lexer_fuel: PosInt = 200_000
    step_max_items: PosInt = 50_000
    max_lexer_states: PosInt = 250_000


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
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    """Compute the log-probability of every token of the prompt after the first, with this
    many most likely tokens at each position, in the prefill of the request's first slice
    (``generated`` 0; the whole prompt, no KV taken from elsewhere), and send them with the
    row's first output (``RequestOutput.prompt_logprobs``). None: none."""
    min_tokens: NonNegInt = 0
    """EOS and the stop tokens cannot end the request before it has this many tokens (counted
    over the whole request: ``generated`` plus this slice's)."""
    logit_bias: dict[int, float] = {}
    """Token id -> bias added to its logit before selection, greedy rows too (log-probabilities
    stay the model's)."""
    grammar: str | None = None
    """llguidance grammar text the row's tokens must follow (structured output); the engine
    replays the row's ``generated`` tail through it at the start of each slice."""
    grammar_limits: GrammarLimits | None = None
    """With ``grammar``: the limits its matcher is built within (None: llguidance's defaults)."""


class ContinueRow(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A row of a request this worker already holds: its prompt, parameters and grammar came
    in an earlier :class:`BatchRequest` (the worker keeps them until the request ends there,
    a :class:`Release` or :class:`Forget` names it, or it registers again) and are not sent
    again. Its context is the first ``known`` tokens the worker holds for it (what it was
    sent and what it generated), then ``tail``: the bytes of a grant do not grow with the
    request's context."""

    rid: str
    max_new_tokens: PosInt
    """Budget left for this request (as :attr:`BatchRequest.max_new_tokens`)."""
    known: NonNegInt
    """How many of the tokens the worker holds for the request are its context (the daemon
    may have kept fewer than the worker generated)."""
    generated: NonNegInt = 0
    """As :attr:`BatchRequest.generated`."""
    tail: list[int] = []
    """Context tokens the worker does not hold yet, after the first ``known``."""


class BatchMsg(_Msg, tag="batch"):
    """Serve these requests for at most ``slice_len`` decoding iterations."""

    batch_id: int
    slice_len: PosInt
    requests: list[BatchRequest]
    """Rows sent whole: requests new to this worker (it keeps each one's record)."""
    kv_reuse: bool = True
    """Use KV kept from the rows' earlier slices and keep theirs after this one (the daemon's
    ``scheduler.kv_reuse``); False: prefill in full and keep nothing (the paper's slicing)."""
    cont: list[ContinueRow] = []
    """Rows of requests this worker holds already (served after ``requests``, in order)."""
    forget: list[str] = []
    """Before serving: requests whose records the worker drops (as :class:`Forget`)."""


class RequestOutput(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    rid: str
    token_ids: list[int]
    """Tokens generated in this slice: in a :class:`Tokens` part, those since the row's
    previous part; in a :class:`Result`, those no ``tokens`` message carried (an engine's
    own outputs, inside the worker: all of the slice's)."""
    start: NonNegInt = 0
    """Where ``token_ids`` start among the slice's tokens: in a ``tokens`` part, how many of
    the row's tokens earlier parts carried (a sequence number: the daemon takes a part only
    where the previous one ended); in a ``result``, how many ``tokens`` messages carried in
    all, so the slice has ``start + len(token_ids)`` tokens."""
    finish_reason: Literal["stop", "length", "cancelled"] | None = None
    """``stop``: EOS or a stop token; ``length``: its max_new_tokens reached; ``cancelled``:
    a :class:`CancelRows` ended the row (its request ended in the daemon; nothing is kept);
    None: the slice ended."""
    logprobs: list[TokenLogprobs] = []
    """Rows asked for ``logprobs``: one entry per token of ``token_ids``."""
    prompt_logprobs: list[TokenLogprobs] = []
    """Rows asked for ``prompt_logprobs`` in their first slice: one entry per prompt token
    after the first, on the row's first ``tokens`` part and on its output in the
    engine's result (a ``result`` whose row ``tokens`` messages already carried leaves them
    out); the daemon takes the first it gets."""
    kv_tokens: NonNegInt = 0
    """In a :class:`Result`: tokens of this request's context whose KV the worker keeps after
    the slice (its next slice there prefills only the rest); 0: none kept."""
    reused_tokens: NonNegInt = 0
    """In a :class:`Result`: tokens of this row's context whose KV the engine took from what
    it kept, instead of computing them (the daemon's ``usage.cached_tokens``)."""
    error: str | None = None
    """The engine could not serve this row (its grammar could not be built within its
    limits, or failed): the request ends with this error and is never retried; the rest of
    the batch is served. ``token_ids`` is then empty."""


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
    cancelled_rows: int = 0
    """Rows of this batch a :class:`CancelRows` ended before their slice did (queued or running)."""
    saved_tokens: int = 0
    """Tokens those rows were allowed and did not generate: the work the cancels saved."""


class Result(_Msg, tag="result"):
    worker_id: str
    batch_id: int
    outputs: list[RequestOutput] = []
    stats: BatchStats = msgspec.field(default_factory=BatchStats)
    error: str | None = None
    """Set when the engine failed: the batch's requests go back to the pool."""
    kv_evicted: list[str] = []
    """Requests whose retained KV the worker dropped to make room since its last result."""
    unknown: list[str] = []
    """Rows of ``cont`` the worker holds no record of: the batch was not served (and
    ``error`` says so); the daemon sends these requests whole next time, uncharged."""
    rows: NonNegInt = 0
    """The rows the engine can run at once now, where that changes with what runs (an arena
    of fixed-width slots holds fewer rows when a long one widens them); at most
    ``caps.max_rows``. The daemon holds it to that many rows and its lookahead until the
    next result says otherwise (an idle arena says what its slots held at their last width).
    0: ``caps.max_rows``."""


class BatchTokens(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One running batch's part of a :class:`Tokens` message."""

    batch_id: int
    outputs: list[RequestOutput]
    """Per row, only the tokens generated since the previous ``tokens`` naming this batch;
    ``finish_reason`` set once the row has finished."""


class Tokens(_Msg, tag="tokens"):
    """Tokens of the worker's running batches, sent as they are generated: coalesced over
    all of them, at most one message every ~20 ms, except that a batch's first tokens go
    at once (with whatever else is pending), so the time to a first token is the prefill's.

    The one channel for generated tokens: a batch's :class:`Result` carries only those no
    ``tokens`` message did (pending when the batch ended), each row's ``start`` saying how
    many went before.
    """

    worker_id: str
    batches: list[BatchTokens]


class Release(_Msg, tag="release"):
    """Drop the retained KV of these requests (they ended or moved to another worker)."""

    rids: list[str]


class Forget(_Msg, tag="forget"):
    """Drop the records (prompt, parameters, context) of these requests: they ended, or
    moved to another worker. Their KV, if kept, is :class:`Release`'s business."""

    rids: list[str]


class CancelRow(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """One row to end: request ``rid``'s row of batch ``batch_id``."""

    batch_id: int
    rid: str


class CancelRows(_Msg, tag="cancel_rows"):
    """These rows' requests ended in the daemon (cancelled, timed out, a stop string, a
    failure) while their batches were in flight here: each row ends at once if its batch has
    not started, else at the engine's next step, with ``finish_reason`` ``cancelled``; nothing
    of the request is kept (its record and KV are dropped, as :class:`Release` drops them).
    Rows are named with their batch, so a later batch of the same request id is untouched.
    The batch still ends with one :class:`Result`."""

    rows: list[CancelRow]


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
DaemonToWorkerMsg = (Welcome | BatchMsg | Drain | Shutdown | Resume | Reregister | Keepalive | Release | Forget
                     | CancelRows)
