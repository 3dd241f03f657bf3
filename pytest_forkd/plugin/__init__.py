"""pytest plugin: real microVMs per test at fork() speed (``-p no:forkd`` disables it).

Fixtures
    ``forkd`` (session)
        the :class:`~pytest_forkd.project.session.ForkdSession`: factory, store,
        ``snapshot`` (the parent's current state), ``parent``, ``timings``,
        ``fork(n)``, ``snapshot_for(name)``.
    ``forkd_parent`` (session; one per xdist worker)
        the warm parent VM, restored from the selected snapshot. Prepare it in
        a session fixture (``forkd_parent.exec(...)``): every later child
        starts from its state.
    ``forkd_vm`` (function)
        a fresh copy-on-write child of the parent's current state (or of the
        snapshot the test's ``forkd`` marker names), killed after the test.
    ``forkd_avm`` (function), ``forkd_aparent`` (session)
        ``forkd_vm`` and ``forkd_parent`` as :class:`~pytest_forkd.aio.AsyncVM`
        handles for ``async def`` tests and fixtures (pytest-asyncio or anyio):
        the same VMs, so the same snapshot, pool, timings and report; children
        forked through ``forkd_avm`` are killed after the test.
    ``forkd_checkpoint`` (function)
        ``forkd_checkpoint(vm)`` returns ``vm.checkpoint()``: a context manager
        that rolls back on exit unless ``.keep()``; ``.rollback()``,
        ``.fork(n)``. Children forked from it are killed after the test.
    ``forkd_budget`` (function)
        ``forkd_budget(exec_ms=50, fork_ms=300)``: per-test latency limits,
        like the marker of the same name, set from inside the test.
    ``forkd_trajectory`` (function)
        a :class:`~pytest_forkd.analysis.trajectory.Trajectory` of ``forkd_vm``: run an
        agent's steps with a diff checkpoint every 10, then ``bisect(predicate)``
        to the first bad step. Its checkpoints are deleted after the test.
    ``forkd_sandbox_client`` (function)
        an OpenAI Agents SDK sandbox client whose sessions are children of
        the parent's state, all killed after the test (see
        :mod:`pytest_forkd.plugin.frameworks`; skipped without the SDK).
    ``forkd_inspect_sandbox`` (function)
        a sandbox spec for an Inspect ``Task``: the samples of an eval run in
        the test are children of the parent's state, each killed when its
        sample ends (see :mod:`pytest_forkd.plugin.frameworks_inspect`;
        skipped without Inspect).
    ``forkd_dangerous_checkpoint`` (function)
        for tests marked ``forkd_dangerous``: the checkpoint of ``forkd_vm``
        taken when this fixture is set up (without the fixture it is taken
        right before the test body, and found in
        ``request.node.stash[pytest_forkd.plugin.DANGEROUS_CHECKPOINT]``).

Markers
    ``forkd(snapshot=None, backend=None, memory_mib=None)``, ``forkd_dangerous``,
    ``forkd_budget(fork_ms=..., exec_ms=..., ...)``, ``forkd_isolate(fresh=False, timeout=None)``.

Isolation: ``pytest --forkd-isolate`` (ini ``forkd_isolate``, env
``PYTEST_FORKD_ISOLATE``) runs an existing suite's tests, unchanged, each in
its own child VM of a parent where the suite is collected and its session-
and module-scoped fixtures are set up once (see :mod:`pytest_forkd.isolate.hooks`).

Settings precedence: marker > command line > ``PYTEST_FORKD_*`` > ini
``forkd_*`` > forkd.yaml ``settings:`` > default (see
:mod:`pytest_forkd.project.settings`). A failing test's report gets a section with its
VM's last commands and console tail; ``--forkd-keep-failed`` saves the VM as
snapshot ``failed-<test>``. Every VM keeps a transcript of what it was asked
to do: the report of a failing test shows its tail, ``--forkd-transcript=DIR``
writes one JSON Lines file per test (its path is the junit property
``forkd_transcript`` and, with pytest-html, an extra), and ``assert`` on a
:class:`~pytest_forkd.analysis.changes.Changes` explains the difference.

Latency: every VM operation is timed and attributed to the running test
(work of session-, module- and class-scoped fixtures to no test). A per-test
budget (``forkd_budget`` marker or fixture) fails that test, in its own
report, once its teardown's timings are in; its neighbours are unaffected.
Suite-wide budgets (``--forkd-budget``, forkd.yaml ``budgets:``) are checked
when the run ends; a violation, like a regression found by
``--forkd-compare-fail``, makes the exit status 1
(``pytest.ExitCode.TESTS_FAILED``) and is listed in the terminal summary. A
baseline from another machine, accelerator, backend or QEMU version is
warned about; ``--forkd-compare-strict`` refuses it and fails the run.
Building a snapshot (its set-up commands) is timed apart and never counted
against budgets or baselines: the summary shows it in its own row.
``--forkd-report=PATH`` writes the run as one HTML page (histograms with
the budgets drawn in, the slowest tests, the comparison).

Nothing boots and nothing is probed until a test uses a forkd fixture, and
nothing heavy is imported either: pytest loads this package in every project
that has pytest-forkd installed, so a run that does not use it pays only for
registering the options (see :mod:`pytest_forkd.plugin.state`).

Layout: :mod:`~pytest_forkd.plugin.options` (options, ini keys, markers,
resolving them), :mod:`~pytest_forkd.plugin.state` (the run's state in
``config.stash``), :mod:`~pytest_forkd.plugin.fixtures`,
:mod:`~pytest_forkd.plugin.hooks`, :mod:`~pytest_forkd.plugin.report`
(header, failure sections, end-of-run tables, stored runs),
:mod:`~pytest_forkd.plugin.progress` (build progress on the terminal),
:mod:`~pytest_forkd.plugin.html_report` (``--forkd-report``),
:mod:`~pytest_forkd.plugin.xdist` and :mod:`~pytest_forkd.project.session`
(the ``forkd`` fixture's session). This module is the ``pytest11`` entry
point: it re-exports every hook and fixture, so pytest finds them all by
registering this one module, and ``-p no:forkd`` disables all of them.
``--forkd-isolate`` is a package of its own, :mod:`pytest_forkd.isolate`,
whose options and hooks this module registers.

May import: every layer below (foundation, guest, image, engine, storage,
latency, core, project, aio), lazily for anything heavy. Nothing imports it
except pytest.
"""

