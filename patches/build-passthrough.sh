#!/bin/bash
# FUSE passthrough libraries for the .venv (run by `make passthrough-libs`, part of `make setup`):
#   1. libfuse 3.17.x from Debian's own source package of the trixie suite (`apt-get source`, with
#      a deb-src entry derived from this machine's apt sources, in a private apt state: nothing in
#      /etc/apt changes), built with meson and ninja from PyPI into VENV/libfuse;
#   2. pyfuse3 from its PyPI sdist with patches/pyfuse3-passthrough.patch,
#      patches/pyfuse3-queued-reads.patch, patches/pyfuse3-readdir.patch,
#      patches/pyfuse3-fastpath.patch, patches/pyfuse3-readdir-names.patch,
#      patches/pyfuse3-read-reply-nogil.patch (a read's reply copies without the GIL) and
#      patches/pyfuse3-fastlookup.patch (lookups of kept folders' names in C) and
#      patches/pyfuse3-statdir.patch (a folder's entries with their statx, for listings on the
#      event loop) and patches/pyfuse3-spin-nogil.patch (the loop's spin for the next request
#      without the GIL) and patches/pyfuse3-fastverify.patch (the fast path's close-to-open check
#      for paths not declared immutable) and patches/pyfuse3-fastlazy.patch (marks made before
#      any open, opened by pyfuse3 at the first), linked against it (rpath).
# Idempotent (a stamp keyed by this script and the patches). Any failure leaves the stock pyfuse3 in
# place, prints one line and exits 0: hintfs then runs without passthrough.
set -u
VENV=${1:-.venv}
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$(cd "$VENV" && pwd)
PY=$VENV/bin/python
PREFIX=$VENV/libfuse
WORK=$VENV/libfuse-build
STAMP=$VENV/.passthrough-done
LOG=$WORK/build.log
SUITE=${PASSTHROUGH_SUITE:-trixie}
PATCHES="pyfuse3-passthrough.patch pyfuse3-queued-reads.patch pyfuse3-readdir.patch pyfuse3-fastpath.patch pyfuse3-readdir-names.patch pyfuse3-read-reply-nogil.patch pyfuse3-fastlookup.patch pyfuse3-statdir.patch pyfuse3-spin-nogil.patch pyfuse3-fastverify.patch pyfuse3-fastlazy.patch"
KEY=$( (cat "$0" && cd "$HERE" && cat $PATCHES) | sha256sum | cut -c1-16)

if [ -f "$STAMP" ] && [ "$(head -1 "$STAMP")" = "$KEY" ]; then
  if [ "$(sed -n 2p "$STAMP")" = ok ] && "$PY" -c 'import pyfuse3, sys; sys.exit(not pyfuse3.passthrough_supported())' 2>/dev/null; then
    exit 0
  fi
  if [ "$(sed -n 2p "$STAMP")" != ok ]; then
    echo "hintfs: FUSE passthrough unavailable ($(sed -n 3p "$STAMP")); stock pyfuse3 in use (rm $STAMP to retry)"
    exit 0
  fi
fi

rm -rf "$WORK" && mkdir -p "$WORK"
fail() {
  # Never leave a half-installed pyfuse3 behind: the stock wheel again.
  if ! "$PY" -c 'import pyfuse3' 2>/dev/null || "$PY" -c 'import pyfuse3, sys; sys.exit(not pyfuse3.passthrough_supported())' 2>/dev/null; then
    "$PY" -m pip install -q --force-reinstall --no-deps "pyfuse3==$PYFUSE3_VERSION" >>"$LOG" 2>&1
  fi
  printf '%s\nfailed\n%s\n' "$KEY" "$1" > "$STAMP"
  echo "hintfs: FUSE passthrough unavailable ($1; log: $LOG); stock pyfuse3 in use"
  exit 0
}
PYFUSE3_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("pyfuse3"))' 2>/dev/null) || PYFUSE3_VERSION=3.5.0

