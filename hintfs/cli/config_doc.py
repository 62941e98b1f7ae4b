"""`hintfs config-doc`: print the config reference (docs/config.md)."""
from __future__ import annotations

import sys

from mountconfig.docs import render_config_doc


def add_parser(subparsers) -> None:
    c = subparsers.add_parser("config-doc", help="print the config reference (docs/config.md)")
    c.set_defaults(func=cmd_config_doc)


def cmd_config_doc(args) -> int:
    sys.stdout.write(render_config_doc())
    return 0
