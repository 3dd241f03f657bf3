"""Transcripts: every operation a VM was asked to do, in order, with its outcome.

Each :class:`~pytest_forkd.core.vm.VM` keeps one :class:`Transcript`. Every exec,
file operation, snapshot and restore appends an entry (a JSON-ready dict):
command, cwd, environment variable *names* (values may be secrets and are not
kept), exit code, signal, duration, the head and tail of stdout and stderr,
and whether output was truncated or the command was killed for memory. This is
what a failing test's report shows, what ``--forkd-transcript=DIR`` writes as
JSON Lines, and what ``forkd bisect`` replays.

A VM started from a snapshot inherits the *state history* of that snapshot:
the replayable entries that led from the oldest known snapshot (its *root*,
usually a named snapshot such as ``base``) to the snapshot's state. So the
transcript of a test's VM, forked from the session parent, can be replayed
from ``base``: first what the parent was prepared with, then what the test did.
Snapshots record that history in a process-wide table keyed by their
directory; it is only known for the last 512 snapshots taken in this process.
"""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_forkd.errors import TranscriptError
from pytest_forkd.version import __version__

if TYPE_CHECKING:
    from pytest_forkd.storage.snapshot import Snapshot

FORMAT = "pytest-forkd-transcript"
FORMAT_VERSION = 1
#: Bytes of stdout/stderr kept from the start and from the end of each command's output.
HEAD_BYTES = 1024
TAIL_BYTES = 1024
#: Written data and stdin up to this size are kept in the entry, so the operation can be replayed...
REPLAY_DATA_BYTES = 64 * 1024
#: ...as long as one VM's transcript keeps no more than this much of it (then only sizes and digests).
REPLAY_DATA_BUDGET = 16 * 1024 * 1024
#: Entry kinds that change guest state and can be replayed.
REPLAYABLE = frozenset({"exec", "write_file", "copy_in"})


@dataclass(frozen=True)
class Lineage:
    """Where a state comes from: the oldest known snapshot and the operations since."""

    root: Mapping[str, Any] | None
    """``{"tag", "store"}`` of the snapshot the history starts at (None: a booted VM)."""
    ancestors: tuple[str, ...] = ()
    """Directories of every snapshot this state descends from, oldest first."""
    entries: tuple[dict[str, Any], ...] = ()
    """The replayable operations from ``root`` to this state."""


#: How many snapshots' histories are remembered (the oldest are forgotten first).
LINEAGE_MEMORY = 512
_lineages: OrderedDict[str, Lineage] = OrderedDict()
_lineages_lock = threading.Lock()


def lineage_of(snapshot: Snapshot | None) -> Lineage:
    """What is known of how ``snapshot``'s state came about (a root of its own if nothing)."""
    if snapshot is None:
        return Lineage(root=None)
    key = str(Path(snapshot.path).absolute())
    with _lineages_lock:
        known = _lineages.get(key)
    if known is not None:
        return known
    return Lineage(root={"tag": snapshot.tag, "store": str(Path(snapshot.path).absolute().parent)}, ancestors=(key,))


def _clip(data: bytes) -> dict[str, Any]:
    """Byte count, head and tail of one output stream."""
    summary: dict[str, Any] = {"bytes": len(data)}
    if len(data) <= HEAD_BYTES + TAIL_BYTES:
        summary["head"] = data.decode("utf-8", "replace")
        summary["tail"] = ""
    else:
        summary["head"] = data[:HEAD_BYTES].decode("utf-8", "replace")
        summary["tail"] = data[-TAIL_BYTES:].decode("utf-8", "replace")
    return summary


def _payload(data: bytes, keep: bool = True) -> dict[str, Any]:
    """Size, digest and (when small and ``keep``) the data itself of something sent to the guest."""
    fields: dict[str, Any] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if keep and len(data) <= REPLAY_DATA_BYTES:
        try:
            fields["text"] = data.decode("utf-8")
        except UnicodeDecodeError:
            fields["base64"] = base64.b64encode(data).decode("ascii")
    return fields


