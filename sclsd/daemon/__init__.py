"""The sclsd daemon, one module per step of a request's path.

=================  ==========================================================
``sockets``        Unix-socket servers: framing, peer credentials, bounds
``frontend``       client messages to handlers (generate, cancel, ping, admin)
``admission``      validate, tokenize off the loop, bounds; accept or refuse
``requests``       the live-request table: exactly one terminal event each
``rounds``         the scheduling loop (the core scheduler with a real clock)
``dispatch``       Batch -> typed ``batch`` message; acknowledgement, overdue
``transport/``     how messages reach workers (ZeroMQ hub; in-process for tests)
``fleet``          worker membership: register, heartbeat, death, drain
``results``        a worker's result -> deltas, done, re-queues
``supervisor``     local worker processes: spawn, restart, give up
``status``         the typed status snapshot and the status socket
``metrics``        Prometheus exposition
``cost``           the estimator and memory predicate the scheduler uses
``server``         wiring and lifecycle;  ``cli``: the ``sclsd`` command
=================  ==========================================================

Importing this package is cheap; ``sclsd.daemon.server`` pulls in the rest.
"""
