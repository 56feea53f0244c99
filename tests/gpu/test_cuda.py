"""CUDA checks of the engines: dtype and device, M_ava from ``torch.cuda.mem_get_info``, one
GPU per worker through ``CUDA_VISIBLE_DEVICES``, greedy equality of ``hf`` and ``deepspeed``.

Skipped without CUDA (conftest.py). With it these check DeepSpeed's wrapper on the GPU;
DeepSpeed's injected kernels are refused by the engine (worker/engines/deepspeed.py).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sclsd import models
from sclsd.defaults import offline_env
from sclsd.protocol import BatchMsg, BatchRequest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
GEN = 16


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (9, 33, 2, 17)]


def serve(engine, ps: list[list[int]], slice_len: int = GEN) -> list[list[int]]:
    reqs = [BatchRequest(rid=str(i), token_ids=p, max_new_tokens=GEN, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(ps)]  # fmt: skip
    outs, _ = engine.serve(BatchMsg(batch_id=1, slice_len=slice_len, requests=reqs))
    return [o.token_ids for o in outs]


def sliced(engine, ps: list[list[int]], s: int) -> list[list[int]]:
    gen: list[list[int]] = [[] for _ in ps]
    while any(len(g) < GEN for g in gen):
        live = [i for i in range(len(ps)) if len(gen[i]) < GEN]
        reqs = [BatchRequest(rid=str(i), token_ids=ps[i] + gen[i], max_new_tokens=GEN - len(gen[i]),
                             generated=len(gen[i]), temperature=0.0, ignore_eos=True) for i in live]  # fmt: skip
        outs, _ = engine.serve(BatchMsg(batch_id=1, slice_len=s, requests=reqs))
        for i, o in zip(live, outs, strict=True):
            gen[i] += o.token_ids
    return gen


@pytest.mark.parametrize("engine_name", ["hf", "deepspeed"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype_and_device_on_cuda(engine_name: str, dtype: str) -> None:
    """Weights on cuda:0 in the asked dtype, the rotary buffers on cuda:0 in fp32."""
    import torch

    if engine_name == "deepspeed":
        pytest.importorskip("deepspeed")
    from worker.engines import create_engine

    eng = create_engine(engine_name, "tiny-random", device="cuda:0", dtype=dtype)
    module = getattr(eng.model, "module", eng.model)
    want = models.resolve_dtype(dtype)
    assert {(p.device, p.dtype) for p in module.parameters()} == {(torch.device("cuda:0"), want)}
    inv = dict(module.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv.device == torch.device("cuda:0") and inv.dtype == torch.float32
    info = eng.info()
    assert info.device == "cuda:0" and info.extra["dtype"] == dtype
    assert info.kv_bytes_per_token == models.kv_bytes_per_token(eng.config, dtype)
    assert len(serve(eng, prompts())[0]) == GEN
    eng.close()


def test_m_ava_comes_from_the_free_memory() -> None:
    """On CUDA, M_ava comes from the free memory after the weights are resident, less the
    activation reserve and the allocator's share, not from the CPU budget: all of it on the eager path, the static
    cache's share (half) on the static path, which then holds exactly that."""
    import torch

    from worker.engines import create_engine
    from worker.engines.hf_model import FRAGMENTATION_SHARE
    from worker.engines.static_cache import activation_reserve

    eng = create_engine("hf", "tiny-random", device="cuda:0", mem_budget=123, static_cache=False)
    free, total = torch.cuda.mem_get_info(torch.device("cuda:0"))
    m_ava = eng.info().mem_available
    reserve = activation_reserve(eng.config, eng.dtype, 16384, 128) + FRAGMENTATION_SHARE * free
    assert m_ava != 123 and 0 < m_ava <= total
    assert abs(m_ava - (free - reserve)) <= 0.02 * total  # other processes may allocate meanwhile
    eng.close()
    eng = create_engine("hf", "tiny-random", device="cuda:0", mem_budget=123)
    assert eng.static is not None and eng.info().mem_available == eng.static.arena.nbytes
    assert abs(eng.static.arena.nbytes - 0.5 * eng.kv_limit) <= eng.delta
    eng.close()


def test_one_gpu_per_worker_through_cuda_visible_devices() -> None:
    """sclsd-worker@N.service shows the worker GPU N alone, as cuda:0: the engine built as
    the unit builds it runs on that physical GPU and sees no other."""
    import torch

    unit = (REPO / "systemd" / "sclsd-worker@.service").read_text()
    assert re.search(r"^Environment=CUDA_VISIBLE_DEVICES=%i$", unit, re.M)
    assert re.search(r"^ExecStart=.*--device cuda:0 ", unit, re.M)
    n = torch.cuda.device_count() - 1  # the last GPU: not the default device
    code = (
        "import json, torch\n"
        "from worker.engines import create_engine\n"
        "e = create_engine('hf', 'tiny-random', device='cuda:0')\n"
        "p = torch.cuda.get_device_properties(0)\n"
        "print(json.dumps({'count': torch.cuda.device_count(), 'uuid': str(p.uuid),"
        " 'device': e.info().device}))\n"
    )
    env = {**offline_env(), "CUDA_VISIBLE_DEVICES": str(n)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env, cwd=REPO, timeout=300)  # fmt: skip
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["count"] == 1 and seen["device"] == "cuda:0"
    assert seen["uuid"] == str(torch.cuda.get_device_properties(n).uuid)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_greedy_hf_equals_deepspeed_on_cuda(dtype: str) -> None:
    """Greedy tokens of ``deepspeed`` equal ``hf``'s on CUDA, in one pass and resumed across
    slices (the wrapper on the GPU; no injected kernels)."""
    pytest.importorskip("deepspeed")
    from worker.engines import create_engine

    hf = create_engine("hf", "tiny-random", device="cuda:0", dtype=dtype, static_cache=False)
    ref = serve(hf, prompts())
    hf.close()
    ds = create_engine("deepspeed", "tiny-random", device="cuda:0", dtype=dtype)
    assert serve(ds, prompts()) == ref
    assert sliced(ds, prompts(), 5) == ref
    ds.close()


def test_kernel_inject_is_refused_on_cuda_with_the_reason() -> None:
    pytest.importorskip("deepspeed")
    from worker.engines import create_engine
    from worker.engines.deepspeed import KERNEL_INJECT_REFUSAL

    with pytest.raises(ValueError) as exc:
        create_engine("deepspeed", "tiny-random", device="cuda:0", dtype="float16", kernel_inject=True)
    assert str(exc.value) == KERNEL_INJECT_REFUSAL


def test_random_llama2_7b_is_initialised_on_the_device() -> None:
    """random:llama2-7b in fp16 builds directly on the GPU (no CPU copy), within a minute."""
    import time

    import torch

    free, _ = torch.cuda.mem_get_info(torch.device("cuda:0"))
    if free < 20 * 2**30:
        pytest.skip("needs 20 GiB free on cuda:0")
    t0 = time.perf_counter()
    m = models.load_model("random:llama2-7b", device="cuda:0", dtype="float16")
    took = time.perf_counter() - t0
    assert {p.device.type for p in m.parameters()} == {"cuda"}
    assert {p.dtype for p in m.parameters()} == {torch.float16}
    assert took < 60, took
    del m
    torch.cuda.empty_cache()
