"""The sclsd daemon: an I/O-free serving core in a shell of sockets, transport and clock.

=================  ==========================================================
``serving/``       the serving core: the request table, replies (one terminal
                   event each), membership, dispatch, streamed tokens,
                   results; entry points return typed effects
``server``         the shell: feeds the core, delivers its effects; lifecycle
``sockets``        Unix-socket servers: framing, peer credentials, bounds
``frontend``       client messages to handlers (generate, cancel, ping, admin)
``admission``      validate, tokenize off the loop, bounds; accept or refuse
``fleet``          transport peers <-> worker ids; who may register
``transport/``     how messages reach workers (ZeroMQ ROUTER; in-process for tests)
``supervisor``     local worker processes: spawn, restart, give up
``status``         the typed status snapshot and the status socket
``metrics``        Prometheus exposition
``cost``           the estimator and memory predicate the scheduler uses
``drain``          stop accepting, finish what is in flight, stop
``signals``        signal handlers, restored on the way out
``cli``            the ``sclsd`` command
=================  ==========================================================

Importing this package is cheap; ``sclsd.daemon.server`` pulls in the rest.
"""