def payload_bytes(fields: Mapping[str, Any] | None) -> bytes | None:
    """The data kept by :func:`_payload`, or None when it was too large to keep."""
    if not fields:
        return b"" if fields is not None else None
    if "text" in fields:
        return str(fields["text"]).encode("utf-8")
    if "base64" in fields:
        return base64.b64decode(fields["base64"])
    return None if fields.get("bytes") else b""


def signal_name(exit_code: int | None, explicit: object = None) -> str | None:
    """The name of the signal that ended a command (from the result's own field when it has one)."""
    if explicit:
        if isinstance(explicit, int):
            try:
                return signal.Signals(explicit).name
            except ValueError:
                return f"signal {explicit}"
        return str(explicit)
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def describe_result(result: Any) -> dict[str, Any]:
    """The transcript fields of an ExecResult (fields a newer ExecResult may lack default off)."""
    exit_code = getattr(result, "exit_code", None)
    return {
        "exit_code": exit_code,
        "signal": signal_name(exit_code, getattr(result, "signal", None)),
        "timed_out": bool(getattr(result, "timed_out", False)),
        "truncated": bool(getattr(result, "truncated", False)),
        "oom_killed": bool(getattr(result, "oom_killed", False)),
        "guest_ms": round(float(getattr(result, "duration_ms", 0.0) or 0.0), 3),
        "stdout": _clip(getattr(result, "stdout_bytes", b"") or b""),
        "stderr": _clip(getattr(result, "stderr_bytes", b"") or b""),
    }


class Transcript:
    """The operations of one VM, oldest first; thread-safe."""

    def __init__(self, vm_name: str, origin: Snapshot | None = None) -> None:
        self.vm = vm_name
        self.entries: list[dict[str, Any]] = []
        """Every entry recorded on this VM, in order (restores included)."""
        self.step: int | None = None
        """Set while a trajectory step runs: entries are tagged with it."""
        self._lineage = lineage_of(origin)
        self.start = self._lineage
        """The history of the state the VM started with (what its own entries build on)."""
        self._cut = 0
        self._lock = threading.Lock()
        self._seq = 0
        self._kept_bytes = 0

    # -- recording ------------------------------------------------------------------------------------
    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append an entry of ``kind`` and return it (callers may complete it when the operation ends)."""
        with self._lock:
            self._seq += 1
            entry: dict[str, Any] = {
                "seq": self._seq,
                "vm": self.vm,
                "kind": kind,
                "time": round(time.time(), 3),
                **fields,
            }
            if self.step is not None:
                entry["step"] = self.step
            self.entries.append(entry)
            return entry

    def begin_exec(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None,
        env: Mapping[str, str] | None,
        stdin: bytes | str | None,
        timeout: float | None,
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "command": command if isinstance(command, str) else list(command),
            "cwd": cwd,
            "env_keys": sorted(env) if env else [],
            "timeout": timeout,
        }
        if stdin:
            fields["stdin"] = self._payload(stdin.encode() if isinstance(stdin, str) else stdin)
        return self.record("exec", **fields)

    def _payload(self, data: bytes) -> dict[str, Any]:
        with self._lock:
            keep = self._kept_bytes + len(data) <= REPLAY_DATA_BUDGET
            if keep and len(data) <= REPLAY_DATA_BYTES:
                self._kept_bytes += len(data)
        return _payload(data, keep)

    @staticmethod
    def finish(
        entry: dict[str, Any], started: float, *, result: Any = None, error: BaseException | None = None
    ) -> None:
        """Complete ``entry`` with the duration and the outcome (a result, or the error raised)."""
        entry["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
        if result is not None:
            entry.update(describe_result(result))
        if error is not None:
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def write_file(self, path: str, data: bytes | str, mode: int | None) -> dict[str, Any]:
        return self.record(
            "write_file", path=path, mode=mode, data=self._payload(data.encode() if isinstance(data, str) else data)
        )

    # -- state history ----------------------------------------------------------------------------------
    def restored(self, snapshot: Snapshot) -> None:
        """The VM's state was replaced by ``snapshot``'s: its history is now the snapshot's."""
        lineage = lineage_of(snapshot)
        self.record("restore", snapshot=snapshot.tag)
        with self._lock:
            self._lineage = lineage
            self._cut = len(self.entries)

    def branched(self, snapshot: Snapshot) -> None:
        """``snapshot`` was taken of this VM: remember the history of its state for its children."""
        lineage = self.lineage()
        key = str(Path(snapshot.path).absolute())
        with _lineages_lock:
            _lineages[key] = Lineage(lineage.root, (*lineage.ancestors, key), lineage.entries)
            _lineages.move_to_end(key)
            while len(_lineages) > LINEAGE_MEMORY:
                _lineages.popitem(last=False)
        with self._lock:  # the VM's own state now descends from the snapshot too
            self._lineage = Lineage(self._lineage.root, (*self._lineage.ancestors, key), self._lineage.entries)
        self.record("snapshot", snapshot=snapshot.tag, backend=snapshot.backend)

    def lineage(self) -> Lineage:
        """The history of the VM's current state: inherited entries plus its own since the last restore."""
        with self._lock:
            own = tuple(entry for entry in self.entries[self._cut :] if entry["kind"] in REPLAYABLE)
            return Lineage(self._lineage.root, self._lineage.ancestors, (*self._lineage.entries, *own))

    def descends_from(self, snapshot: Snapshot) -> bool:
        """Whether the VM's current state was made from ``snapshot``'s (as far as this process knows)."""
        key = str(Path(snapshot.path).absolute())
        with self._lock:
            return key in self._lineage.ancestors

    # -- reading --------------------------------------------------------------------------------------
    def tail(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.entries[-n:])

    def __len__(self) -> int:
        return len(self.entries)

    def format(self, last: int = 30) -> str:
        """The last ``last`` entries as text, one line each plus output tails of failed commands."""
        entries = self.tail(last)
        lines = []
        if len(self.entries) > len(entries):
            lines.append(f"  ... {len(self.entries) - len(entries)} earlier entries (all in --forkd-transcript)")
        lines += [format_entry(entry) for entry in entries]
        return "\n".join(lines) if lines else "  (nothing recorded)"


