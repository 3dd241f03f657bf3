from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from pytest_forkd import timings
from pytest_forkd.errors import ConfigError
from pytest_forkd.timings import Recorder, Sample


@pytest.fixture
def fresh_active_recorder():
    recorder = Recorder()
    previous = timings.set_active_recorder(recorder)
    yield recorder
    timings.set_active_recorder(previous)


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
    assert list(recorder.by_test()) == ["tests/test_a.py::test_one"]
    assert [s.op for s in recorder.by_test()["tests/test_a.py::test_one"]] == ["fork"]


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


def test_time_measures_the_block_and_takes_late_fields():
    recorder = Recorder()
    with recorder.running_test("t::x"), recorder.time("branch_pause", backend="diff") as pending:
        time.sleep(0.02)
        pending.update(dirty_bytes=1 << 20)
    (sample,) = recorder.samples()
    assert sample.op == "branch_pause"
    assert 15.0 <= sample.ms < 2000.0
    assert sample.ms == pending.ms
    assert (sample.backend, sample.dirty_bytes, sample.test) == ("diff", 1 << 20, "t::x")


def test_time_keeps_the_test_the_operation_started_in():
    recorder = Recorder()
    with recorder.running_test("t::first"):
        block = recorder.time("fork")
        block.__enter__()
    with recorder.running_test("t::second"):
        block.__exit__(None, None, None)
    assert recorder.samples()[0].test == "t::first"


def test_time_records_nothing_when_the_operation_fails():
    recorder = Recorder()
    with pytest.raises(ValueError), recorder.time("fork"):
        raise ValueError("qemu died")
    assert recorder.samples() == []


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


def test_module_functions_report_to_the_active_recorder(fresh_active_recorder):
    assert timings.active_recorder() is fresh_active_recorder
    timings.record("exec", 0.3, backend="full")
    with timings.time("checkpoint"):
        pass
    assert [s.op for s in fresh_active_recorder.samples()] == ["exec", "checkpoint"]


def test_set_active_recorder_returns_the_previous_one(fresh_active_recorder):
    replacement = Recorder()
    assert timings.set_active_recorder(replacement) is fresh_active_recorder
    timings.record("fork", 1.0)
    assert len(replacement.samples()) == 1
    assert fresh_active_recorder.samples() == []


def test_known_ops_contain_every_operation_constant():
    assert set(timings.KNOWN_OPS) == {
        timings.OP_FORK,
        timings.OP_BRANCH_PAUSE,
        timings.OP_BRANCH_TOTAL,
        timings.OP_FREEZE,
        timings.OP_RESTORE,
        timings.OP_CHECKPOINT,
        timings.OP_EXEC,
        timings.OP_BOOT,
    }
