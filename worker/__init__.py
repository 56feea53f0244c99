"""sclsd worker process: one per GPU (or CPU for development)."""

from __future__ import annotations
