"""What ``sclsd-http`` serves, where it finds the daemon, and the limits at its door
(``[http]`` in the config; docs/operations.md lists each with its default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import defaults


@dataclass(frozen=True)
class Limits:
    """Bounds on what one client may make this process hold or do."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body; a larger one gets 413 before more than this is read."""
    body_timeout_s: float = 30.0
    """Once the headers are in, the whole body must follow within this (else 408)."""
    max_header_bytes: int = 32 * 1024
    """Request line and headers together (431 beyond, and the connection is closed)."""
    header_timeout_s: float = 10.0
    """A connection must deliver a request's headers within this of opening (or of the
    request's first byte on a kept-alive connection), else 408 and it is closed."""
    keep_alive_s: float = 5.0
    """An idle kept-alive connection is closed after this."""
    max_connections: int = 2048
    """Open HTTP connections; one more is answered 503 and closed at once."""
    max_requests_per_client: int = 1024
    """Requests in flight per API key (the ``Authorization`` header), else per client
    address, on the generation and tokenizer routes; one more is answered 429. 0: no bound."""


@dataclass(frozen=True)
class Settings:
    """What ``sclsd-http`` serves and where it finds the daemon."""

    socket: str
    status_socket: str
    api_key: str | None = None
    """The key clients send as ``Authorization: Bearer KEY`` (None: open), or the first of
    :attr:`api_keys`."""
    api_keys: tuple[str, ...] = ()
    """Every accepted key, where ``[http] api_key_file`` lists several (one per end user:
    each key's requests are one group in the daemon's fair turns)."""
    model_name: str = ""
    """The served model's name; "": the daemon's ``model.name`` (from its status)."""
    connections: int = 4
    max_choices: int = 64
    limits: Limits = Limits()
    access_log: bool = True
    """One line per request at info (``sclsd.http.access``)."""
    max_frame_bytes: int = defaults.MAX_FRAME_BYTES
    """The daemon's ``max_frame_bytes``: a request that would not fit one frame is 413
    here, rather than closing the shared connection at the daemon."""
    max_model_len: int | None = None
    """Shown on ``/v1/models`` and ``/tokenize`` when known (``[model] max_input + max_gen``)."""
    max_input: int | None = None
    """``[model] max_input`` when known from the config file; the daemon's status says it
    otherwise (prompts that cannot fit are refused before tokenizing, :mod:`.tokens`)."""
    cache_dir: str = ""
    """``[model] cache_dir``, for loading the tokenizer (:mod:`.tokens`)."""
    tokenizer: Any = None
    """A tokenizer to use instead of loading the daemon's model's (tests)."""
