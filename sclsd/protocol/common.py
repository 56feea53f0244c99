"""What every channel shares: the protocol version, framing constants, field types, the
base of every message, and the log-probability structs that workers and clients both carry."""

from __future__ import annotations

import struct
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

#: Bumped on any incompatible change to a message below. 2: workers authenticate
#: (``Register.auth``), acknowledge batches (:class:`BatchAck`) and hear
#: :class:`Keepalive`; the status reply is the typed :class:`StatusSnapshot`. 3: workers
#: stream tokens during a slice (:class:`Tokens`), keep KV across slices (``kv_tokens``,
#: ``kv_evicted``) and hear :class:`Release`. 4: ``generate`` grows the parameters of
#: OpenAI-style clients (``min_p``, the penalties, ``logprobs``/``top_logprobs``, ``user``,
#: ``max_tokens = None`` and ``cap_max_tokens``), ``delta``/``done`` carry ``logprobs`` and
#: batch rows/results the same. Older clients are still served: every new field has a
#: default, and the daemon sends a new field only to a request that asked for it. 5:
#: ``register`` carries the engine's typed capabilities (``caps``: batching, sampling,
#: max context, KV page, captured graph buckets) in place of ``kv_page_tokens``. 6: a
#: worker's ``heartbeat`` names the batches it holds and how long its engine has gone
#: without progress (``batches``, ``stalled_s``): the daemon judges a batch by progress,
#: not by its age. 7: a worker keeps each request's record (prompt, parameters, context)
#: and later rows of it are :class:`ContinueRow` (budget, and the tokens it lacks), so a
#: grant's bytes do not grow with the context; :class:`Forget` and ``BatchMsg.forget`` drop
#: records, ``Result.unknown`` names rows a worker holds no record of; ``tokens`` carry
#: every running batch's new tokens at once (``batches``), not one message per batch. 8:
#: ``tokens`` are the one channel for generated tokens: each row's part says where in the
#: slice it starts (``RequestOutput.start``), and a ``result`` carries only the tokens not
#: streamed yet (after ``start``), not the whole slice again. 9: :class:`CancelRows` ends
#: the rows of requests that ended in the daemon while their batches were in flight (a row
#: then finishes ``cancelled``, and ``BatchStats`` counts the work saved); ``caps.max_rows``
#: says how many rows a continuous engine runs at once, so the daemon sends it no more than
#: that (and a small lookahead): the rest of the line waits in the daemon. 10: ``result``
#: carries the rows the engine can run at once now (``Result.rows``), where that depends on
#: what runs (``hf-static-cb``: its arena's slots at the current columns per slot), and the
#: daemon sends no more than that from then on. 11: ``generate``'s ``prompt_logprobs`` (the
#: log-probability of each prompt token after the first, vLLM's), asked of an engine by a batch
#: row's ``prompt_logprobs`` and carried by the row's first output (``RequestOutput``), and to
#: the client by ``delta``/``done``; ``caps.prompt_logprobs`` says an engine computes them.
#: 12: ``caps.shared_prefixes`` says an engine keeps finished rows' KV for other requests that
#: begin alike, and the daemon sends a new request to the worker likely to hold its prefix.
PROTOCOL_VERSION = 12

#: Default cap on one client / status frame (bytes of msgpack).
DEFAULT_MAX_FRAME = 4 * 1024 * 1024
#: Most entries of a token-id list or map in ``generate`` (``stop_token_ids``, ``logit_bias``).
MAX_TOKEN_LIST = 1024
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
    "unknown_worker", "no_workers", "timeout", "internal", "starting", "engine_error",
]
WorkerStateName = Literal["active", "draining", "drained"]
#: Why the daemon dropped a worker (``sclsd:worker_restarts_total{reason}``, status):
#: ``exited`` its process ended; ``silent`` no heartbeat for ``daemon.heartbeat_timeout_s``;
#: ``stalled`` it held a batch without progress for ``daemon.batch_stall_timeout_s``;
#: ``lost_batch`` it heartbeats without a batch that was sent to it (the batch went astray);
#: ``unreachable`` a send to it failed; ``restarted`` a new process registered under its id;
#: ``reconnected`` the same process registered on a new connection; ``replaced`` its
#: connection registered under another id. Only ``silent``, ``stalled`` and ``unreachable``
#: kill a local worker's process: in the other cases it has exited, or it lives and
#: registers again by itself.
LossReason = Literal["exited", "silent", "stalled", "lost_batch", "unreachable", "restarted",
                     "reconnected", "replaced"]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    """Base of every message: tagged by ``type``, unknown fields rejected."""


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
