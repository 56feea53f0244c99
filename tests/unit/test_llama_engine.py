"""llama: llama.cpp's kernels under sclsd's rows, slices and sampling (tiny-random as a GGUF).

tiny-random's GGUF holds the weights hf serves for that name (fp32), so the two engines
are checked against each other: greedy tokens, seeded draws, penalties and
log-probabilities come out the same from the same logits.
"""

from __future__ import annotations

import queue
import threading

import pytest

from sclsd import protocol as P
from unit.engine_loop import queue_take, run

pytest.importorskip("ik_llama_cpp")
pytest.importorskip("torch")

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 4093, 198, 57, 5248, 1535, 288] * 3


@pytest.fixture(scope="module")
def llama():
    from worker.engines import create_engine

    eng = create_engine("llama", "tiny-random", threads=1, max_rows=4)
    eng.warm_up()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf():
    from worker.engines import create_engine

    return create_engine("hf", "tiny-random", threads=1, kv_reuse=False)


def row(rid: str, tokens: list[int], n: int, **kw: object) -> P.BatchRequest:
    return P.BatchRequest(rid=rid, token_ids=tokens, max_new_tokens=n, **({"temperature": 0.0} | kw))  # type: ignore[arg-type]


def batch(bid: int, reqs: list[P.BatchRequest], slice_len: int = 64, **kw: object) -> P.BatchMsg:
    return P.BatchMsg(batch_id=bid, slice_len=slice_len, requests=reqs, **kw)  # type: ignore[arg-type]


def in_slices(eng, rid: str, prompt: list[int], total: int, size: int, neighbours: bool, bid: int,
              between=None, **kw: object) -> list[int]:
    """``rid`` served in slices of ``size`` (beside two rows of other requests when
    ``neighbours``), its context growing by what it generated; ``between(k)`` after slice k."""
    ctx, got = list(prompt), []
    k = 0
    while len(got) < total:
        reqs = [row(rid, list(ctx), total - len(got), generated=len(got), **kw)]
        if neighbours:
            reqs += [row(f"{rid}-x{k}", prompt[: 5 + k], 3 + 2 * k), row(f"{rid}-y{k}", prompt[3:], 40)]
        outs, _ = eng.serve(batch(bid + k, reqs, slice_len=size))
        got += outs[0].token_ids
        ctx += outs[0].token_ids
        if between is not None:
            between(k)
        k += 1
    return got


def test_facts_and_caps(llama) -> None:
    info = llama.info()
    caps = info.caps
    assert info.engine == "llama" and info.model == "tiny-random" and info.vocab_size == 49152
    # 2 layers, 2 KV heads of 16, fp16: 2 * 2 * (16 + 16) * 2 bytes.
    assert info.kv_bytes_per_token == 256
    assert info.mem_available == llama.n_ctx * 256 and llama.n_ctx >= 2048
    assert caps.batching == "continuous" and caps.sampling and caps.seeded and caps.min_tokens
    assert caps.logit_bias and caps.grammar and caps.kv_page_tokens == 1
    assert caps.max_context == min(4096, llama.n_ctx)


def test_greedy_equals_hf(llama, hf) -> None:
    reqs = [row("a", PROMPT, 24, ignore_eos=True), row("b", PROMPT[:7], 20, ignore_eos=True)]
    got, stats = llama.serve(batch(1, reqs))
    want, _ = hf.serve(batch(1, reqs))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["length", "length"]
    assert stats.batch_size == 2 and stats.pad_tokens == 0 and stats.prefill_tokens == len(PROMPT) + 7


def test_slices_with_neighbours_equal_one_pass(llama) -> None:
    (one,), _ = llama.serve(batch(10, [row("one", PROMPT, 48, ignore_eos=True)]))
    llama.release()
    got = in_slices(llama, "sl", PROMPT, 48, 16, True, 11, ignore_eos=True)
    assert got == one.token_ids
    llama.release()


