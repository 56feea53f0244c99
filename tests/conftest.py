from __future__ import annotations

from sclsd.defaults import force_offline

# Nothing is ever downloaded: models come from the installed wheel or are built from a
# config. Set before any test imports transformers (it reads the switch at import).
force_offline()
