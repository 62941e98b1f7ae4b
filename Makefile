# Every target does its own set-up, so `make demo` and `make test` work on a fresh Debian host as root.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv fio bindfs rclone systemd

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on local disk; a looser spec would download a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/hintfs demo

# The linter and the type checker first (seconds); the tests need root and /dev/fuse.
test: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -ra tests

bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/fuse_throughput.py --quick
	$(PY) bench/restart_storm.py --quick
	$(PY) bench/multimodal_loading.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