def test_a_request_prefilled_again_from_any_point_equals_one_pass(llama) -> None:
    """What a worker killed mid-request leaves: the request is served again elsewhere, its
    answer so far prefilled after its prompt, with no KV kept. Its tokens must still be one
    pass's, greedy and seeded (``sclsd-bench chaos --engine llama`` holds the daemon to it)."""
    for bid, kw in ((12, {"ignore_eos": True}), (14, {"ignore_eos": True, "temperature": 0.9, "seed": 5})):
        (one,), _ = llama.serve(batch(bid, [row("again", PROMPT, 40, **kw)]))
        llama.release()
        got = in_slices(llama, "again", PROMPT, 40, 7, True, bid + 100, between=lambda _k: llama.release(), **kw)
        assert got == one.token_ids


def test_kept_kv_is_reused_and_reported(llama) -> None:
    llama.release()
    (first,), st1 = llama.serve(batch(20, [row("k", PROMPT, 30)], slice_len=10))
    assert first.finish_reason is None and first.kv_tokens == len(PROMPT) + 9
    assert llama.kept() == {"k": len(PROMPT) + 9}
    ctx = PROMPT + first.token_ids
    (second,), st2 = llama.serve(batch(21, [row("k", ctx, 20, generated=10)], slice_len=10))
    # Only the last token picked was not in the KV.
    assert second.reused_tokens == len(ctx) - 1 and st2.prefill_tokens == 1 and st2.reused_tokens == len(ctx) - 1
    llama.release(["k"])
    (third,), st3 = llama.serve(batch(22, [row("k", ctx + second.token_ids, 10, generated=20)], slice_len=10))
    assert third.reused_tokens == 0 and st3.prefill_tokens == len(ctx) + 10
    llama.release()


def test_kv_moved_to_host_and_back_equals_one_pass(llama) -> None:
    (one,), _ = llama.serve(batch(30, [row("h1", PROMPT, 36, ignore_eos=True)]))
    llama.release()
    moved = []

    def spill(_k: int) -> None:
        assert llama.kv.spill(0, 0)  # every kept sequence out of the context, to host memory
        moved.append(llama.kv.host_bytes)

    got = in_slices(llama, "h2", PROMPT, 36, 12, True, 31, between=spill, ignore_eos=True)
    assert got == one.token_ids
    assert all(b > 0 for b in moved[:2])
    llama.release()
    assert llama.kv.host_bytes == 0 and llama.kept() == {}


def test_kept_kv_past_the_host_budget_is_evicted(llama) -> None:
    llama.release()
    llama.take_evicted()
    limit = llama.kv.host_limit
    llama.kv.host_limit = 1000  # smaller than any sequence's state
    try:
        llama.serve(batch(40, [row("e1", PROMPT, 20)], slice_len=4))
        assert "e1" in llama.kept()
        llama.kv.spill(0, 0)
        assert llama.take_evicted() == ["e1"] and llama.kept() == {}
    finally:
        llama.kv.host_limit = limit


def test_seeded_sampling_equals_hf_in_any_slices(llama, hf) -> None:
    kw = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    want, _ = hf.serve(batch(50, [row("s", PROMPT, 30, **kw)]))
    got = in_slices(llama, "s", PROMPT, 30, 7, True, 51, **kw)
    assert got == want[0].token_ids
    llama.release()


def test_penalties_min_p_and_logprobs_match_hf(llama, hf) -> None:
    reqs = [row("p", PROMPT, 16, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                ignore_eos=True),
            row("q", PROMPT[:9], 12, temperature=1.0, min_p=0.2, seed=5, logprobs=True, top_logprobs=3,
                ignore_eos=True)]
    got, _ = llama.serve(batch(60, reqs))
    want, _ = hf.serve(batch(60, reqs))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(got[1].logprobs) == 12 and not got[0].logprobs
    for a, b in zip(got[1].logprobs, want[1].logprobs, strict=True):
        assert a.chosen.id == b.chosen.id and abs(a.chosen.logprob - b.chosen.logprob) < 0.05  # the fp16 KV cache
        assert [t.id for t in a.top] == [t.id for t in b.top]
    llama.release()