def format_entry(entry: Mapping[str, Any]) -> str:
    """One transcript entry as a line (plus the output tails of a failed command)."""
    kind = entry.get("kind")
    ms = f"{entry['duration_ms']:8.1f} ms" if "duration_ms" in entry else " " * 11
    step = f"[step {entry['step']}] " if "step" in entry else ""
    if kind == "exec":
        command = entry["command"]
        text = command if isinstance(command, str) else " ".join(command)
        if entry.get("timed_out"):
            outcome = "timed out"
        elif entry.get("signal"):
            outcome = str(entry["signal"])
        elif entry.get("exit_code") is not None:
            outcome = f"exit {entry['exit_code']}"
        else:
            outcome = "no answer"
        flags = [flag for flag in ("truncated", "oom_killed") if entry.get(flag)]
        where = f"(cd {entry['cwd']}) " if entry.get("cwd") else ""
        env = f"[env {' '.join(entry['env_keys'])}] " if entry.get("env_keys") else ""
        line = f"  {outcome:>10} {ms}  {step}{env}{where}{text}" + (f"  [{', '.join(flags)}]" if flags else "")
        if entry.get("error"):
            line += f"\n{'':14}{entry['error']}"
        if entry.get("exit_code") not in (0, None) or entry.get("timed_out"):
            for stream in ("stderr", "stdout"):
                output = entry.get(stream) or {}
                text_out = (output.get("tail") or output.get("head") or "").rstrip()
                if text_out:
                    shown = "\n".join(text_out.splitlines()[-5:])
                    line += "\n" + "\n".join(f"{'':14}{stream}: {row}" for row in shown.splitlines())
                    break
        return line
    if kind == "spawn":
        command = entry["command"]
        text = command if isinstance(command, str) else " ".join(command)
        where = f"(cd {entry['cwd']}) " if entry.get("cwd") else ""
        started = f"pid {entry['pid']}" if "pid" in entry else entry.get("error", "not started")
        return f"  {'spawn':>10} {ms}  {step}{where}{text}  [{started}]"
    if kind == "write_file":
        return f"  {'write':>10} {ms}  {step}{entry['path']} ({entry['data']['bytes']} bytes)"
    if kind == "read_file":
        return f"  {'read':>10} {ms}  {step}{entry['path']} ({entry.get('bytes', '?')} bytes)"
    if kind in ("copy_in", "copy_out"):
        arrow = (
            f"{entry.get('local')} -> {entry.get('path')}"
            if kind == "copy_in"
            else f"{entry.get('path')} -> {entry.get('local')}"
        )
        line = (
            f"  {kind.replace('_', ' '):>10} {ms}  {step}{arrow} ({entry.get('files', '?')} files, "
            f"{entry.get('bytes', '?')} bytes)"
        )
        return line + (f"\n{'':14}{entry['error']}" if entry.get("error") else "")
    if kind == "restore":
        return f"  {'restore':>10} {ms}  {step}to snapshot {entry['snapshot']}"
    if kind == "snapshot":
        return f"  {'snapshot':>10} {ms}  {step}{entry['snapshot']} ({entry.get('backend')})"
    return f"  {kind!s:>10} {ms}  {step}" + json.dumps(
        {k: v for k, v in entry.items() if k not in ("seq", "vm", "kind", "time", "step")}
    )


