"""Prefixes shared between requests on ``hf-static-cb``'s arena (``share_prefixes``): the part of
:class:`~worker.engines.arena_set.ArenaRows` that keeps what finished rows leave and hands it to
rows of other requests.

**Keeping.** At a regroup, before the slots of the rows that ended are reused, the KV of those
that keep nothing for their requests (ghosts, not paused) is cut out to the kept-KV store as
*cached prefixes* (:meth:`~worker.engines.kvstore.KVStore.keep_prefix`): the columns each wrote,
its context and what it generated and fed (at least 16 tokens), unless a cached prefix holds it
all already. Every such row, not only where recent rows began alike as ``llama`` does: here
a prefix costs one copy and room in the store that nothing else wants, never a running row's
step (prefixes live outside the arena, and a step reads only its rows' columns), and a chat's
first turn is the prefix of its next, on a worker that may have seen no other request begin
so. They are nobody's: the daemon never counts them, they use only the room kept KV leaves in
the store and go first when kept KV wants it.

**Taking.** A joining row with no KV of its own here (:meth:`PrefixSharing.shared_prefix`) takes
the cached prefix sharing the longest head with its context (at least 16 tokens, all but its
last token at most): it is copied into the row's slot like kept KV from the store, left there
for others, and the row prefills only the rest (``reused_tokens``: the daemon's
``usage.cached_tokens``). Rows that score their prompt, batches without ``kv_reuse`` and
released rows take none (:meth:`~worker.engines.arena_join.Joining._usable`).
"""

from __future__ import annotations

import logging
from time import monotonic
from typing import Any

from worker.engines.arena_cb import Row
from worker.engines.arena_rows import RowRunner
from worker.engines.arena_slots import Paused
from worker.engines.kvstore import PREFIX_REGROW_S, KVStore, Retained
from worker.engines.prefixes import MIN_PREFIX

log = logging.getLogger("worker")

__all__ = ["PrefixSharing"]


class PrefixSharing:
    """The sharing half of :class:`~worker.engines.arena_set.ArenaRows` (module docstring)."""

    runner: RowRunner
    kv: KVStore | None
    slots: list[Row]
    paused: dict[str, Paused]
    c: int
    counts: dict[str, int]

    def init_sharing(self, share: bool) -> None:
        """``share``: ``share_prefixes``, which needs the kept-KV store (off without it)."""
        if share and self.kv is None:
            log.warning("hf-static-cb: share_prefixes needs kv_reuse (the store keeps the prefixes): off")
        self.share = share and self.kv is not None

    def shared_prefix(self, ctx: list[int], take: bool = False) -> tuple[Retained | None, int]:
        """The cached prefix a row with context ``ctx`` would start from, and its tokens
        (``take``: the row takes it now)."""
        if not self.share or self.kv is None:
            return None, 0
        return self.kv.prefix(ctx, take)

    def _token_bytes(self) -> int:
        arena = self.runner.arena
        return arena.nbytes // max(1, arena.tokens)

    def room_for(self, lens: list[int]) -> None:
        """Before rows' KV of ``lens`` tokens is copied into the store: cached prefixes give
        way first, the copies need the memory they hold (they go first anyway when the copies
        are put, but only after the copies were made)."""
        if self.kv is not None:
            self.kv.free_room(sum(lens) * self._token_bytes())

    def after_failure(self, exc: BaseException) -> None:
        """A turn failed and its rows are gone: one out of device memory drops every cached
        prefix too (a cache, and nobody's) and halves what they may hold from then on
        (:meth:`~worker.engines.kvstore.KVStore.shrink_prefixes`: the same fill does not run
        the device out again), and on CUDA the allocator gives its cached blocks back, so the
        next turns find the room the activation reserve was sized for."""
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            self.counts["oom_turns"] += 1
            if self.kv is not None:
                dropped, limit = self.kv.shrink_prefixes(monotonic())
                log.warning("hf-static-cb: out of device memory in a turn: %d cached prefixes dropped; they may "
                            "hold %.2f GiB from now on", dropped, limit / 2**30)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def oom_account(self) -> str:
        """The turns that ran out of device memory and the room cached prefixes are held to
        now (below the budget: the last such turn's limit, or what it grew back to since), for
        the account at close (empty when none did)."""
        if not self.counts["oom_turns"]:
            return ""
        kv = self.kv
        held = (f", cached prefixes held to {kv.prefix_limit / 2**30:.2f} GiB since"
                if kv is not None and kv.prefix_limit < kv.budget else "")
        return f", {self.counts['oom_turns']} turns out of device memory{held}"

    def sharing_account(self) -> str:
        """Its part of the account at close (empty when it does not share)."""
        c = self.counts
        return (f"rows started from a cached prefix {c['shared']}, finished rows cached as prefixes "
                f"{c['cached']}; ") if self.share else ""

    def cache_prefixes(self) -> None:
        """The KV of the rows that ended keeping nothing, as cached prefixes (module docstring);
        a copy that finds no device memory is skipped."""
        import torch

        if not self.share or self.kv is None:
            return
        if self.kv.regrow_prefixes(monotonic()):
            log.info("hf-static-cb: no turn out of device memory for %.0f s: cached prefixes may hold %.2f GiB "
                     "now", PREFIX_REGROW_S, self.kv.prefix_limit / 2**30)
        picks: list[tuple[Row, list[int]]] = []
        for r in self.slots:
            p = self.paused.get(r.rid)
            if not r.ended or r.slot < 0 or (p is not None and p.slot == r.slot):
                continue
            tokens = [*r.req.token_ids, *r.state.out][:r.fed]  # the columns it wrote
            # Unless a cached prefix holds it all (a prompt sent again that generated nothing
            # new; -1: no token, so all of them can be used).
            if len(tokens) >= MIN_PREFIX and self.kv.prefix(tokens + [-1])[1] < len(tokens):
                picks.append((r, tokens))
        # The copies are made before the store takes them, so the room they need is made
        # first (older prefixes go), and only as many as fit beside the kept KV are cut: a
        # copy past the store's budget would take the memory a prefill's activations need.
        per, room, fits = self._token_bytes(), self.kv.prefix_room(), []
        for r, tokens in picks:
            if len(tokens) * per <= room:
                fits.append((r, tokens))
                room -= len(tokens) * per
        picks = fits
        if not picks:
            return
        self.kv.free_room(sum(len(t) for _, t in picks) * per, prefixes=True)
        try:
            cuts: list[tuple[list[Any], int]] = self.runner.cut(
                [r.slot for r, _ in picks], [len(t) for _, t in picks], max(r.slot for r, _ in picks) + 1, self.c)
        except torch.OutOfMemoryError:
            log.debug("hf-static-cb: no device memory to cache %d prefixes", len(picks))
            return
        for (_, tokens), (kv, nbytes) in zip(picks, cuts, strict=True):
            self.counts["cached"] += self.kv.keep_prefix(Retained(tokens, nbytes, kv))