def test_min_tokens_logit_bias_and_stop_tokens(llama) -> None:
    (free,), _ = llama.serve(batch(70, [row("f", PROMPT, 12, ignore_eos=True)]))
    stop = free.token_ids[3]
    (stopped,), _ = llama.serve(batch(71, [row("st", PROMPT, 12, ignore_eos=True, stop_token_ids=[stop])]))
    assert stopped.token_ids == free.token_ids[:4] and stopped.finish_reason == "stop"
    (held,), _ = llama.serve(batch(72, [row("mt", PROMPT, 12, ignore_eos=True, stop_token_ids=[stop],
                                             min_tokens=8)]))
    assert stop not in held.token_ids[:8]
    (forced,), _ = llama.serve(batch(73, [row("lb", PROMPT, 5, ignore_eos=True, logit_bias={777: 100.0})]))
    assert forced.token_ids == [777] * 5
    llama.release()


def test_grammar_rows_follow_it_and_a_bad_one_fails_alone(llama) -> None:
    import json

    grammar = json.dumps({"grammars": [{"lark_grammar": 'start: /[0-9]{3}/'}]})
    reqs = [row("g", PROMPT, 10, grammar=grammar), row("bad", PROMPT, 5, grammar="{not a grammar"),
            row("plain", PROMPT[:5], 4, ignore_eos=True)]
    outs, _ = llama.serve(batch(80, reqs))
    from sclsd import models

    text = models.load_tokenizer("tiny-random").decode(outs[0].token_ids, skip_special_tokens=True)
    assert len(text) == 3 and text.isdigit() and outs[0].finish_reason == "stop"
    assert outs[1].error and not outs[1].token_ids
    assert len(outs[2].token_ids) == 4
    llama.release()


def test_a_malformed_batch_fails_with_its_reason(llama) -> None:
    with pytest.raises(ValueError, match="empty context"):
        llama.serve(batch(90, [row("e", [], 3)]))
    with pytest.raises(ValueError, match="outside vocab"):
        llama.serve(batch(91, [row("v", [49152], 3)]))
    with pytest.raises(ValueError, match="do not fit"):
        llama.serve(batch(92, [row("long", PROMPT, llama.n_ctx)], slice_len=llama.n_ctx))
    assert not llama.busy()


def test_rows_join_and_leave_between_steps(llama) -> None:
    """A batch submitted while another generates joins the running set; each ends alone with
    its tokens streamed first, and the rows beyond max_rows wait for a place."""
    q: queue.Queue = queue.Queue()
    done: dict[int, list[P.RequestOutput]] = {}
    streamed: dict[str, list[int]] = {}

    def on_done(b, outs, _stats, err) -> None:
        assert err is None
        done[b.batch_id] = outs
        if len(done) == 2:
            q.put(None)

    def on_tokens(_bid, outs) -> None:
        for o in outs:
            streamed.setdefault(o.rid, []).extend(o.token_ids)

    q.put(batch(100, [row("long", PROMPT, 30, ignore_eos=True)]))
    q.put(batch(101, [row(f"w{i}", PROMPT[: 4 + i], 6, ignore_eos=True) for i in range(5)]))
    run(llama, queue_take(q), on_done, on_tokens)
    assert len(done[100][0].token_ids) == 30 and all(len(o.token_ids) == 6 for o in done[101])
    assert all(streamed[o.rid] == o.token_ids for outs in done.values() for o in outs)
    (alone,), _ = llama.serve(batch(102, [row("long", PROMPT, 30, ignore_eos=True)]))
    assert alone.token_ids == done[100][0].token_ids
    llama.release()


