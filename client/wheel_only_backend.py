"""The build backend of hintfs-client: setuptools' own, less the sdist.

The wheel's sources are `..`, the repository root (client/pyproject.toml). An sdist cannot hold
files outside its own folder: setuptools would copy the modules beside this file and pack a tree
that does not build. So this backend builds wheels (what `pip install ./client` and `pip wheel`
use) and refuses an sdist in one line."""
from setuptools.build_meta import *  # noqa: F401,F403


def build_sdist(sdist_directory, config_settings=None):
    raise RuntimeError("hintfs-client has no sdist (its modules are the checkout's own): build the wheel, "
                       "pip wheel --no-deps -w dist client/")
