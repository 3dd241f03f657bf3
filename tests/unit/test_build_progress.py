"""Progress of a snapshot build: each step as it starts with the elapsed time, reminders while one runs long."""

from __future__ import annotations

import threading
import time

from pytest_forkd.project import snapshot_builder
from pytest_forkd.project.snapshot_builder import _Clock


def test_each_step_is_announced_with_the_time_since_the_build_started():
    lines: list[str] = []
    clock = _Clock(lines.append, "web")
    with clock.step("setup[1/2] $ true"):
        pass
    with clock.step("setup[2/2] $ make"):
        pass
    assert [line.split(" s: ", 1)[1] for line in lines] == ["setup[1/2] $ true", "setup[2/2] $ make"]
    assert all(line.startswith("forkd: snapshot 'web' +0.") for line in lines), lines


def test_a_long_step_is_reported_again_until_it_ends(monkeypatch):
    interval = 0.02
    monkeypatch.setattr(snapshot_builder, "STILL_RUNNING_S", interval)
    lines: list[str] = []
    clock = _Clock(lines.append, "web")
    threads_before = threading.active_count()
    with clock.step("setup[1/1] $ apt-get install -y jq"):
        # The step lasts until two reminders came ("again"), however busy the machine is.
        deadline = time.monotonic() + 10
        while sum("still running" in line for line in lines) < 2 and time.monotonic() < deadline:
            time.sleep(interval / 4)
    count = len(lines)
    time.sleep(5 * interval)
    assert len(lines) == count, "a reminder came after the step ended"
    reminders = [line for line in lines if "still running" in line]
    assert len(reminders) >= 2 and all(line.endswith(": setup[1/1] $ apt-get install -y jq") for line in reminders)
    assert threading.active_count() == threads_before  # the reminder thread is gone
