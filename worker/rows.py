"""The worker's records of the requests it serves: the daemon sends a request whole once.

A :class:`~sclsd.protocol.BatchRequest` (a row sent whole) leaves its record here: the
prompt and parameters, and the context the worker holds for it (what it was sent, then
what it generated). A later row of the same request comes as a
:class:`~sclsd.protocol.ContinueRow` (its budget, and the context tokens the worker
lacks, usually none) and :meth:`RowBook.expand` turns it back into the whole row the
engine takes: engines see only whole rows. A record goes when its request finishes
here (EOS, its budget, an error), when the daemon says so (``forget``, ``release``), or
when the worker registers again (the daemon then knows none of them).

Thread-safe: the serve thread expands and grows records, the receive thread drops them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import msgspec

from sclsd import protocol as P

__all__ = ["RowBook", "UnknownRows"]


class UnknownRows(Exception):
    """A batch continues requests this worker holds no record of (:attr:`rids`)."""

    def __init__(self, rids: list[str]) -> None:
        super().__init__(f"no record of {len(rids)} continued request(s) here: {', '.join(rids[:8])}")
        self.rids = rids


class RowBook:
    """Records of the requests this worker serves (see the module docstring)."""

    def __init__(self) -> None:
        self._rows: dict[str, P.BatchRequest] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, rid: object) -> bool:
        return rid in self._rows

    def context(self, rid: str) -> list[int] | None:
        """The context held for ``rid`` (None: no record)."""
        row = self._rows.get(rid)
        return None if row is None else list(row.token_ids)

    def expand(self, batch: P.BatchMsg) -> P.BatchMsg:
        """``batch`` with every row whole, its records kept; ``batch.forget`` applied first.
        Raises :class:`UnknownRows` (nothing changed but the forgetting) when a continued
        request has no record here."""
        with self._lock:
            for rid in batch.forget:
                self._rows.pop(rid, None)
            if not batch.cont and not batch.forget:
                for r in batch.requests:
                    self._rows[r.rid] = r
                return batch
            missing = [c.rid for c in batch.cont
                       if c.rid not in self._rows or len(self._rows[c.rid].token_ids) < c.known]
            if missing:
                raise UnknownRows(missing)
            rows = list(batch.requests)
            for r in rows:
                self._rows[r.rid] = r
            for c in batch.cont:
                rec = self._rows[c.rid]
                ids = rec.token_ids if c.known == len(rec.token_ids) and not c.tail else (
                    rec.token_ids[:c.known] + c.tail)
                # The prompt's log-probabilities came with the request's first slice here.
                row = msgspec.structs.replace(rec, token_ids=ids, max_new_tokens=c.max_new_tokens,
                                              generated=c.generated, prompt_logprobs=None)
                self._rows[c.rid] = row
                rows.append(row)
            return msgspec.structs.replace(batch, requests=rows, cont=[], forget=[])

    def served(self, outputs: Iterable[P.RequestOutput]) -> None:
        """A batch's outputs: each unfinished row's context grows by its tokens; a finished or
        failed row's record goes (the daemon sends nothing more of it here)."""
        with self._lock:
            for o in outputs:
                rec = self._rows.get(o.rid)
                if rec is None:
                    continue
                if o.finish_reason is not None or o.error is not None:
                    del self._rows[o.rid]
                elif o.token_ids:
                    # A new list: the engine may still hold the one it was given.
                    self._rows[o.rid] = msgspec.structs.replace(rec, token_ids=rec.token_ids + o.token_ids)

    def drop(self, rids: Iterable[str] | None = None) -> None:
        """Forget ``rids`` (None: every record, as at a new registration)."""
        with self._lock:
            if rids is None:
                self._rows.clear()
            else:
                for rid in rids:
                    self._rows.pop(rid, None)