# -- JSON Lines files -----------------------------------------------------------------------------------
@dataclass
class TranscriptFile:
    """A transcript file read back: its header and each VM's lineage and entries."""

    path: Path
    header: dict[str, Any]
    vms: list[dict[str, Any]] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)

    def vm(self, name: str | None = None) -> dict[str, Any]:
        if not self.vms:
            raise TranscriptError(f"{self.path} records no VM: nothing to replay")
        if name is None:
            return self.vms[0]
        for vm in self.vms:
            if vm["name"] == name:
                return vm
        raise TranscriptError(f"{self.path} has no VM {name!r}; it has {', '.join(v['name'] for v in self.vms)}")

    def own_entries(self, name: str) -> list[dict[str, Any]]:
        return [entry for entry in self.entries if entry.get("vm") == name and not entry.get("inherited")]

    def inherited_entries(self, name: str) -> list[dict[str, Any]]:
        return [entry for entry in self.entries if entry.get("vm") == name and entry.get("inherited")]


def write_jsonl(path: Path, transcripts: Iterable[Transcript], **header: Any) -> Path:
    """Write ``transcripts`` as JSON Lines: a header, one line per VM, then every entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    transcripts = list(transcripts)
    lines = [{"format": FORMAT, "version": FORMAT_VERSION, "pytest_forkd": __version__, **header}]
    body = []
    for transcript in transcripts:
        start = transcript.start
        with transcript._lock:
            inherited = start.entries
            own = list(transcript.entries)
        lines.append(
            {"kind": "vm", "name": transcript.vm, "root": start.root, "entries": len(own), "inherited": len(inherited)}
        )
        body += [{**entry, "vm": transcript.vm, "inherited": True} for entry in inherited]
        body += own
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for line in (*lines, *body):
            handle.write(json.dumps(line, default=str) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: Path) -> TranscriptFile:
    """Read a file written by :func:`write_jsonl`; TranscriptError if it is not one this version reads."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TranscriptError(f"cannot read transcript {path}: {exc.strerror or exc}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TranscriptError(f"{path}:{number} is not JSON ({exc.msg}); is this a forkd transcript?") from None
    if not rows or not isinstance(rows[0], dict) or rows[0].get("format") != FORMAT:
        raise TranscriptError(
            f"{path} is not a pytest-forkd transcript (its first line has no "
            f'"format": "{FORMAT}"); write one with pytest --forkd-transcript=DIR'
        )
    header = rows[0]
    if header.get("version") != FORMAT_VERSION:
        raise TranscriptError(
            f"{path} is a version {header.get('version')!r} transcript (written by pytest-forkd "
            f"{header.get('pytest_forkd', '?')}); this pytest-forkd reads version {FORMAT_VERSION}: "
            "record it again with this version"
        )
    result = TranscriptFile(Path(path), header)
    for row in rows[1:]:
        if not isinstance(row, dict):
            raise TranscriptError(f"{path}: an entry is not a JSON object: {row!r}")
        (result.vms if row.get("kind") == "vm" else result.entries).append(row)
    return result
