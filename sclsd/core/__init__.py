"""Pure scheduling policy: no asyncio, zmq, torch or clock imports.

Time is always passed in as an argument, so the daemon (real clock, real
workers) and the simulator (virtual clock, cost-model workers) drive the very
same objects.
"""

from __future__ import annotations
