"""`python -m hintfs.cli ...`: the same as the `hintfs` console script."""
import sys

from hintfs.cli import main

sys.exit(main())
