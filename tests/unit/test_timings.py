from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from pytest_forkd.errors import ConfigError
from pytest_forkd.latency import timings
from pytest_forkd.latency.timings import Recorder, Sample


def test_sample_round_trips_through_json_safe_dict():
    sample = Sample(
        op=timings.OP_BRANCH_PAUSE,
        ms=12.5,
        test="tests/test_x.py::test_y",
        backend="diff",
        memory_mib=256,
        dirty_bytes=4096,
        cold=True,
        extra={"tag": "base", "pages": 3},
    )
    data = json.loads(json.dumps(sample.to_dict()))
    assert Sample.from_dict(data) == sample


def test_sample_extra_is_frozen_and_non_json_values_become_strings():
    sample = Sample(op="fork", ms=1.0, extra={"ram": Path("/dev/shm/vm.ram"), "sizes": (1, float("nan"))})
    assert sample.to_dict()["extra"] == {"ram": "/dev/shm/vm.ram", "sizes": [1, "nan"]}
    with pytest.raises(TypeError):
        sample.extra["new"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"ms": 1.0}, "op"),
        ({"op": "fork", "ms": "fast"}, "ms"),
        ({"op": "fork", "ms": True}, "ms"),
        ({"op": "fork", "ms": 1.0, "memory_mib": "256"}, "memory_mib"),
        ({"op": "fork", "ms": 1.0, "cold": "yes"}, "cold"),
        ({"op": "fork", "ms": 1.0, "extra": [1]}, "extra"),
    ],
)
def test_sample_from_dict_names_the_bad_field(data, field):
    with pytest.raises(ConfigError, match=rf"^{field}: expected"):
        Sample.from_dict(data)


def test_record_attributes_samples_to_the_running_test():
    recorder = Recorder()
    recorder.record("boot", 2000.0)
    with recorder.running_test("tests/test_a.py::test_one"):
        assert recorder.current_test == "tests/test_a.py::test_one"
        recorder.record("fork", 150.0, backend="full")
        recorder.record("restore", 30.0, test=None)  # session work, explicitly not the test's
    assert recorder.current_test is None
    tests = [s.test for s in recorder.samples()]
    assert tests == [None, "tests/test_a.py::test_one", None]


def test_running_test_restores_the_previous_test_even_on_error():
    recorder = Recorder()
    with recorder.running_test("outer"):
        with pytest.raises(RuntimeError), recorder.running_test("inner"):
            raise RuntimeError("boom")
        assert recorder.current_test == "outer"
    assert recorder.current_test is None


def test_samples_from_threads_started_in_a_test_belong_to_that_test():
    recorder = Recorder()
    with recorder.running_test("tests/test_a.py::test_concurrent"):
        threads = [
            threading.Thread(target=lambda: [recorder.record("fork", 1.0) for _ in range(200)]) for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    samples = recorder.samples()
    assert len(samples) == 1600
    assert {s.test for s in samples} == {"tests/test_a.py::test_concurrent"}


def test_by_op_groups_in_order_of_first_appearance():
    recorder = Recorder()
    for op in ("exec", "fork", "exec"):
        recorder.record(op, 1.0)
    assert {op: len(group) for op, group in recorder.by_op().items()} == {"exec": 2, "fork": 1}
    assert list(recorder.by_op()) == ["exec", "fork"]


def test_worker_samples_merge_through_json():
    worker = Recorder()
    with worker.running_test("t::w"):
        worker.record("fork", 10.0, backend="uffd", extra={"k": [1, 2]})
    controller = Recorder()
    controller.record("boot", 1.0)
    controller.extend(Recorder.from_json(worker.to_json()).samples())
    assert [s.op for s in controller.samples()] == ["boot", "fork"]
    assert controller.samples()[1] == worker.samples()[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"samples": []}', "version 1"),
        ('{"version": 1, "samples": {}}', "'samples' must be a list"),
        ('{"version": 1, "samples": [{"op": "fork", "ms": "x"}]}', r"samples\[0\]: ms: expected a number"),
    ],
)
def test_from_json_rejects_malformed_input(text, message):
    with pytest.raises(ConfigError, match=message):
        Recorder.from_json(text)


def test_known_ops_contain_every_operation_constant():
    assert set(timings.KNOWN_OPS) == {
        timings.OP_FORK,
        timings.OP_BRANCH_PAUSE,
        timings.OP_EXEC_WORKLOAD,
        timings.OP_BRANCH_TOTAL,
        timings.OP_FREEZE,
        timings.OP_RESTORE,
        timings.OP_CHECKPOINT,
        timings.OP_EXEC,
        timings.OP_BOOT,
        timings.OP_MANIFEST,
        timings.OP_CHANGES,
    }


def test_samples_of_a_snapshot_build_are_kept_apart():
    recorder = Recorder()
    with recorder.running_test("t.py::test_a"):
        recorder.record("exec", 2.0)
        with recorder.building("web"):
            recorder.record("exec", 3000.0)  # a set-up command
            recorder.record("fork", 5.0, test="t.py::test_a")  # work that says whose it is stays with it
        recorder.record("exec", 4.0)
    assert [(s.op, s.ms, s.test) for s in recorder.samples()] == [
        ("exec", 2.0, "t.py::test_a"),
        ("fork", 5.0, "t.py::test_a"),
        ("exec", 4.0, "t.py::test_a"),
    ]
    [build] = recorder.build_samples()
    assert (build.op, build.ms, build.test, dict(build.extra)) == ("exec", 3000.0, None, {"snapshot": "web"})


def test_build_samples_travel_with_a_workers_samples():
    worker = Recorder()
    worker.record("exec", 1.0)
    with worker.building("web"):
        worker.record("boot", 2500.0)
    controller = Recorder()
    merged = Recorder.from_json(worker.to_json())
    controller.extend(merged.samples(), merged.build_samples())
    assert [s.op for s in controller.samples()] == ["exec"]
    assert [s.op for s in controller.build_samples()] == ["boot"]
    assert "build_samples" not in json.loads(Recorder([Sample("exec", 1.0)]).to_json())  # the old format, unchanged


def test_budgets_never_see_a_build():
    from pytest_forkd.latency.budgets import budget_from_cli, check

    recorder = Recorder()
    with recorder.building("slow"):
        recorder.record("exec", 3000.0)
    recorder.record("exec", 20.0)
    assert check([budget_from_cli("exec.max=2000")], recorder.samples()) == []