from __future__ import annotations

from pytest_forkd.plugin.e2b import _forkd_e2b_server, forkd_e2b  # noqa: F401 - fixtures pytest finds here
from pytest_forkd.plugin.fixtures import (
    DANGEROUS_CHECKPOINT,
    OP_FIXTURE_OVERHEAD,
    _forkd_test_vms,
    forkd,
    forkd_aparent,
    forkd_avm,
    forkd_budget,
    forkd_checkpoint,
    forkd_dangerous_checkpoint,
    forkd_parent,
    forkd_trajectory,
    forkd_vm,
)
from pytest_forkd.plugin.frameworks import forkd_sandbox_client
from pytest_forkd.plugin.frameworks_inspect import forkd_inspect_sandbox
from pytest_forkd.plugin.hooks import (
    pytest_assertrepr_compare,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_fixture_setup,
    pytest_runtest_call,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_runtest_protocol_of_budgeted_tests,
    pytest_sessionfinish,
    pytest_unconfigure,
)
from pytest_forkd.plugin.options import DANGEROUS_MARKER_HELP, pytest_addoption
from pytest_forkd.plugin.report import TRANSCRIPT_PROPERTY, pytest_report_header, pytest_terminal_summary
from pytest_forkd.plugin.state import KeptVM

__all__ = [
    "DANGEROUS_CHECKPOINT",
    "DANGEROUS_MARKER_HELP",
    "OP_FIXTURE_OVERHEAD",
    "TRANSCRIPT_PROPERTY",
    "KeptVM",
    "_forkd_test_vms",
    "forkd",
    "forkd_aparent",
    "forkd_avm",
    "forkd_budget",
    "forkd_checkpoint",
    "forkd_dangerous_checkpoint",
    "forkd_inspect_sandbox",
    "forkd_parent",
    "forkd_sandbox_client",
    "forkd_trajectory",
    "forkd_vm",
    "pytest_addoption",
    "pytest_assertrepr_compare",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_fixture_setup",
    "pytest_report_header",
    "pytest_runtest_call",
    "pytest_runtest_makereport",
    "pytest_runtest_protocol",
    "pytest_runtest_protocol_of_budgeted_tests",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
    "pytest_unconfigure",
]
