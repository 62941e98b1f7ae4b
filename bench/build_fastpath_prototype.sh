#!/bin/bash
# The fast-path prototype's pyfuse3 (patches/pyfuse3-fastpath-prototype.patch, docs/fastpath.md) for
# bench/small_files.py's floor_fast system: the patched pyfuse3 source that patches/build-passthrough.sh
# (make setup) left under VENV/libfuse-build, copied, patched again and built into its own folder,
# never into the .venv (mounts keep the pyfuse3 of make setup).
#   bash bench/build_fastpath_prototype.sh [VENV]  ->  VENV/libfuse-build/fastpath  (--fast-pyfuse3 that)
# Idempotent; a failure prints one line and exits 0 (the bench then reports floor_fast as n/a).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$(cd "${1:-.venv}" && pwd)
WORK=$VENV/libfuse-build
OUT=$WORK/fastpath
LOG=$WORK/fastpath.log
[ -d "$OUT/pyfuse3" ] && exit 0
fail() { echo "fast-path prototype not built ($1; log: $LOG): floor_fast is n/a"; exit 0; }
SRC=$(ls -d "$WORK"/pyfuse3-*/ 2>/dev/null | head -1)
[ -n "$SRC" ] || fail "no patched pyfuse3 source under $WORK: run make setup"
rm -rf "$WORK/pyfuse3-fast" && cp -r "$SRC" "$WORK/pyfuse3-fast" && rm -rf "$WORK/pyfuse3-fast/build" \
  "$WORK/pyfuse3-fast/src/pyfuse3/__init__.c" || fail "copy failed"
(cd "$WORK/pyfuse3-fast" && patch -p1 < "$HERE/../patches/pyfuse3-fastpath-prototype.patch") > "$LOG" 2>&1 \
  || fail "the patch does not apply"
PKG_CONFIG_PATH="$VENV/libfuse/lib/pkgconfig" LDFLAGS="-Wl,-rpath,$VENV/libfuse/lib" \
  "$VENV/bin/python" -m pip install -q --no-deps --no-cache-dir --target "$OUT" "$WORK/pyfuse3-fast" >> "$LOG" 2>&1 \
  || { rm -rf "$OUT"; fail "build failed"; }
echo "fast-path prototype built: $OUT"
