"""HFEngine keeping KV across slices, and streaming tokens as they are generated.

Greedy output must not depend on where a row's KV came from: computed afresh
(``kv_reuse=False``), kept from the row's last slice, partly kept (a request that
moved away and came back), or evicted. Tiny random Llama; SmolLM2 in the slow test.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sclsd.protocol import BatchMsg, BatchRequest, RequestOutput  # noqa: E402
from worker.engines import create_engine  # noqa: E402
from worker.engines.hf import HFEngine  # noqa: E402

GEN = 20
#: tiny-random: 2 layers · 2 KV heads · 16 dims · 2 (K and V) · 4 bytes.
DELTA = 512


def make(**opts: Any) -> HFEngine:
    eng = create_engine("hf", "tiny-random", threads=1, **opts)
    assert isinstance(eng, HFEngine)
    return eng


@pytest.fixture(scope="module")
def plain() -> HFEngine:
    return make(kv_reuse=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (6, 31, 2, 17)]


def req(rid: str, ids: list[int], generated: int = 0, max_new: int = GEN) -> BatchRequest:
    return BatchRequest(rid=rid, token_ids=list(ids), max_new_tokens=max_new - generated,
                        generated=generated, temperature=0.0, ignore_eos=True)


def serve(engine: HFEngine, s: int, reqs: list[BatchRequest], emit: Any = None) -> Any:
    return engine.serve(BatchMsg(batch_id=1, slice_len=s, requests=reqs), emit)


def one_pass(plain: HFEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs, _ = serve(plain, GEN, [req(f"ref{i}", p) for i, p in enumerate(prompts)])
    return [o.token_ids for o in outs]


class Sliced:
    """Requests served slice by slice, as the daemon does, on engines chosen per slice."""

    def __init__(self, prompts: list[list[int]], prefix: str) -> None:
        self.prompts = prompts
        self.rids = [f"{prefix}{i}" for i in range(len(prompts))]
        self.gen: list[list[int]] = [[] for _ in prompts]
        self.stats: list[Any] = []
        self.kept: list[list[int]] = []

    def step(self, engine: HFEngine, s: int, rows: list[int] | None = None) -> list[RequestOutput]:
        rows = [i for i in range(len(self.prompts)) if len(self.gen[i]) < GEN] if rows is None else rows
        reqs = [req(self.rids[i], self.prompts[i] + self.gen[i], len(self.gen[i])) for i in rows]
        outs, stats = serve(engine, s, reqs)
        for i, o in zip(rows, outs, strict=True):
            self.gen[i] += o.token_ids
        self.stats.append(stats)
        self.kept.append([o.kv_tokens for o in outs])
        return outs

    def run(self, engine: HFEngine, s: int) -> list[list[int]]:
        while any(len(g) < GEN for g in self.gen):
            self.step(engine, s)
        return self.gen


@pytest.mark.parametrize("s", [1, 4, 7])
def test_reuse_is_token_identical_and_prefills_only_what_is_new(plain, prompts, s):
    ref = one_pass(plain, prompts)
    eng = make()
    run = Sliced(prompts, f"s{s}-")
    assert run.run(eng, s) == ref
    assert Sliced(prompts, "p").run(plain, s) == ref
    # Every slice after the first prefills one token per row: the last one sampled.
    for st in run.stats[1:]:
        assert st.prefill_tokens == st.batch_size and st.pad_tokens == 0
        assert st.reused_tokens > 0
    # Unfinished rows report what is kept: their whole context but the last token.
    first = run.kept[0]
    assert first == [len(p) + s - 1 for p in prompts]
    assert run.kept[-1] == [0] * len(prompts)  # finished rows keep nothing
    assert eng.kv is not None and eng.kv.store.held() == {}


def test_held_rows_batched_with_newcomers(plain, prompts):
    """Rows with kept KV and rows without it in one batch: holes in the middle of the mask."""
    ref = one_pass(plain, prompts)
    eng = make()
    run = Sliced(prompts, "mix")
    run.step(eng, 5, rows=[0, 2])  # 0 and 2 now hold KV; 1 and 3 are new
    outs = run.step(eng, 5, rows=[0, 1, 2, 3])
    st = run.stats[-1]
    assert st.reused_tokens == (len(prompts[0]) + 4) + (len(prompts[2]) + 4)
    assert st.prefill_tokens == 1 + len(prompts[1]) + 1 + len(prompts[3])
    assert [o.kv_tokens > 0 for o in outs] == [True] * 4
    assert run.run(eng, 5) == ref


def test_evicted_request_is_prefilled_in_full(plain, prompts):
    ref = one_pass(plain, prompts)
    # Room for the longest retained context (prompt + 5), not for all of them.
    budget = (max(len(p) for p in prompts) + 5) * DELTA
    eng = make(kv_retain_bytes=budget)
    run = Sliced(prompts, "ev")
    outs = run.step(eng, 6)
    assert all(o.kv_tokens > 0 for o in outs)  # each kept at the time; later ones evict
    evicted = eng.take_evicted()
    held = eng.kv.store.held()  # type: ignore[union-attr]
    assert evicted and set(evicted) | set(held) == set(run.rids) and not set(evicted) & set(held)
    assert sum(held.values()) * DELTA <= budget
    assert eng.take_evicted() == []  # reported once
    run.step(eng, 6)
    assert run.stats[-1].reused_tokens == sum(held.values())
    assert run.run(eng, 6) == ref


def test_a_request_that_moved_and_came_back(plain, prompts):
    """Slice 1 on A, slice 2 on B, slice 3 on A again: A's entry covers a prefix only."""
    ref = one_pass(plain, prompts)
    a, b = make(), make()
    run = Sliced(prompts[:2], "mv")
    run.step(a, 5)
    run.step(b, 5)
    assert run.stats[-1].reused_tokens == 0  # B never saw them
    run.step(a, 5)  # no release: A's stale KV is a valid prefix of the longer context
    assert run.stats[-1].reused_tokens == sum(len(p) + 4 for p in prompts[:2])
    assert run.stats[-1].prefill_tokens == 2 * 6
    b.release(run.rids)  # the daemon's word when a request leaves a worker
    assert b.kv.store.held() == {}  # type: ignore[union-attr]
    assert run.run(b, 5) == ref[:2]


