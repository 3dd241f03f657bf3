"""The project whose tests this suite runs in forked VMs: everything to change to port another one.

Besides these constants, forkd.yaml names the project's test dependencies
(``images.pytest.packages``, Debian packages) and its source directory in the
guest (``snapshots.toolz-env.workdir``, the same as ``GUEST_SOURCE``).
"""

from __future__ import annotations

from pathlib import Path

#: The project's published sdist, as ``pip download --no-deps --no-binary :all: toolz==0.12.1`` saves it.
SDIST = Path(__file__).parent / "vendor" / "toolz-0.12.1.tar.gz"
#: Its sha256, as PyPI lists it: a changed or damaged file stops the run.
SDIST_SHA256 = "ecca342664893f177a13dac0e6b41cbd8ac25a358e5f215316d43e2100224f4d"
#: The project's test modules inside the sdist (relative to its top folder): one forked VM each.
TESTS_GLOB = "toolz/tests/test_*.py"
#: Where the source goes in the guest; forkd.yaml makes it the working directory of every command.
GUEST_SOURCE = "/srv/toolz"
#: Left out of the copy: what the guest would rebuild anyway.
EXCLUDE = ("*.pyc", "__pycache__", "*.egg-info")
#: The project's test runner in the guest, run from GUEST_SOURCE (its arguments also go to the warm process).
GUEST_PYTEST = ("python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=")
#: Where the warm pytest process of zygote.py (started in the parent VM) takes its requests in each child.
ZYGOTE_DIR = "/run/pytest-zygote"