def test_release_from_another_thread_while_rows_run(llama) -> None:
    llama.release()
    llama.serve(batch(110, [row("r1", PROMPT, 20)], slice_len=5))
    assert "r1" in llama.kept()
    llama.submit(batch(111, [row("r2", PROMPT, 20)], slice_len=10))
    t = threading.Thread(target=llama.release, args=(["r1", "r2"],))
    t.start()
    t.join()
    events = []
    while llama.busy():
        events += llama.poll(0.01)
    (out,) = events[-1].outputs
    assert out.kv_tokens == 0 and llama.kept() == {}  # r2 ran when released: nothing kept at its end


def test_auto_picks_llama_for_a_gguf_on_the_cpu() -> None:
    from sclsd import models
    from sclsd.defaults import BUILTIN_GGUF, auto_engine, is_gguf

    assert is_gguf("smollm2-135m-instruct") and is_gguf("default") and is_gguf("/m/x.gguf")
    assert not is_gguf("tiny-random") and not is_gguf("HuggingFaceTB/SmolLM2-360M-Instruct")
    # The built-in names are the models module's: every one resolves to the shipped GGUF.
    assert all(models.resolve(name).kind == "gguf" for name in BUILTIN_GGUF)
    assert models.DEFAULT_MODEL in BUILTIN_GGUF
    assert auto_engine(True, "smollm2-135m-instruct", "cpu") == "llama"
    assert auto_engine(False, "/m/x.gguf", "cpu") == "llama"
    assert auto_engine(True, "smollm2-135m-instruct", "cuda") == "hf-static-cb"  # transformers on a GPU
    assert auto_engine(False, "tiny-random", "cpu") == "hf"
    assert auto_engine(True, "fake", "cpu") == "fake"


def test_rows_ending_before_their_neighbours_change_nothing(llama) -> None:
    """Rows that end free their cells among a running row's: its next tokens must not land in
    those holes unseen (this build gets their logits wrong; the cache is compacted first)."""
    (alone,), _ = llama.serve(batch(120, [row("c", PROMPT, 40, ignore_eos=True)]))
    llama.release()
    reqs = [row("x", PROMPT[:3], 5, ignore_eos=True), row("y", PROMPT[:11], 9, ignore_eos=True),
            row("c", PROMPT, 40, ignore_eos=True)]
    outs, _ = llama.serve(batch(121, reqs))
    assert outs[2].token_ids == alone.token_ids
    assert llama.ctx.compactions > 0
    llama.release()


def test_the_default_model_brings_its_measured_profile() -> None:
    from worker.engines import create_engine

    eng = create_engine("llama", threads=1)
    try:
        prof = eng.profile()
        assert prof is not None and prof["name"] == "cpu-smollm2-135m-llama" and prof["engine"] == "llama"
        assert prof["kv_bytes_per_token"] == 23040 and prof["mem_available"] == eng.n_ctx * 23040
    finally:
        eng.close()
    assert create_engine("llama", "tiny-random", threads=1).profile() is None


def test_cancelled_rows_leave_at_the_next_step_waiting_or_running(llama) -> None:
    llama.release()
    (alone,), _ = llama.serve(batch(130, [row("keep", PROMPT, 20, ignore_eos=True)]))
    reqs = [row("keep", PROMPT, 20, ignore_eos=True), row("gone", PROMPT[:9], 20, ignore_eos=True)]
    reqs += [row(f"w{i}", PROMPT[:5], 20, ignore_eos=True) for i in range(4)]  # beyond max_rows: waiting
    llama.submit(batch(131, reqs, slice_len=10))
    events = llama.poll(0.0) + llama.poll(0.0) + llama.poll(0.0)
    llama.cancel([(131, "gone"), (131, "w3"), (999, "keep")])  # another batch's row is untouched
    while llama.busy():
        events += llama.poll(0.0)
    done = [e for e in events if hasattr(e, "stats")]
    assert len(done) == 1
    outs = {o.rid: o for o in done[0].outputs}
    assert outs["gone"].finish_reason == "cancelled" and 0 < len(outs["gone"].token_ids) < 10
    assert outs["gone"].kv_tokens == 0 and outs["w3"].finish_reason == "cancelled" and not outs["w3"].token_ids
    assert outs["keep"].token_ids == alone.token_ids[:10] and outs["keep"].kv_tokens > 0
    assert "gone" not in llama.kept() and "w3" not in llama.kept() and "keep" in llama.kept()
    assert llama.info().caps.max_rows == 4
    llama.release()