def test_kept_kv_of_another_context_is_not_used(plain, prompts):
    eng = make()
    serve(eng, 3, [req("same-id", prompts[1])])
    outs, st = serve(eng, GEN, [req("same-id", prompts[3])])  # an id used again, other text
    assert st.reused_tokens == 0
    assert outs[0].token_ids == one_pass(plain, [prompts[3]])[0]


def test_release_while_the_batch_runs(prompts):
    eng = make()
    calls: list[list[RequestOutput]] = []

    def emit(outputs: list[RequestOutput]) -> None:
        calls.append(outputs)
        if len(calls) == 2:
            eng.release(["r0"])  # from the receive thread, in a worker

    outs, _ = serve(eng, 4, [req("r0", prompts[0]), req("r1", prompts[1])], emit)
    assert [o.kv_tokens > 0 for o in outs] == [False, True]
    assert set(eng.kv.store.held()) == {"r1"}  # type: ignore[union-attr]
    eng.release()
    assert eng.kv.store.held() == {}  # type: ignore[union-attr]


def test_no_room_beside_the_batch_means_a_full_prefill(plain, prompts):
    ref = one_pass(plain, prompts[1:3])
    # Budget for the plain layout of these two rows and the slice, not for past + new.
    lens = [len(p) for p in prompts[1:3]]
    eng = make(mem_budget=(max(lens) + 3 + 3) * 2 * DELTA)
    run = Sliced(prompts[1:3], "oom")
    run.step(eng, 3, rows=[0])
    run.step(eng, 3, rows=[0, 1])  # held row 0 + new row 1: past + new exceeds the budget
    assert run.stats[-1].reused_tokens == 0
    assert run.run(eng, 3) == ref


def test_kv_that_does_not_fit_beside_a_batch_waits_in_host_memory(plain, prompts):
    """A host tier (GPU workers have one by default; here on the CPU by option)."""
    a, b, c = prompts[0], prompts[1], prompts[3]
    ref = one_pass(plain, [a, b, c])
    eng = make(mem_budget=57 * DELTA, kv_host_bytes=100 * DELTA)
    run = Sliced([a, b, c], "host")
    run.step(eng, 4, rows=[0, 1])  # keeps a (6 + 3 tokens) and b (31 + 3)
    run.step(eng, 4, rows=[2])  # c needs (17 + 4) · Δ beside them: a, the oldest, moves out
    store = eng.kv.store  # type: ignore[union-attr]
    assert store.on_host() == ["host0"] and store.host_nbytes == 9 * DELTA
    assert eng.take_evicted() == []
    run.step(eng, 4, rows=[0])  # back from host memory into the batch cache
    assert run.stats[-1].reused_tokens == 9
    assert run.run(eng, 4) == ref


def test_emit_streams_each_step(plain, prompts):
    calls: list[list[RequestOutput]] = []
    reqs = [req("e0", prompts[0], max_new=3), req("e1", prompts[1], max_new=6)]
    outs, stats = serve(plain, 8, reqs, calls.append)
    assert len(calls) == stats.iterations == 6
    assert [[o.rid for o in c] for c in calls[:1]] == [["e0", "e1"]]
    assert all(len(o.token_ids) == 1 for c in calls for o in c)
    for o in outs:
        streamed = [t for c in calls for x in c if x.rid == o.rid for t in x.token_ids]
        assert streamed == o.token_ids
    assert calls[2][0].finish_reason == "length"  # e0 ends at its third token
    assert [o.rid for o in calls[3]] == ["e1"]  # finished rows stream nothing more


@pytest.mark.slow
def test_reuse_is_token_identical_on_smollm2():
    """The default model (SmolLM2-135M): sliced with kept KV, evictions and a move = one pass."""
    ref_eng = create_engine("hf", None, threads=1, kv_reuse=False)
    from sclsd.tokenizer import load

    tok = load(ref_eng.info().model)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fib(n):", "Once upon a time")]
    n = 24
    rows = [BatchRequest(rid=str(i), token_ids=p, max_new_tokens=n, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts)]
    ref = [o.token_ids for o in ref_eng.serve(BatchMsg(batch_id=1, slice_len=n, requests=rows))[0]]
    a = create_engine("hf", None, threads=1)
    b = create_engine("hf", None, threads=1, kv_retain_bytes=40 * a.info().kv_bytes_per_token)
    gen: list[list[int]] = [[] for _ in prompts]
    reused = 0
    for k, eng in enumerate([a, a, b, b, a, a]):  # moves to b (which evicts) and back to a
        reqs = [BatchRequest(rid=str(i), token_ids=p + gen[i], max_new_tokens=n - len(gen[i]),
                             generated=len(gen[i]), temperature=0.0, ignore_eos=True)
                for i, p in enumerate(prompts)]
        outs, st = eng.serve(BatchMsg(batch_id=k, slice_len=4, requests=reqs))
        reused += st.reused_tokens
        for i, o in enumerate(outs):
            gen[i] += o.token_ids
    assert gen == ref
    assert reused > 0 and b.take_evicted()