# 1. The suite's source index, in a private apt state, from this machine's Debian archive URIs.
command -v apt-get >/dev/null && command -v dpkg-source >/dev/null || fail "no apt-get/dpkg-source"
mkdir -p "$WORK/apt/sources" "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/src"
python3 - "$SUITE" > "$WORK/apt/sources/$SUITE-src.sources" <<'PYEOF' || fail "no Debian archive in the apt sources"
import glob, re, sys
suite = sys.argv[1]
codename = dict(l.rstrip().split("=", 1) for l in open("/etc/os-release") if "=" in l).get("VERSION_CODENAME", "").strip('"')
found = []   # (uri, signed_by) of the entries that carry the release's own suite (not -security etc.)
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        f = {}
        for line in stanza.splitlines():
            if line and not line.startswith("#") and ":" in line and not line[0].isspace():
                k, v = line.split(":", 1)
                f[k.strip().lower()] = v.strip()
        if f.get("enabled", "yes") == "no" or "deb" not in f.get("types", "").split():
            continue
        if codename in f.get("suites", "").split() and "main" in f.get("components", "").split():
            for uri in f.get("uris", "").split():
                found.append((uri, f.get("signed-by", "")))
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"\s*deb\s+(\[([^]]*)\]\s+)?(\S+)\s+(\S+)\s+(.*)", line)
        if m and m.group(4) == codename and "main" in m.group(5).split():
            opts = dict(o.split("=", 1) for o in (m.group(2) or "").split() if "=" in o)
            found.append((m.group(3), opts.get("signed-by", "")))
if not found:
    sys.exit(1)
uris = list(dict.fromkeys(u for u, _ in found))
signed = next((s for _, s in found if s), "/usr/share/keyrings/debian-archive-keyring.gpg")
print(f"Types: deb-src\nURIs: {' '.join(uris)}\nSuites: {suite}\nComponents: main\nSigned-By: {signed}")
PYEOF
APT=(apt-get -q -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$WORK/apt/sources"
     -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache" -o Debug::NoLocking=1
     -o APT::Sandbox::User=root)
timeout 300 "${APT[@]}" update >>"$LOG" 2>&1 || fail "apt-get update for deb-src $SUITE failed"
(cd "$WORK/src" && timeout 300 "${APT[@]}" source --download-only fuse3) >>"$LOG" 2>&1 \
  || fail "apt-get source fuse3 from $SUITE failed"
DSC=$(ls "$WORK"/src/fuse3_3.17*.dsc 2>/dev/null | head -1)
[ -n "$DSC" ] || fail "$SUITE has no fuse3 3.17.x source"
dpkg-source -x "$DSC" "$WORK/src/fuse3" >>"$LOG" 2>&1 || fail "dpkg-source -x failed"

# 2. libfuse with meson and ninja from PyPI (in a tool venv of their own).
python3 -m venv "$WORK/tools" >>"$LOG" 2>&1 && "$WORK/tools/bin/pip" install -q meson ninja >>"$LOG" 2>&1 \
  || fail "pip install meson ninja failed"
export PATH="$WORK/tools/bin:$PATH"
(cd "$WORK/src/fuse3" && meson setup build --prefix="$PREFIX" --libdir=lib --buildtype=release \
   -Dexamples=false -Dutils=false -Dtests=false -Ddisable-mtab=true -Duseroot=false \
   -Dudevrulesdir="$PREFIX/udev" -Dinitscriptdir= && ninja -C build && ninja -C build install) >>"$LOG" 2>&1 \
  || fail "libfuse build failed"

# 3. pyfuse3 from its sdist, patched, linked against that libfuse.
(cd "$WORK" && "$PY" -m pip download -q --no-deps --no-binary pyfuse3 "pyfuse3==$PYFUSE3_VERSION" -d sdist) >>"$LOG" 2>&1 \
  || fail "pip download pyfuse3 sdist failed"
tar xzf "$WORK"/sdist/pyfuse3-*.tar.gz -C "$WORK" || fail "pyfuse3 sdist unpack failed"
SRC=$(ls -d "$WORK"/pyfuse3-*/ | head -1)
for P in $PATCHES; do
  (cd "$SRC" && patch -p1 < "$HERE/$P") >>"$LOG" 2>&1 || fail "patches/$P does not apply to pyfuse3 $PYFUSE3_VERSION"
done
rm -f "$SRC"/src/pyfuse3/__init__.c
PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig" LDFLAGS="-Wl,-rpath,$PREFIX/lib" \
  "$PY" -m pip install -q --no-deps --force-reinstall --no-cache-dir "$SRC" >>"$LOG" 2>&1 \
  || fail "patched pyfuse3 build failed"
"$PY" -c 'import pyfuse3, sys; sys.exit(not pyfuse3.passthrough_supported())' >>"$LOG" 2>&1 \
  || fail "patched pyfuse3 does not load"
printf '%s\nok\n' "$KEY" > "$STAMP"
echo "hintfs: FUSE passthrough libraries ready (libfuse $(PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig pkg-config --modversion fuse3) in $PREFIX, patched pyfuse3 $PYFUSE3_VERSION)"
