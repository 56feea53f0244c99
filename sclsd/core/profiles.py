"""Cost profiles: a fitted estimator plus the memory facts of one engine/model/device.

A profile is a JSON file (see ``sclsd/data/profiles/`` for the built-ins and
docs/estimator.md for their derivation)::

    {"name": ..., "engine": "hf", "model": ..., "device": ..., "source": "measured",
     "coefficients": {"p1": ..., ..., "d4": ...},
     "rmse": {"prefill_s": ..., "decode_s": ..., "batch_s": ...},
     "kv_bytes_per_token": 819200, "mem_available": 5.5e10,
     "rules": [[1024, 12], [512, 22], [0, 28]] | null,
     "gamma_s": 6.0, "slice_len": 128,
     "host_link_bytes_per_s": 2.5e10 | null, "host_kv_bytes": 1.28e11 | null,
     "samples": {"prefill": [[n, L, s], ...], "decode": [[n, l, s], ...],
                 "batch": [[n, L, S, s], ...]},
     "notes": "..."}

:meth:`Profile.cost` turns it into the :class:`~sclsd.core.interfaces.CostModel`
the scheduler, the batcher and the simulator use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .estimator import Estimator
from .memory import UNBOUNDED, KVMemory, RuleTable

if TYPE_CHECKING:
    # Only for the annotation: importlib.abc.Traversable is deprecated at run time
    # from Python 3.12 on, and importlib.resources.abc is missing before 3.11.
    from importlib.abc import Traversable


def _builtin_dir() -> Traversable:
    """Where the built-in profiles live, inside the package (one child per call: Python 3.10)."""
    return resources.files("sclsd").joinpath("data").joinpath("profiles")


#: The profile of the embedded default model (SmolLM2-135M-Instruct on one CPU core).
DEFAULT_PROFILE = "cpu-smollm2-135m"


@dataclass(frozen=True)
class ProfileCost:
    """A :class:`~sclsd.core.interfaces.CostModel`: estimator time, KV or rule-table memory.

    Also implements the batcher's vectorised fast path
    (:class:`~sclsd.core.interfaces.LinearCost`) and what KV reuse needs
    (:class:`~sclsd.core.interfaces.CachedCost`).
    """

    estimator: Estimator
    memory: KVMemory | RuleTable
    delta: int = 0
    """Δ, KV bytes per token; read from ``memory`` when it is the KV model."""
    host_link: float | None = None
    """Bytes/s of the device-host link retained KV comes back over; None: no host tier."""
    host_kv_bytes: float = 0.0
    """Host memory a worker may keep retained KV in (with a host link)."""
    max_total: int = 2048
    """Longest context + slice a rule table is read at (its token budget)."""

    def t_serve(self, n: int, input_len: int, slice_len: int) -> float:
        """Estimated seconds for a batch of ``n`` padded to ``input_len``, ``slice_len`` iterations."""
        return self.estimator.t_serve(n, input_len, slice_len)

    def oom(self, n: int, input_len: int, slice_len: int) -> bool:
        """True when the batch would not fit in memory."""
        return self.memory.oom(n, input_len, slice_len)

    def linear_terms(self, L: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
        """``(a, b)`` per input length with ``t_serve(n, L, S) = a·n + b``."""
        return self.estimator.linear_terms(np.asarray(L, dtype=np.float64), S)

    def max_batch(self, L: np.ndarray, S: int) -> np.ndarray:
        """Largest batch size that fits, per input length (vectorised eq. 9 / Algorithm 2)."""
        L = np.asarray(L, dtype=np.int64)
        mem = self.memory
        if isinstance(mem, KVMemory):
            tokens = (L + S).astype(np.float64)
            if np.isinf(mem.m_avail):
                return np.full(L.shape, UNBOUNDED, dtype=np.int64)
            with np.errstate(divide="ignore"):
                out = np.floor(mem.zeta * mem.m_avail / (mem.delta * tokens))
            out = np.where(tokens > 0, out, UNBOUNDED)
            return np.clip(out, 0, UNBOUNDED).astype(np.int64)
        return np.fromiter((mem.max_batch(int(x), S) for x in L), dtype=np.int64, count=L.size)

    # ----------------------------------------------------------------- KV reuse (CachedCost)

    @property
    def kv_bytes_per_token(self) -> int:
        """Δ, bytes of KV per token."""
        return self.memory.delta if isinstance(self.memory, KVMemory) else self.delta

    @property
    def device_kv_bytes(self) -> float:
        """KV bytes a worker's device may hold: ζ · M_ava, or the rule table's token budget · Δ."""
        mem = self.memory
        if isinstance(mem, KVMemory):
            return mem.zeta * mem.m_avail
        return float(mem.token_budget(self.max_total) * self.delta)

    @property
    def kv_page_tokens(self) -> int:
        """KV page in tokens: a profile knows no engine's paging, so whole tokens."""
        return 1

    @property
    def retain_bytes(self) -> float:
        """KV bytes one worker can hold for the requests it serves: device plus host memory."""
        host = self.host_kv_bytes if self.host_link else 0.0
        return self.device_kv_bytes + host

    def t_serve_cached(self, n: int, past: int, new: int, slice_len: int) -> float:
        """A batch holding ``past`` positions of KV per row and prefilling ``new`` more."""
        return self.estimator.t_serve_cached(n, past, new, slice_len)

    def linear_terms_cached(
        self, past: np.ndarray, new: np.ndarray, S: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(a, b)`` per (held, new) pair with ``t_serve_cached(n, past, new, S) = a·n + b``."""
        return self.estimator.linear_terms_cached(
            np.asarray(past, dtype=np.float64), np.asarray(new, dtype=np.float64), S
        )

    def copy_s(self, nbytes: float) -> float:
        """Seconds to bring ``nbytes`` of retained KV back from host memory (0 without a host tier)."""
        return nbytes / self.host_link if self.host_link else 0.0


@dataclass(frozen=True)
class Profile:
    """What the scheduler needs to know about one kind of worker."""

    name: str
    engine: str
    model: str
    device: str
    estimator: Estimator
    kv_bytes_per_token: int
    mem_available: float
    source: str = "measured"
    """``measured`` (worker/profile.py), ``derived`` (public facts) or ``design-table``."""
    rmse: dict[str, float] = field(default_factory=dict)
    rules: RuleTable | None = None
    """A profiled rule table replaces the KV model as the memory predicate (DeepSpeed)."""
    gamma_s: float | None = None
    """Recommended minimal scheduling interval Γ for this worker kind, seconds."""
    slice_len: int | None = None
    """Slice length the profile was validated at (the batch RMSE's S)."""
    host_link_bytes_per_s: float | None = None
    """Device-host link bandwidth, bytes/s: retained KV that does not fit beside the running
    batch waits in host memory and comes back over it (None: no host tier, e.g. a CPU)."""
    host_kv_bytes: float | None = None
    """Host memory one worker may keep retained KV in, bytes (with a host link)."""
    samples: dict[str, list[list[float]]] = field(default_factory=dict)
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def cost(
        self, zeta: float = 0.9, mem_available: float | None = None, max_total: int = 2048
    ) -> ProfileCost:
        """The cost model for the scheduler.

        ``mem_available`` overrides the profile's M_ava (a worker reports its
        own at register); ``zeta`` is the KV model's safety factor. Profiles
        with a rule table ignore both: the table is the memory predicate
        (``max_total``, the longest input + generation, bounds its token budget).
        """
        mem: KVMemory | RuleTable
        if self.rules is not None:
            mem = self.rules
        else:
            m = self.mem_available if mem_available is None else mem_available
            mem = KVMemory(self.kv_bytes_per_token, m, zeta)
        return ProfileCost(
            self.estimator,
            mem,
            delta=self.kv_bytes_per_token,
            host_link=self.host_link_bytes_per_s,
            host_kv_bytes=self.host_kv_bytes or 0.0,
            max_total=max_total,
        )

    # ----------------------------------------------------------------- (de)serialise

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (also what a worker sends in ``Register.profile``)."""
        d: dict[str, Any] = {
            "name": self.name,
            "engine": self.engine,
            "model": self.model,
            "device": self.device,
            "source": self.source,
            "coefficients": self.estimator.to_dict(),
            "rmse": dict(self.rmse),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "mem_available": self.mem_available,
            "rules": self.rules.to_list() if self.rules is not None else None,
            "gamma_s": self.gamma_s,
            "slice_len": self.slice_len,
            "host_link_bytes_per_s": self.host_link_bytes_per_s,
            "host_kv_bytes": self.host_kv_bytes,
            "notes": self.notes,
        }
        if self.extra:
            d["extra"] = dict(self.extra)
        d["samples"] = {k: [list(s) for s in v] for k, v in self.samples.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        """Inverse of :meth:`to_dict`; raises ValueError naming a missing or bad key."""
        try:
            rules = d.get("rules")
            return cls(
                name=str(d.get("name", "")),
                engine=str(d["engine"]),
                model=str(d["model"]),
                device=str(d.get("device", "")),
                estimator=Estimator.from_dict(d["coefficients"]),
                kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                mem_available=float(d["mem_available"]),
                source=str(d.get("source", "measured")),
                rmse={k: float(v) for k, v in (d.get("rmse") or {}).items()},
                rules=RuleTable(rules) if rules else None,
                gamma_s=None if d.get("gamma_s") is None else float(d["gamma_s"]),
                slice_len=None if d.get("slice_len") is None else int(d["slice_len"]),
                host_link_bytes_per_s=_opt_float(d, "host_link_bytes_per_s"),
                host_kv_bytes=_opt_float(d, "host_kv_bytes"),
                samples={k: [list(map(float, s)) for s in v] for k, v in (d.get("samples") or {}).items()},
                notes=str(d.get("notes", "")),
                extra=dict(d.get("extra") or {}),
            )
        except KeyError as exc:
            raise ValueError(f"profile lacks key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad profile: {exc}") from None


def _opt_float(d: dict[str, Any], key: str) -> float | None:
    """``d[key]`` as a positive float, None when absent or null."""
    v = d.get(key)
    if v is None:
        return None
    f = float(v)
    if not f > 0:
        raise ValueError(f"{key} must be > 0, got {v!r}")
    return f


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped in the package."""
    root = _builtin_dir()
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> Profile:
    """Load a built-in profile by name (e.g. ``a100-llama2-13b-hf``) or a JSON file by path."""
    s = str(name_or_path)
    if s in builtin_profiles():
        text = _builtin_dir().joinpath(s + ".json").read_text()
    else:
        p = Path(s).expanduser()
        if not p.is_file():
            raise ValueError(
                f"no profile {s!r}: not a file and not one of {', '.join(builtin_profiles())}"
            )
        text = p.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {s!r} is not valid JSON: {exc}") from None
    return Profile.from_dict(data)


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write a profile as indented JSON (samples one per line, to keep diffs readable)."""
    d = profile.to_dict()
    samples = d.pop("samples")
    body = json.dumps(d, indent=2)[:-2]  # reopen the object to append samples compactly
    parts = []
    for key, rows in samples.items():
        lines = ",\n      ".join(json.dumps(r) for r in rows)
        parts.append(f'    "{key}": [\n      {lines}\n    ]' if rows else f'    "{key}": []')
    inner = "{\n" + ",\n".join(parts) + "\n  }" if parts else "{}"
    body += ',\n  "samples": ' + inner + "\n}\n"
    json.loads(body)  # never write a file we could not read back
    Path(path).write_text(body)
