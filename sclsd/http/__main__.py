"""``python -m sclsd.http``: the same as ``sclsd-http``."""

from .cli import main

raise SystemExit(main())
