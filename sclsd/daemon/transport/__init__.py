"""How the daemon reaches its workers: the :class:`~.base.WorkerTransport` interface, the
ZeroMQ ROUTER that real workers connect to (:mod:`.zmq_router`), and an in-process
transport that runs engines in the daemon's own process for unit tests (:mod:`.inproc`).
"""
