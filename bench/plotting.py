"""matplotlib for the benchmarks' pictures, or None with one line: a table and its JSON never
depend on the plotting library (it comes with `make bench`, not `make setup`)."""
from __future__ import annotations


def pyplot_or_none():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (`make bench` installs it); the table and JSON are complete")
        return None
    return plt
