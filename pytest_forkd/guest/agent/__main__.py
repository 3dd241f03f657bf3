"""``python3 -m agent PORT_DEVICE`` or ``python3 DIR/agent --stdio``: serve the host (see :func:`server.main`)."""

import sys

if __package__:
    from . import main
else:  # run as a directory: import the package from beside it, where wire.py is too
    import os

    sys.path[0] = os.path.dirname(os.path.abspath(sys.path[0]))
    from agent import main  # type: ignore[import-not-found, no-redef]

sys.exit(main())