def test_sampled_rows_keep_torch_on_one_thread(llama) -> None:
    """torch's default thread per core spins on the cores llama.cpp decodes on."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llama.serve(batch(140, [row("t", PROMPT, 3, temperature=1.0, seed=1)]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    llama.release()


def test_prompt_logprobs_are_the_models_over_the_whole_prompt(llama, hf) -> None:
    """A row asking for its prompt's log-probabilities gets, for each prompt token after the
    first, the model's log-softmax at the position before it (hf's full forward of the same
    weights), over prefill chunks (48 tokens: more than one decode on a CPU that caps steps at
    31), beside rows that ask for nothing; its tokens are the ones it gets without asking, the
    first streamed part carries them, and a later slice of the request computes none."""
    import torch

    def reference(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf.model(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]

    reqs = [row("a", PROMPT, 5, prompt_logprobs=3, ignore_eos=True),
            row("b", PROMPT[:9], 4, prompt_logprobs=0, logprobs=True, ignore_eos=True),
            row("c", PROMPT[:20], 4, ignore_eos=True)]
    q: queue.Queue = queue.Queue()
    done: dict[int, list[P.RequestOutput]] = {}
    parts: dict[str, list[P.RequestOutput]] = {}

    def on_done(b, outs, _stats, err) -> None:
        assert err is None
        done[b.batch_id] = outs
        q.put(None)

    def on_tokens(_bid, outs) -> None:
        for o in outs:
            parts.setdefault(o.rid, []).append(o)

    q.put(batch(110, reqs))
    run(llama, queue_take(q), on_done, on_tokens)
    a, b, c = done[110]
    for out, prompt, k in ((a, PROMPT, 3), (b, PROMPT[:9], 0)):
        ref = reference(prompt)
        assert [e.chosen.id for e in out.prompt_logprobs] == prompt[1:]
        for p, e in enumerate(out.prompt_logprobs):  # within the fp16 KV cache's noise
            assert abs(e.chosen.logprob - ref[p, prompt[p + 1]].item()) < 0.05
            assert len(e.top) == k
            assert max((abs(t.logprob - ref[p, t.id].item()) for t in e.top), default=0) < 0.05
            top = ref[p].topk(k).values.tolist() if k else []
            assert max((abs(t.logprob - v) for t, v in zip(e.top, top, strict=True)), default=0) < 0.05
        assert parts[out.rid][0].prompt_logprobs == out.prompt_logprobs
        assert all(not p.prompt_logprobs for p in parts[out.rid][1:])
    assert not c.prompt_logprobs and len(b.logprobs) == 4
    plain, _ = llama.serve(batch(111, [row(r.rid + "-plain", r.token_ids, 5 if r.rid == "a" else 4, ignore_eos=True)
                                       for r in reqs]))
    assert [o.token_ids for o in plain] == [o.token_ids for o in (a, b, c)]
    (later,), _ = llama.serve(batch(112, [row("a", PROMPT + a.token_ids, 3, prompt_logprobs=3, generated=5)]))
    assert not later.prompt_logprobs and len(later.token_ids) == 3
    llama.release()


@pytest.fixture(scope="module")
def sharing():
    from worker.engines import create_engine

    eng = create_engine("llama", "tiny-random", threads=1, max_rows=4, share_prefixes=True)
    eng.warm_up()
    yield eng
    eng.close()


def test_a_prompt_that_begins_with_another_requests_starts_from_its_kv(sharing) -> None:
    """A finished request whose head another recent one shares leaves its KV as a cached prefix
    (a lone one leaves none): a later request whose context begins with it (here: the first's
    prompt, then more) copies it and prefills only the rest, with the tokens of a full prefill;
    a row that scores its prompt, or a batch without kv_reuse, takes none; a release of
    everything drops them."""
    sharing.release()
    sharing.kv.apply_releases()
    (lone,), _ = sharing.serve(batch(119, [row("lone", [3] + PROMPT[1:], 2, ignore_eos=True)]))
    assert not sharing.kv.cached  # nobody began alike
    first, _ = sharing.serve(batch(120, [row("first", PROMPT, 6, ignore_eos=True),
                                         row("twin", PROMPT[:20] + [5, 6, 7], 2, ignore_eos=True)]))
    assert first[0].reused_tokens == first[1].reused_tokens == 0 and len(sharing.kv.cached) == 2
    longer = PROMPT + first[0].token_ids[:3] + [1, 9690, 198]
    (got,), _ = sharing.serve(batch(121, [row("second", longer, 8, ignore_eos=True)]))
    assert got.reused_tokens == len(PROMPT) + 3  # the prompt and the 3 tokens it generated and fed
    assert sharing.kv.shared >= 1
    # The same tokens as a full prefill of the same context (kv_reuse off: nothing shared).
    (paper,), _ = sharing.serve(batch(123, [row("paper", longer, 8, ignore_eos=True)], kv_reuse=False))
    assert paper.reused_tokens == 0 and paper.token_ids == got.token_ids
    (scored,), _ = sharing.serve(batch(122, [row("scored", longer, 2, prompt_logprobs=0, ignore_eos=True)]))
    assert scored.reused_tokens == 0 and len(scored.prompt_logprobs) == len(longer) - 1
    sharing.release()
    sharing.kv.apply_releases()
    assert not sharing.kv.cached
    (again,), _ = sharing.serve(batch(124, [row("again", longer, 2, ignore_eos=True)]))
    assert again.reused_tokens == 0
    sharing.release()
    # Turned off, the same requests each prefill in full.
    from worker.engines import create_engine

    unshared = create_engine("llama", "tiny-random", threads=1, max_rows=4, share_prefixes=False)
    try:
        unshared.warm_up()
        unshared.serve(batch(125, [row("first", PROMPT, 6, ignore_eos=True),
                                   row("twin", PROMPT[:20] + [5, 6, 7], 2, ignore_eos=True)]))
        (plain,), _ = unshared.serve(batch(126, [row("second", longer, 8, ignore_eos=True)]))
        assert plain.reused_tokens == 0 and plain.token_ids == got.token_ids and not unshared.kv.cached
    finally:
        unshared.close()


def test_cached_prefixes_give_way_to_running_rows(sharing) -> None:
    """Cached prefixes stay within their budget of cells however many rows end, and give way:
    new rows of other prompts, wanting most of the cells, still run."""
    sharing.release()
    sharing.kv.apply_releases()
    n_seq = sharing.ctx.n_seq
    for i in range(n_seq):
        sharing.serve(batch(130 + i, [row(f"fill{i}", PROMPT[:16] + [2 + i] + PROMPT[17:], 1, ignore_eos=True)]))
    assert 0 < len(sharing.kv.cached) < n_seq  # one sequence always stays free for rows
    assert 0 < sharing.kv.cached_tokens() <= sharing.kv.cache_cells
    big = max(16, (sharing.n_ctx - sharing.kv.cached_tokens()) // 2)
    reqs = [row(f"new{i}", [(7 + 31 * i + j) % 40000 + 100 for j in range(big // 4)], 4, ignore_eos=True)
            for i in range(4)]
    outs, _ = sharing.serve(batch(150, reqs))
    assert all(len(o.token_ids) == 4 and o.reused_tokens == 0 for o in outs)
    sharing.release()
