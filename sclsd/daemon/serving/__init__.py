"""The daemon's serving core: I/O-free, one request table, typed effects.

:class:`~.core.ServingCore` is where a request lives from acceptance to its
terminal event; :mod:`sclsd.daemon.server` is the shell around it (sockets,
the worker transport, the thread pool, the clock). Nothing here imports
asyncio, sockets or ZeroMQ (a test guards it).
"""
