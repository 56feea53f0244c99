"""How the daemon reaches its workers: the :class:`~.base.WorkerTransport` interface, the
ZeroMQ ROUTER that real workers connect to (:mod:`.zmq_router`). The unit tests' in-process
transport (engines in the daemon's own process) lives with them (``tests/unit/inproc.py``).
"""
