"""What a grammar's check gave, kept by the grammar's content (:class:`GrammarCache`).

Clients send the same schema again and again (a tool's parameters, a response format), and
an HTTP request's ``n`` choices each carry it: it is checked once. The key is a SHA-256 of
the grammar's kind and text, so the cache holds no client's schema, only what the check
gave: the grammar text llguidance compiled (what batches carry), or the refusal and its
cause. Least recently used entries leave first, past ``grammar.cache_entries`` entries or
``grammar.cache_bytes`` bytes of text; an entry larger than the whole budget is not kept.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from .. import protocol as P

__all__ = ["Checked", "GrammarCache", "key_of"]

#: Bytes counted for an entry beyond its text (the key, the record, the dict's slot).
ENTRY_OVERHEAD = 200


@dataclass(frozen=True, slots=True)
class Checked:
    """What one check of a grammar gave."""

    text: str | None
    """llguidance's grammar text (None when refused)."""
    why: str | None = None
    """Why it was refused, as the client hears it."""
    cause: str | None = None
    """The refusal's cause (:data:`sclsd.daemon.grammar_children.CAUSES`)."""
    lasting: bool = True
    """The same grammar would get the same answer on another try: it may be kept (a grammar
    that ran out of time only because the machine was busy may not)."""

    @property
    def size(self) -> int:
        return len(self.text or "") + len(self.why or "") + ENTRY_OVERHEAD


def key_of(s: P.Structured) -> bytes:
    """The cache key of ``s``: a digest of its kind and text."""
    h = hashlib.sha256(s.kind.encode())
    h.update(b"\0")
    h.update(s.value.encode(errors="surrogatepass"))
    return h.digest()


class GrammarCache:
    """Checks' results by grammar content, bounded in entries and bytes (least recently used
    out first)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        """Bytes the entries count now (their texts and :data:`ENTRY_OVERHEAD` each)."""
        self._entries: OrderedDict[bytes, Checked] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Checked | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: bytes, checked: Checked) -> bool:
        """Keep ``checked`` under ``key`` (when it is lasting and fits); whether it was kept."""
        size = checked.size
        if not checked.lasting or size > self.max_bytes or self.max_entries < 1:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[key] = checked
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.size
        return True
