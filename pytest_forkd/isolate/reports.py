"""An isolated test's reports on the host: the guest's own, read back, and those forkd makes when the guest could not.

The guest's pytest serializes each report with ``pytest_report_to_serializable``
(as pytest-xdist's workers do); the host reads it back with
``pytest_report_from_serializable``, so the terminal, ``--junitxml``,
``--lf``, ``--sw`` and pytest-html see the assertion introspection,
tracebacks, captured output and user properties the test produced, as in a
local run. JSON is not execnet: what pytest keeps in tuples comes back as
lists (a skip's ``longrepr``, which junitxml and the terminal's summary
insist is a tuple; sections; user properties; the location), so
:func:`from_guest` turns them back. The guest's pytest may be older than the
host's (Debian bookworm's 7.2 against 9): its reports have no ``start`` and
``stop``, which the guest's runner adds from the call; anything else the
host's pytest expects and an older one does not send keeps the host's
default. What ``record_xml_attribute`` and ``record_testsuite_property``
wrote in the guest reaches the host's junit XML through
:func:`write_junit_records`. When the test's VM died or ran out of
time, the phases it did not finish get a failed report naming the cause, and
the phases after it an empty one, so every test still reports setup and
teardown. The parent's teardown of a module or the session (done once, in
the parent VM) joins the teardown report of the test after which it ran,
where pytest reports it too.
"""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Final

import pytest

PHASES: Final = ("setup", "call", "teardown")
#: Report section naming the VM a test ran in and what happened to it.
SECTION: Final = "forkd isolation"


def from_guest(config: pytest.Config, item: pytest.Item, data: dict[str, Any]) -> pytest.TestReport:
    """A report the guest serialized, read back as the host's item's own (tuples where pytest keeps tuples)."""
    data = dict(data)
    if isinstance(data.get("longrepr"), list):  # a skip's (path, lineno, reason)
        data["longrepr"] = tuple(data["longrepr"])
    for key in ("sections", "user_properties"):
        if isinstance(data.get(key), list):
            data[key] = [tuple(pair) if isinstance(pair, list) else pair for pair in data[key]]
    report = config.hook.pytest_report_from_serializable(config=config, data=data)
    if not isinstance(report, pytest.TestReport):
        raise TypeError(f"the guest sent a {type(report).__name__} where a test report was expected")
    report.nodeid = item.nodeid
    report.location = item.location
    return report


def write_junit_records(config: pytest.Config, item: pytest.Item, recorded: Mapping[str, Any]) -> None:
    """Write what the guest's ``record_xml_attribute`` and ``record_testsuite_property`` recorded into the
    host's junit XML (nothing without ``--junitxml``, as on the host)."""
    from pytest_forkd.guest.isolate_pytest import junitxml

    xml = junitxml(config)
    if xml is None:
        return
    for _nodeid, name, value in recorded.get("xml_attributes", ()):
        xml.node_reporter(item.nodeid).add_attribute(name, value)
    for name, value in recorded.get("testsuite_properties", ()):
        xml.add_global_property(name, value)


def made_here(
    item: pytest.Item, when: str, outcome: str, longrepr: str | None = None, sections: Sequence[tuple[str, str]] = ()
) -> pytest.TestReport:
    """A report of ``item``'s phase ``when`` that the guest could not make."""
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={name: 1 for name in item.keywords},
        outcome=outcome,  # type: ignore[arg-type]
        longrepr=longrepr,
        when=when,  # type: ignore[arg-type]
        sections=list(sections),
        duration=0.0,
        user_properties=list(item.user_properties),
    )


def completed(item: pytest.Item, reports: list[pytest.TestReport], failure: str | None) -> list[pytest.TestReport]:
    """The reports of a test, completed: the phase it stopped in fails with ``failure``, later phases are empty.

    With no failure the guest's reports are complete as they are.
    """
    if failure is None:
        return reports
    done = {report.when for report in reports}
    stopped = next((phase for phase in PHASES if phase not in done), "teardown")
    if stopped == "call" and any(report.when == "setup" and not report.passed for report in reports):
        stopped = "teardown"  # the call never started: the VM died tearing down
    completed_reports = list(reports)
    if stopped == "teardown" and "teardown" in done:  # nothing left to blame: mark the last report
        completed_reports.append(made_here(item, "teardown", "failed", failure))
        return completed_reports
    completed_reports.append(made_here(item, stopped, "failed", failure))
    if stopped != "teardown":
        completed_reports.append(made_here(item, "teardown", "passed"))
    return completed_reports


def with_parent_teardown(reports: list[pytest.TestReport], parent: pytest.TestReport) -> list[pytest.TestReport]:
    """Join the parent's teardown (of the test's module, or the session) to the test's own teardown report."""
    if parent.passed and not parent.sections:
        return reports
    teardown = next((report for report in reversed(reports) if report.when == "teardown"), None)
    if teardown is None:
        return [*reports, parent]
    teardown.sections = [
        *teardown.sections,
        *((f"{title} (in the parent VM)", text) for title, text in parent.sections),
    ]
    teardown.duration += parent.duration
    if parent.failed:
        if teardown.failed:
            teardown.sections.append(("teardown in the parent VM", parent.longreprtext))
        else:
            teardown.outcome = "failed"
            teardown.longrepr = parent.longrepr
    return reports


def replay_warning(config: pytest.Config, item: pytest.Item, data: dict[str, Any]) -> None:
    """Record a warning the test raised in the guest, as if it had been raised here."""
    name = str(data.get("category", "UserWarning"))
    category = getattr(builtins, name, None) or getattr(pytest, name, None)
    if not (isinstance(category, type) and issubclass(category, Warning)):
        category = UserWarning
    message = warnings.WarningMessage(
        message=category(str(data.get("message", ""))),
        category=category,
        filename=str(data.get("filename", item.path)),
        lineno=int(data.get("lineno") or 0),
    )
    config.hook.pytest_warning_recorded.call_historic(
        kwargs={"warning_message": message, "when": "runtest", "nodeid": item.nodeid, "location": None}
    )
