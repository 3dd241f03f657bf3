"""``python -m pytest_forkd.cli``: the ``forkd`` command without its console script."""

import sys

from pytest_forkd.cli import main

sys.exit(main())
