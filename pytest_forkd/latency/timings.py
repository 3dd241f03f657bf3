"""Latency samples of VM operations and the recorder that collects them.

Every fork, branch, restore, checkpoint and exec the VM layer performs is
timed, because users run agent suites in CI and want it to fail when the
sandbox layer gets slower. The VM layer must not depend on pytest, so each
VM reports to the :class:`Recorder` of its factory's runtime
(:class:`pytest_forkd.core.runtime.Runtime`); the pytest plugin gives its
session's runtime the run's recorder, attributes samples to the running test
(:meth:`Recorder.running_test`) and merges the samples of xdist workers
(:meth:`Recorder.to_json`, :meth:`Recorder.from_json`, :meth:`Recorder.extend`).
There is no process-wide recorder: two sessions in one process keep their
samples apart.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from pytest_forkd.errors import ConfigError

OP_FORK: Final = "fork"  # a child VM from a snapshot, until it answers
OP_BRANCH_PAUSE: Final = "branch_pause"  # how long a branch kept the running VM paused
OP_BRANCH_TOTAL: Final = "branch_total"  # a branch from start until the snapshot is usable
OP_FREEZE: Final = "freeze"  # a root VM stopped so that its RAM file becomes a base
OP_RESTORE: Final = "restore"
OP_CHECKPOINT: Final = "checkpoint"
OP_EXEC: Final = "exec"  # one guest command, round trip
OP_EXEC_WORKLOAD: Final = "exec[workload]"  # one guest command of the test's own workload (exec(timing="workload"))
OP_BOOT: Final = "boot"  # cold boot to the first agent reply
OP_MANIFEST: Final = "manifest"  # the filesystem manifest a checkpoint records before branching
OP_CHANGES: Final = "changes"  # VM.changes(): walk, compare, content hashes

#: The operations the VM layer times, in the order reports list them. The set
#: is open: a third-party backend may record its own operations.
KNOWN_OPS: Final = (
    OP_FORK,
    OP_BRANCH_PAUSE,
    OP_BRANCH_TOTAL,
    OP_FREEZE,
    OP_RESTORE,
    OP_CHECKPOINT,
    OP_EXEC,
    OP_EXEC_WORKLOAD,
    OP_BOOT,
    OP_MANIFEST,
    OP_CHANGES,
)

#: Tag of exec samples: harness commands (the default) or the test's own workload.
#: A workload sample is recorded under its own row (``exec[workload]``), so
#: budgets and baselines on ``exec`` measure the sandbox, not what a test runs in it.
TIMING_HARNESS: Final = "harness"
TIMING_WORKLOAD: Final = "workload"
TIMING_TAGS: Final = (TIMING_HARNESS, TIMING_WORKLOAD)


def tagged_op(op: str, timing: str) -> str:
    """The row a sample of ``op`` tagged ``timing`` is recorded under: ``exec`` or ``exec[workload]``."""
    if timing not in TIMING_TAGS:
        from pytest_forkd.errors import InvalidArgument

        raise InvalidArgument(
            f"timing={timing!r} is not a timing tag; use {TIMING_HARNESS!r} (the default: harness commands, "
            f"row {op!r}) or {TIMING_WORKLOAD!r} (the test's own workload, row {op}[{TIMING_WORKLOAD}])"
        )
    return op if timing == TIMING_HARNESS else f"{op}[{timing}]"


_JSON_SCALARS = (str, int, float, bool, type(None))
_FORMAT_VERSION: Final = 1


def _json_safe(value: object) -> object:
    """Keep JSON scalars and plain containers, turn anything else into its str()."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return str(value)


