"""``python -m sclsd.daemon``: the same as the ``sclsd`` command."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
