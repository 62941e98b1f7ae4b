"""A cluster on one machine: K storage hosts (agents) and M training hosts (mounts) as network
namespaces on one bridge, each NIC shaped with tc tbf. The code is the tests' harness,
tests/helpers/cluster.py (benches import it; tests never import bench/); this is its command line:

    sudo .venv/bin/python bench/cluster.py up --storage 4 --training 2 --hold   # until Ctrl-C / SIGTERM
    sudo .venv/bin/python bench/cluster.py list                                # what is left of runs (hfc*)
    sudo .venv/bin/python bench/cluster.py cleanup [--prefix hfcXXXX-]         # remove leftovers

`cleanup` without `--prefix` removes what is left of runs whose harness process is gone (after a
SIGKILL): their namespaces, veths, bridge, processes, mounts and folders, found by the `hfc` prefix.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.cluster import main  # noqa: E402  (the harness of tests and benches)

if __name__ == "__main__":
    sys.exit(main())
