"""Run toolz's own test suite, from its published sdist, with ``pytest --forkd-isolate``.

``python run.py [PYTEST ARGS...]`` (``make example-port``) checks the sdist
in vendor/ against its pinned sha256, unpacks it afresh into a folder of its
own (outside this repository, whose ini files would otherwise be found
first), puts forkd.yaml beside its setup.py and runs ``python -m pytest
--forkd-isolate`` there: every test of toolz runs in its own child VM. Those
two are all that is added to the project. ``--host`` runs the same suite on
the host instead, without forkd, for comparison; ``--into DIR`` unpacks
there (default: ``$TMPDIR/forkd-example-port``); ``--unpack-only`` prints
the project's path and stops.

To port your own project, see the guide "Porting a project's tests"
(docs/guides/porting.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The project's published sdist, as ``pip download --no-deps --no-binary :all: toolz==0.12.1`` saves it.
SDIST = HERE / "vendor" / "toolz-0.12.1.tar.gz"
#: Its sha256, as PyPI lists it: a changed or damaged file stops the run.
SDIST_SHA256 = "ecca342664893f177a13dac0e6b41cbd8ac25a358e5f215316d43e2100224f4d"
#: What is added to the project: the guest image with its test dependencies.
PROJECT_FILE = HERE / "forkd.yaml"


def unpack(into: Path) -> Path:
    """The sdist unpacked afresh under ``into`` (its one top folder, NAME-VERSION), with forkd.yaml added."""
    digest = hashlib.sha256(SDIST.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{SDIST} has sha256 {digest}, not the pinned {SDIST_SHA256}: download it again")
    into.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=into))
    try:
        with tarfile.open(SDIST) as sdist:
            if hasattr(tarfile, "data_filter"):  # Python 3.12, and 3.11.4 on
                sdist.extractall(staging, filter="data")
            else:
                sdist.extractall(staging)
        (unpacked,) = staging.iterdir()
        shutil.copy2(PROJECT_FILE, unpacked / PROJECT_FILE.name)
        project = into / unpacked.name
        shutil.rmtree(project, ignore_errors=True)
        unpacked.rename(project)  # the same path every run: forkd keeps the project's snapshots under it
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return project


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--into", type=Path, default=Path(tempfile.gettempdir()) / "forkd-example-port")
    parser.add_argument("--host", action="store_true", help="run the suite on the host, without forkd")
    parser.add_argument("--unpack-only", action="store_true", help="print the project's path and stop")
    options, pytest_args = parser.parse_known_args(argv)
    project = unpack(options.into.absolute())
    if options.unpack_only:
        print(project)
        return 0
    mode = ["-p", "no:forkd"] if options.host else ["--forkd-isolate"]
    command = [sys.executable, "-m", "pytest", *mode, *pytest_args]
    print(f"cd {project} && {' '.join(command)}", flush=True)
    return subprocess.run(command, cwd=project, env=dict(os.environ)).returncode


if __name__ == "__main__":
    sys.exit(main())
