"""Client API (stream Unix socket): client -> daemon :class:`Generate`, :class:`Cancel`,
:class:`Ping`, :class:`DrainWorker`; daemon -> client :class:`Accepted`, :class:`Delta`,
:class:`Done`, :class:`Error`, :class:`Pong`, :class:`WorkerStateReply`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..core.request import FinishReason
from .common import (
    MAX_TOKEN_LIST,
    PROTOCOL_VERSION,
    ErrorCode,
    NonNegFloat,
    NonNegInt,
    PosInt,
    RequestId,
    TokenId,
    TokenLogprobs,
    WorkerStateName,
    _Msg,
)


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn; the daemon applies the model's chat template."""

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Meta(max_length=1_000_000)]


class Structured(msgspec.Struct, forbid_unknown_fields=True):
    """What a request's output must follow (structured output)."""

    kind: Literal["json_object", "json_schema", "regex", "lark", "choice"]
    """``json_object``: any JSON object (``value`` ignored); ``json_schema``: the JSON schema in
    ``value`` (JSON text); ``regex``: a regular expression; ``lark``: a Lark grammar (llguidance's
    dialect); ``choice``: a JSON list of strings, one of which is the output."""
    value: Annotated[str, Meta(max_length=1_000_000)] = ""


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
    """Most new tokens to generate; None: up to the daemon's ``model.default_max_tokens`` (at
    least ``min_tokens``), within its limit ``model.max_gen``."""
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
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_TOKEN_LIST)] = []
    """Extra token ids that end generation (the model's EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    """Generate at least this many tokens before EOS or a stop token may end the request
    (vLLM's ``min_tokens``; 0: off). Applied only by a daemon that lists ``min_tokens`` in
    :attr:`Pong.features`."""
    logit_bias: Annotated[dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=MAX_TOKEN_LIST)] = {}
    """Token id -> a bias added to its logit before sampling (OpenAI's ``logit_bias``;
    -100 bans a token, 100 all but forces it). Applied only by a daemon that lists
    ``logit_bias`` in :attr:`Pong.features`."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text (False: keep them; needs the feature
    ``skip_special_tokens`` in :attr:`Pong.features`)."""
    include_stop_str: bool = False
    """A stop string that ends the output stays at the end of its text (vLLM's
    ``include_stop_str_in_output``; needs the feature ``include_stop_str``)."""
    structured: Structured | None = None
    """The output must follow this (JSON schema, regex, grammar): checked at admission,
    enforced by the workers as a token mask (needs the feature ``structured``)."""
    logprobs: bool = False
    """Return the log-probability of each generated token (``delta``/``done`` ``logprobs``)."""
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] = 0
    """Also return this many most likely tokens at each position (implies ``logprobs``)."""
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    """Return the log-probability of every prompt token after the first, given the tokens
    before it, with this many most likely tokens at each position (vLLM's ``prompt_logprobs``;
    0: the prompt's own tokens only; None: none). Computed in the request's prefill, so a
    request with it is served without KV cached from others; needs the feature
    ``prompt_logprobs`` in :attr:`Pong.features` and workers whose engine computes them."""
    user: Annotated[str, Meta(max_length=256)] | None = None
    """An end-user id, logged with the request (OpenAI's ``user``)."""
    group: Annotated[str, Meta(max_length=256)] | None = None
    """Whose request this is, within the connection, for fair turns in line (default: the
    connection and ``user``): requests of one group take turns with other groups' instead
    of all going first. sclsd-http gives each HTTP request (and its ``n`` choices) one."""
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


class Delta(_Msg, tag="delta"):
    """New tokens of a streaming request."""

    id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    """With ``logprobs``: those of ``token_ids`` (or of tokens streamed earlier, when a
    worker sent their tokens before their log-probabilities), in order."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With ``prompt_logprobs``: once, in the first delta after the prefill, one entry per
    prompt token after the first (position i + 1 of the prompt is entry i)."""


class Usage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    """Prompt tokens whose KV the engines did not compute for this request (taken from KV
    kept or cached); None: the daemon does not count them."""


class Timings(msgspec.Struct, forbid_unknown_fields=True):
    """Seconds measured by the daemon's clock."""

    queued_s: float
    """From acceptance to the start of its first slice on a worker (its batch's dispatch plus
    the time the batch waited in the worker's queue); to this event if no worker started it."""
    ttft_s: float | None
    """From acceptance to the first generated token reaching the daemon."""
    e2e_s: float
    """From acceptance to this event."""
    slices: int
    """Number of slices (batches) the request was served in."""
    max_gap_s: float | None = None
    """Longest wait between two consecutive arrivals of its tokens at the daemon, first token
    to last (each followed at once by a ``delta`` to a streaming client); None with fewer than
    two. Optional: older daemons leave it out."""


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
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With ``prompt_logprobs``, when no ``delta`` carried them (a request that does not
    stream): one entry per prompt token after the first, as in :attr:`Delta.prompt_logprobs`."""


class Error(_Msg, tag="error"):
    """Refusal or failure. Terminal for ``id`` when ``id`` names an accepted request."""

    code: ErrorCode
    """Machine-readable: one of :data:`ErrorCode`."""
    message: str
    id: str | None = None


class Pong(_Msg, tag="pong"):
    nonce: int = 0
    protocol: int = PROTOCOL_VERSION
    features: list[str] = []
    """The optional :class:`Generate` features this daemon applies (some of
    :data:`GENERATE_FEATURES`). A front end refuses a request that needs one not listed,
    rather than have it ignored."""


#: Optional ``generate`` fields a daemon applies only once it says so in ``Pong.features``:
#: ``min_tokens`` > 0, a non-empty ``logit_bias``, ``skip_special_tokens = false``, ``structured``,
#: ``include_stop_str = true``, ``prompt_logprobs`` set.
GENERATE_FEATURES = ("min_tokens", "logit_bias", "skip_special_tokens", "structured", "include_stop_str",
                     "prompt_logprobs")


class WorkerStateReply(_Msg, tag="worker_state"):
    """Answer to :class:`DrainWorker`: the worker's state after the change."""

    worker: str
    state: WorkerStateName
    """``draining``: out of rotation, batches still in flight; ``drained``: none left."""
    batches_inflight: int = 0


ServerMsg = Accepted | Delta | Done | Error | Pong | WorkerStateReply
