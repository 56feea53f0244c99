"""What the load balancers in front of several boxes read from each one, answered from the
daemon's own figures (its status snapshot), in the shapes those balancers parse.

* ``GET /get_load``: ``{"load": N, ...}``. vllm-router's ``power_of_two`` polls it (every
  ``--worker-startup-check-interval`` seconds) and reads the integer ``load``, which it
  adds to the requests it has in flight to that box itself; so ``load`` counts requests:
  those in the box's table (waiting for a worker or started) and those being admitted.
  The other fields are SGLang's names for the same figures, for people and monitors.
  sglang-router 0.3.2 expects SGLang's own answer here, a list of one such object per
  data-parallel rank; one JSON answer cannot be both, and vllm-router's is served.
* ``GET /server_info`` (``/get_server_info``) and ``GET /model_info``
  (``/get_model_info``): SGLang's shapes, read by sglang-router when it adds a box: the
  model's served name (which it groups boxes by), one data-parallel rank, the limits.

None of them needs the API key (as ``/health`` and ``/metrics``): a balancer polls them
without one.
"""

from __future__ import annotations

from typing import Any

from .. import __version__
from ..protocol import StatusSnapshot


def load(st: StatusSnapshot) -> dict[str, Any]:
    """``/get_load``: requests in the box, and SGLang's names for its parts."""
    return {"load": st.live_requests + st.admitting,
            "num_reqs": st.started_requests, "num_waiting_reqs": st.waiting_requests + st.admitting,
            "num_tokens": st.queued_tokens, "kv_cache_usage": round(st.kv_cache_usage, 4)}


def server_info(st: StatusSnapshot, name: str, max_model_len: int | None) -> dict[str, Any]:
    """``/server_info``: SGLang's ``get_server_info`` fields that have a meaning here."""
    active = sum(w.state == "active" for w in st.workers)
    return {"model_id": name, "model_path": name, "served_model_name": name, "version": __version__,
            "dp_size": 1, "tp_size": 1, "context_length": max_model_len,
            "max_queued_requests": st.limits.max_queued_requests,
            "max_queued_tokens": st.limits.max_queued_tokens,
            "max_input_tokens": st.limits.max_input or None,
            "scheduler": {"policy": st.policy, "slice_len": st.slice_len},
            "workers": active, "expected_workers": st.expected_workers,
            "serving": st.serving and not st.draining}


def model_info(name: str) -> dict[str, Any]:
    """``/model_info``: SGLang's ``get_model_info`` (a text-generation model, by its served
    name: the box's files are its own business)."""
    return {"model_path": name, "tokenizer_path": name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False}
