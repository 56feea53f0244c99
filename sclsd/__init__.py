"""sclsd: an LLM serving daemon with slice-level scheduling (SCLS).

Importing this package is cheap: engines (torch, transformers) and I/O
(zmq, uvloop) are imported only by the modules that need them.
"""

from __future__ import annotations

__version__ = "0.1.0"
