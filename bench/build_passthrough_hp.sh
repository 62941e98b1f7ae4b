#!/bin/bash
# libfuse's example/passthrough_hp (C++, multi-threaded, FUSE passthrough), a peer of
# bench/small_files.py, built from the libfuse source that patches/build-passthrough.sh (make setup)
# unpacked under VENV/libfuse-build/src/fuse3, with the meson and ninja of VENV/libfuse-build/tools.
#   bash bench/build_passthrough_hp.sh [VENV]   ->  VENV/libfuse-build/src/fuse3/build-hp/example/passthrough_hp
# Needs a C++17 compiler (Debian: g++). Idempotent; a failure prints one line and exits 0 (the
# bench then reports passthrough_hp as n/a).
set -u
VENV=$(cd "${1:-.venv}" && pwd)
SRC=$VENV/libfuse-build/src/fuse3
OUT=$SRC/build-hp/example/passthrough_hp
LOG=$VENV/libfuse-build/passthrough_hp.log
[ -x "$OUT" ] && exit 0
fail() { echo "passthrough_hp not built ($1; log: $LOG): bench/small_files.py reports it as n/a"; exit 0; }
[ -f "$SRC/example/passthrough_hp.cc" ] || fail "no libfuse source under $SRC: run make setup"
command -v c++ >/dev/null || fail "no C++ compiler (apt-get install g++)"
export PATH="$VENV/libfuse-build/tools/bin:$PATH"
command -v meson >/dev/null && command -v ninja >/dev/null || fail "no meson/ninja in $VENV/libfuse-build/tools"
(cd "$SRC" && rm -rf build-hp && meson setup build-hp --buildtype=release -Dexamples=true -Dutils=false \
   -Dtests=false -Ddisable-mtab=true -Duseroot=false -Dudevrulesdir="$SRC/build-hp/udev" -Dinitscriptdir= \
   && ninja -C build-hp example/passthrough_hp) > "$LOG" 2>&1 || fail "meson/ninja failed"
[ -x "$OUT" ] || fail "no binary after the build"
echo "passthrough_hp built: $OUT"