@dataclass(frozen=True)
class Sample:
    """One timed operation.

    ``test`` is the pytest node id of the test that was running (None outside a
    test), ``cold`` marks the first operation on a freshly started VM (those are
    known to be several times slower and are worth telling apart), ``extra``
    holds free-form details such as a snapshot tag; values JSON cannot carry
    are stored as their ``str()``.
    """

    op: str
    ms: float
    test: str | None = None
    backend: str | None = None
    memory_mib: int | None = None
    dirty_bytes: int | None = None
    cold: bool = False
    extra: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # A frozen sample must not change behind the recorder's back.
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    def to_dict(self) -> dict[str, object]:
        return {
            "op": self.op,
            "ms": self.ms,
            "test": self.test,
            "backend": self.backend,
            "memory_mib": self.memory_mib,
            "dirty_bytes": self.dirty_bytes,
            "cold": self.cold,
            "extra": _json_safe(self.extra),
        }

    @classmethod
    def from_dict(cls, data: object) -> Sample:
        """Rebuild a sample written by :meth:`to_dict`; ConfigError names the bad field."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping with 'op' and 'ms', got {data!r}")
        op = data.get("op")
        if not isinstance(op, str) or not op:
            raise ConfigError(f"op: expected an operation name such as 'fork', got {op!r}")
        ms = data.get("ms")
        if isinstance(ms, bool) or not isinstance(ms, (int, float)):
            raise ConfigError(f"ms: expected a number of milliseconds, got {ms!r}")
        optional_types = {
            "test": str,
            "backend": str,
            "memory_mib": int,
            "dirty_bytes": int,
        }
        values: dict[str, object] = {}
        for name, expected in optional_types.items():
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, expected)):
                raise ConfigError(f"{name}: expected {expected.__name__} or null, got {value!r}")
            values[name] = value
        cold = data.get("cold", False)
        if not isinstance(cold, bool):
            raise ConfigError(f"cold: expected true or false, got {cold!r}")
        extra = data.get("extra") or {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"extra: expected a mapping, got {extra!r}")
        return cls(op=op, ms=float(ms), cold=cold, extra=extra, **values)  # type: ignore[arg-type]


class _UseRunningTest:
    """Marker default: attribute the sample to whichever test is running."""

    def __repr__(self) -> str:
        return "RUNNING_TEST"


#: Default of the ``test`` argument of :meth:`Recorder.record`: attribute the
#: sample to the running test. Pass ``test=None`` explicitly for work that does
#: not belong to the running test (a background pool refill, say).
RUNNING_TEST: Final = _UseRunningTest()


class Recorder:
    """Thread-safe collector of :class:`Sample` objects.

    The running test is a plain attribute guarded by a lock, not a context
    variable, on purpose: pytest runs one test at a time per process, and a
    test that forks VMs from several threads (a thread pool does not inherit
    context variables) must still have those forks attributed to it.
    """

    def __init__(self, samples: Iterable[Sample] = (), build_samples: Iterable[Sample] = ()) -> None:
        self._lock = threading.Lock()
        self._samples: list[Sample] = list(samples)
        self._build_samples: list[Sample] = list(build_samples)
        self._running_test: str | None = None
        self._building: str | None = None

    @property
    def current_test(self) -> str | None:
        with self._lock:
            return self._running_test

    @contextmanager
    def running_test(self, nodeid: str | None) -> Iterator[None]:
        """Attribute every sample recorded inside the block to ``nodeid``."""
        with self._lock:
            previous, self._running_test = self._running_test, nodeid
        try:
            yield
        finally:
            with self._lock:
                self._running_test = previous

    @contextmanager
    def building(self, snapshot: str) -> Iterator[None]:
        """Keep every sample recorded inside the block apart, as work of building snapshot ``snapshot``.

        A snapshot's set-up commands run once, on the run that builds it: were
        their samples counted with the tests', a budget such as ``exec.max``
        would fail that run and pass the next, and a baseline would compare a
        building run with a cached one. They are kept in :meth:`build_samples`
        instead (no test, ``extra["snapshot"]`` naming the snapshot), which
        budgets and stored runs never read. Samples recorded with an explicit
        ``test=`` (work that knows whose it is) are not affected.
        """
        with self._lock:
            previous, self._building = self._building, snapshot
        try:
            yield
        finally:
            with self._lock:
                self._building = previous

    def record(
        self,
        op: str,
        ms: float,
        *,
        test: str | _UseRunningTest | None = RUNNING_TEST,
        backend: str | None = None,
        memory_mib: int | None = None,
        dirty_bytes: int | None = None,
        cold: bool = False,
        extra: Mapping[str, object] | None = None,
    ) -> Sample:
        """Store one sample and return it."""
        with self._lock:
            building = self._building if isinstance(test, _UseRunningTest) else None
            if building is not None:
                test = None
                extra = {**(extra or {}), "snapshot": building}
            elif isinstance(test, _UseRunningTest):
                test = self._running_test
            sample = Sample(
                op=op,
                ms=float(ms),
                test=test,
                backend=backend,
                memory_mib=memory_mib,
                dirty_bytes=dirty_bytes,
                cold=cold,
                extra=extra or {},
            )
            (self._samples if building is None else self._build_samples).append(sample)
        return sample

    def extend(self, samples: Iterable[Sample], build_samples: Iterable[Sample] = ()) -> None:
        """Add samples gathered elsewhere, e.g. by an xdist worker (its builds' samples apart)."""
        incoming, incoming_builds = list(samples), list(build_samples)
        with self._lock:
            self._samples.extend(incoming)
            self._build_samples.extend(incoming_builds)

    def samples(self) -> list[Sample]:
        """The samples of tests and sessions: everything but snapshot builds (see :meth:`building`)."""
        with self._lock:
            return list(self._samples)

    def build_samples(self) -> list[Sample]:
        """The samples recorded while building snapshots, kept out of budgets and baselines."""
        with self._lock:
            return list(self._build_samples)

    def by_op(self) -> dict[str, list[Sample]]:
        """Samples grouped by operation, in order of first appearance."""
        groups: dict[str, list[Sample]] = {}
        for sample in self.samples():
            groups.setdefault(sample.op, []).append(sample)
        return groups

    def to_json(self) -> str:
        document: dict[str, object] = {"version": _FORMAT_VERSION, "samples": [s.to_dict() for s in self.samples()]}
        builds = self.build_samples()
        if builds:
            document["build_samples"] = [s.to_dict() for s in builds]
        return json.dumps(document)

    @classmethod
    def from_json(cls, text: str) -> Recorder:
        """Rebuild a recorder from :meth:`to_json` output; ConfigError says what is wrong."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"timing samples are not valid JSON: {exc}") from None
        if not isinstance(data, Mapping) or data.get("version") != _FORMAT_VERSION:
            raise ConfigError(
                "timing samples: expected an object with version 1 and a 'samples' list, "
                "as written by Recorder.to_json()"
            )
        return cls(_parse_samples(data, "samples"), _parse_samples(data, "build_samples", required=False))


def _parse_samples(data: Mapping[str, object], key: str, *, required: bool = True) -> list[Sample]:
    raw_samples = data.get(key, None if required else [])
    if not isinstance(raw_samples, list):
        raise ConfigError(f"timing samples: {key!r} must be a list, got {raw_samples!r}")
    parsed = []
    for index, item in enumerate(raw_samples):
        try:
            parsed.append(Sample.from_dict(item))
        except ConfigError as exc:
            raise ConfigError(f"timing samples: {key}[{index}]: {exc}") from None
    return parsed
