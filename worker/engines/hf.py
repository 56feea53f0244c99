"""``hf``: a transformers causal LM served with static batching.

One batch = one left-padded prefill of every row's context (prompt + tokens of
earlier slices, by id) followed by a plain decode loop over a ``DynamicCache``
for at most ``slice_len`` iterations (the prefill yields the first token, each
decode step one more). Rows that finish keep being computed (the batch is
static) and are counted as invalid tokens; the loop stops as soon as every row
has finished.

Greedy output served in slices equals greedy output served in one pass: the
attention mask hides the padding and position ids count real tokens only, so a
row's logits do not depend on its padding or its batch neighbours beyond
floating-point reduction order.
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any

from sclsd import models
from sclsd.protocol import BatchMsg, BatchRequest, BatchStats, RequestOutput
from worker.engines.base import Engine, EngineInfo
from worker.engines.sampling import random_seed, sample_row

log = logging.getLogger(__name__)

#: M_ava on the CPU when no budget is configured.
DEFAULT_CPU_BUDGET = 4 * 1024**3


class RowState:
    """Per-row bookkeeping of one batch."""

    __slots__ = ("req", "stops", "seed", "out", "reason")

    def __init__(self, req: BatchRequest, eos: list[int]) -> None:
        self.req = req
        self.stops = set(req.stop_token_ids)
        if not req.ignore_eos:
            self.stops.update(eos)
        # Unseeded sampling draws a fresh seed per slice: not reproducible, by request.
        self.seed = req.seed if req.seed is not None else random_seed()
        self.out: list[int] = []
        self.reason: str | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    def push(self, token: int) -> None:
        """Record a generated token and decide whether the row has finished."""
        self.out.append(token)
        if token in self.stops:
            self.reason = "stop"
        elif len(self.out) >= self.req.max_new_tokens:
            self.reason = "length"


def peak_memory(device: Any) -> int:
    """CUDA: max allocated bytes since the last reset; CPU: the process's peak RSS."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class HFEngine(Engine):
    """Static-batching transformers engine (see the module docstring)."""

    name = "hf"

    def __init__(
        self,
        model: str = models.DEFAULT_MODEL,
        device: str = "cpu",
        dtype: Any = None,
        mem_budget: int | None = None,
        threads: int | None = None,
    ) -> None:
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        self.spec = models.resolve(model)
        self.device = torch.device(device)
        self.dtype = models.resolve_dtype(dtype)
        self.mem_budget = mem_budget
        t0 = time.perf_counter()
        self.model = models.load_model(self.spec, device=str(self.device), dtype=self.dtype)
        self.load_s = time.perf_counter() - t0
        self.config = self.model.config
        self.eos = models.eos_token_ids(self.model)
        pad = getattr(self.config, "pad_token_id", None)
        # Pad id only fills masked slots; any valid id works.
        self.pad_id = int(pad) if isinstance(pad, int) else (self.eos[0] if self.eos else 0)
        self.delta = models.kv_bytes_per_token(self.config, self.dtype)
        self.vocab_size = self._vocab_size()
        log.info("loaded %s on %s in %.1f s", self.spec.name, self.device, self.load_s)

    # ------------------------------------------------------------------ facts

    def _vocab_size(self) -> int:
        """``len(tokenizer)`` (added tokens included), as the daemon's tokenizer counts it.

        Capped at the config's ``vocab_size``: a model whose embedding is smaller than
        its tokenizer cannot take every id, and the daemon's check should see that.
        Loaded here, with the model, so that registering never waits on it.
        ``tiny-random`` is built with exactly the SmolLM2 tokenizer's size, so its
        config answers without the seconds a GGUF tokenizer takes to load. Without a
        tokenizer the config's ``vocab_size`` is the best guess.
        """
        config_vocab = int(getattr(self.config, "vocab_size", 0) or 0)
        if self.spec.kind == "tiny":
            return config_vocab
        try:
            tok_vocab = len(models.load_tokenizer(self.spec))
        except Exception as exc:  # a model may come without any tokenizer: still servable
            log.warning("no tokenizer for %s (%s): reporting the config's vocab_size %d",
                        self.spec.name, exc, config_vocab)  # fmt: skip
            return config_vocab
        if config_vocab and tok_vocab > config_vocab:
            log.warning("%s: tokenizer has %d tokens, the model only %d",
                        self.spec.name, tok_vocab, config_vocab)  # fmt: skip
            return config_vocab
        return tok_vocab

    def info(self) -> EngineInfo:
        """Δ from the config; M_ava is CUDA's free memory, or ``mem_budget`` (4 GiB) on the CPU."""
        import torch

        if self.device.type == "cuda":
            # Measured after the weights are resident; the CPU budget does not apply.
            mem, _total = torch.cuda.mem_get_info(self.device)
        else:
            mem = self.mem_budget or DEFAULT_CPU_BUDGET
        return EngineInfo(
            engine=self.name,
            model=self.spec.name,
            device=str(self.device),
            kv_bytes_per_token=self.delta,
            mem_available=int(mem),
            eos_token_ids=list(self.eos),
            vocab_size=self.vocab_size,
            extra={
                "dtype": str(self.dtype).removeprefix("torch."),
                "max_context": int(getattr(self.config, "max_position_embeddings", 0) or 0),
                "load_s": round(self.load_s, 3),
            },
        )

    # ------------------------------------------------------------------ serving

    def serve(self, batch: BatchMsg) -> tuple[list[RequestOutput], BatchStats]:
        """Serve one batch for at most ``batch.slice_len`` iterations."""
        import torch

        reqs = batch.requests
        if not reqs:
            return [], BatchStats()
        self.check_batch(batch)
        try:
            with torch.inference_mode():
                return self._serve(batch)
        except torch.OutOfMemoryError:
            # The batch's cache is garbage now; hand its blocks back before the next batch.
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise

    def _serve(self, batch: BatchMsg) -> tuple[list[RequestOutput], BatchStats]:
        import torch
        from transformers import DynamicCache

        dev = self.device
        rows = [RowState(r, self.eos) for r in batch.requests]
        n = len(rows)
        lens = [len(r.token_ids) for r in batch.requests]
        width = max(lens)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

        # Left padding: every row's last real token sits in the last column, so one
        # logits column serves the whole batch.
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch.requests):
            ids[i, width - lens[i] :] = torch.tensor(r.token_ids, dtype=torch.long)
            mask[i, width - lens[i] :] = 1
        # Positions count real tokens only, so a row sees the same rotary phases
        # whatever its padding (pads get 0; they are masked anyway).
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        cache = DynamicCache(config=self.config)

        t0 = time.perf_counter()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._pick(rows, out.logits[:, -1, :])
        t1 = time.perf_counter()
        iterations, invalid = 1, 0
        last_pos = pos[:, -1:]
        while iterations < batch.slice_len and not all(r.done for r in rows):
            invalid += sum(r.done for r in rows)
            step_ids = torch.tensor(
                [[r.out[-1]] if r.out else [self.pad_id] for r in rows], dtype=torch.long
            ).to(dev)
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
            last_pos = last_pos + 1
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=last_pos,
                past_key_values=cache,
                use_cache=True,
            )
            self._pick(rows, out.logits[:, -1, :])
            iterations += 1
        t2 = time.perf_counter()

        outputs = [
            RequestOutput(rid=r.req.rid, token_ids=r.out, finish_reason=r.reason) for r in rows
        ]
        stats = BatchStats(
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            iterations=iterations,
            pad_tokens=sum(width - x for x in lens),
            invalid_tokens=invalid,
            peak_memory=peak_memory(dev),
            batch_size=n,
            input_len=width,
        )
        return outputs, stats

    def _pick(self, rows: list[RowState], logits: Any) -> None:
        """Choose the next token of every unfinished row from its last-position logits."""
        # One argmax over the batch (a single device sync) serves the greedy rows.
        greedy = logits.argmax(dim=-1).tolist()
        for i, r in enumerate(rows):
            if r.done:
                continue
            req = r.req
            if req.temperature <= 0.0:
                r.push(int(greedy[i]))
            else:
                position = req.generated + len(r.out)
                r.push(
                    sample_row(logits[i], req.temperature, req.top_k, req.top_p, r.seed, position)
                )

    def close(self) -> None:
        """Drop the model and give cached CUDA memory back."""
        import torch

        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
