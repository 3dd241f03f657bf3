"""Hostile images end to end, as a user meets them: ``forkd exec --image`` on an image from the real registry.

No VM starts: the image is refused while its disk is built, after the real
skopeo pulled it. What is asserted of time and memory is loose (the figures
are scripts/hostile_layer_costs.py's, in docs/guides/container-images.md):
the sparse-map layer that cost 962 MiB and a minute before must be refused
within 60 s by a process that peaks at 300 MiB or less.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import hostile_layers
import pytest
from oci_images import LayerTar, push, write_layout
from registry import Registry, needs_registry
from support import USER_CACHE

pytestmark = [pytest.mark.slow, needs_registry]

#: ``forkd exec`` in-process, its own peak RSS printed last on stderr: ``VmHWM`` (KiB), not ``ru_maxrss``, which
#: after a fork and exec also counts the parent's (pytest's) peak.
EXEC = r"""
import json, sys
from pytest_forkd.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
peak = int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])
print(json.dumps({"status": status, "peak_kib": peak}), file=sys.stderr)
"""


def forkd_exec(reference: str, cache: Path) -> tuple[int, str, float, float]:
    """(exit status, what it printed on stderr, seconds, peak RSS in MiB) of ``forkd exec --image REF -- true``.

    ``cache`` gets an image store of its own and the user's guest images (the default image a container image
    boots with, built once by setup), so nothing hostile lands in the user's store and nothing is built here.
    """
    cache.mkdir(exist_ok=True)
    for shared in ("images", "debs"):
        if (USER_CACHE / shared).is_dir():
            (cache / shared).symlink_to(USER_CACHE / shared)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", EXEC, "exec", "--image", reference, "--", "true"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "FORKD_CACHE_DIR": str(cache)},
    )
    seconds = time.monotonic() - started
    *said, last = result.stderr.strip().splitlines()
    figures = json.loads(last)
    return int(figures["status"]), "\n".join(said), seconds, figures["peak_kib"] / 1024


def test_a_sparse_map_layer_is_refused_quickly_by_a_small_process(registry: Registry, tmp_path: Path) -> None:
    """Done-when of the issue: a 0.5 MiB layer with one 240,000-block sparse entry, refused within 60 s, naming
    the entry, by a ``forkd exec --image`` that peaks at 300 MiB or less (it took 962 MiB and blamed the cache)."""
    layer = hostile_layers.old_gnu_sparse(240_000)
    written = write_layout(tmp_path / "layout", [(LayerTar().file("ok", "ok"), "gzip"), (layer, "gzip")], tag="1")
    reference = registry.reference("hostile/sparse:1")
    push(written, reference)
    status, said, seconds, peak_mib = forkd_exec(reference, tmp_path / "cache")
    assert status == 1, said  # a failure (the image), not a usage error
    assert f"entry '{hostile_layers.SPARSE_NAME}' is a GNU sparse file" in said and "Traceback" not in said, said
    assert seconds < 60 and peak_mib <= 300, (seconds, peak_mib)
    assert not any((tmp_path / "cache" / "oci" / "disks").glob("*.ext4"))


def test_a_layer_writing_through_a_symlink_that_leaves_the_root_is_refused_and_named(
    registry: Registry, tmp_path: Path
) -> None:
    lower = LayerTar().dir("usr/lib").symlink("lib", "usr/lib").symlink("escape", "../../../etc")
    upper = LayerTar().file("lib/fine.txt", "in usr/lib").file("escape/forkd-pwned", "outside")
    written = write_layout(tmp_path / "layout", [(lower, "gzip"), (upper, "gzip")], tag="1")
    reference = registry.reference("hostile/escape:1")
    push(written, reference)
    status, said, _seconds, _peak = forkd_exec(reference, tmp_path / "cache")
    assert status == 1, said
    assert (
        "entry 'escape/forkd-pwned' would be written through the symlink 'escape' -> '../../../etc', which leads "
        "out of the image root; the image is refused"
    ) in said
    assert not Path("/etc/forkd-pwned").exists()
