"""Progress lines (image and snapshot builds) on pytest's terminal, never inside its progress line.

A build takes seconds to minutes under TCG, so the user is told what runs
(each set-up command as it starts, with the time since the build started)
while tests are running, and each line is flushed at once (a CI job's
log is a pipe, which Python buffers). pytest is meanwhile writing its own
progress line (``test_a.py ..`` or, with ``-q``, bare dots, then ``[ 40%]``): a line
written straight to the terminal would land in the middle of it. So each
line goes through the terminal reporter, on a line of its own, with
output capture suspended; before pytest's next dot, the file name it was
printing dots after is written again (:class:`PrefixRestorer`), so the dots
that follow still sit behind their file.

Under pytest-xdist a worker has no terminal (what it writes never reaches
the user): workers print nothing, and the controller's end-of-run summary
lists each worker's builds and their durations.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import Final

import pytest

#: Progress lines were written since pytest last wrote its file prefix.
PREFIX_PENDING: Final = pytest.StashKey[bool]()


def progress_printer(config: pytest.Config) -> Callable[[str], None]:
    """A ``progress(line)`` callable that writes ``line`` on pytest's terminal (nothing on an xdist worker)."""
    if getattr(config, "workerinput", None) is not None:
        return _quiet

    def show(line: str) -> None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        capture = config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
            _write_apart(config, reporter, line)

    return show


def _quiet(line: str) -> None:
    """Progress on an xdist worker: it has no terminal to write to."""


def _write_apart(config: pytest.Config, reporter: pytest.TerminalReporter, line: str) -> None:
    """Write ``line`` on a line of its own; pytest's file prefix is put back before its next dot."""
    writer = getattr(reporter, "_tw", None)  # pytest's TerminalWriter: knows where the cursor is
    column: int = getattr(writer, "width_of_current_line", 0) if writer is not None else 0
    if column:
        reporter.write("\n")
    reporter.currentfspath = None  # pytest writes its file prefix again (verbose mode)
    reporter.write_line(line)
    reporter.flush()  # seen as it happens in a CI log too, where stdout is a buffered pipe
    config.stash[PREFIX_PENDING] = True


class PrefixRestorer:
    """Puts pytest's file prefix back before the first dot written after progress lines.

    Without ``-v`` pytest writes a test's dot right after the file name it
    wrote when the file's first test started; after progress lines the dot
    would start a bare line. Registered in ``pytest_configure``; runs before
    the terminal reporter writes the dot.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.config.stash.get(PREFIX_PENDING, False):
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or not reporter.showfspath or reporter.showlongtestinfo:
            return
        status = self.config.hook.pytest_report_teststatus(report=report, config=self.config)
        if not status[1]:  # a passed setup or teardown writes nothing
            return
        self.config.stash[PREFIX_PENDING] = False
        path = self.config.rootpath / report.nodeid.split("::")[0]
        reporter.write(os.path.relpath(path, reporter.startpath) + " ")
        reporter.currentfspath = path  # what write_fspath_result compares with
