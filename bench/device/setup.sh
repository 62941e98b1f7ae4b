# Sourced on the lent accelerator machine from the repo root (bench/device/pack.sh made .devtools):
# builds there, into /tmp, what `make setup` builds here, from the carried sources and wheels.
set -e
DT=$PWD/.devtools
mkdir -p /tmp/dt/bin
for t in ip tc; do
  printf '#!/bin/sh\nexec /lib64/ld-linux-x86-64.so.2 --library-path %s/lib %s/bin/%s.real "$@"\n' "$DT" "$DT" "$t" > /tmp/dt/bin/$t
  chmod +x /tmp/dt/bin/$t
done
cp $DT/bin/fusermount3 /tmp/dt/bin/ && chmod 4755 /tmp/dt/bin/fusermount3
export PATH=/tmp/dt/bin:$PATH
(cd $DT/fuse3 && meson setup /tmp/fb --prefix=/tmp/libfuse --libdir=lib --buildtype=release -Dexamples=false -Dutils=false -Dtests=false -Ddisable-mtab=true -Duseroot=false -Dudevrulesdir=/tmp/libfuse/udev -Dinitscriptdir= >/tmp/fb.log 2>&1 && ninja -C /tmp/fb install >>/tmp/fb.log 2>&1) || { tail -30 /tmp/fb.log; exit 1; }
# Into the interpreter's own site-packages, not PYTHONPATH: daemons run `python -I` (hintfs/cli),
# which ignores PYTHONPATH; a .pth file there names the repo, as the editable install does here.
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir $DT/whl/*.whl
echo "$PWD" > $SITE/hintfs-repo.pth
mkdir -p $SITE/pyfuse3
S=$DT/pyfuse3src
cp $S/pyfuse3/_pyfuse3.py $S/pyfuse3/asyncio.py $S/pyfuse3/__init__.pyi $S/pyfuse3/py.typed $SITE/pyfuse3/
PYINC=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
ls $PYINC/Python.h
gcc -shared -fPIC -O2 -I$S/pyfuse3 -I$S/Include -I/tmp/libfuse/include/fuse3 -I$PYINC -DFUSE_USE_VERSION=32 \
  $S/pyfuse3/__init__.c -o $SITE/pyfuse3/__init__$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') \
  -L/tmp/libfuse/lib -lfuse3 -lpthread -lrt -Wl,-rpath,/tmp/libfuse/lib
python3 -c 'import pyfuse3, hintfs.cli, trio, pydantic; print("pyfuse3 passthrough", pyfuse3.passthrough_supported())'
python3 -c 'from tests.helpers.cluster import missing_features; print("cluster:", missing_features() or "ok")'
if [ -f $DT/juicefs.xz ]; then   # (pack.sh with S3=1) the S3 gateway, and `hintfs` beside python3 as pip would put it
  xz -dc $DT/juicefs.xz > /tmp/dt/bin/juicefs && chmod +x /tmp/dt/bin/juicefs
  PY=$(python3 -c 'import sys; print(sys.executable)')
  printf '#!/bin/sh\nexec %s -m hintfs.cli "$@"\n' "$PY" > "$(dirname "$PY")/hintfs" && chmod +x "$(dirname "$PY")/hintfs"
fi
