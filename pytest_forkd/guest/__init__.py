"""The guest side and the channel to it: the wire protocol, the agent that runs in the guest, the host's client.

``agent/`` runs inside the VM (a package in plain Python, standard library
only) and ``wire.py`` is shared by both ends; ``client.py`` (AgentClient) is the
host's end, with ``calls.py`` (requests in flight, their replies assembled) and
``requests.py`` (the checked fields of exec and spawn); ``exec_result.py`` is
what an exec returns. All of it runs without
a VM, over a socketpair, which is how the unit tests drive it. The E2B
server's guest programs live here too, outside the image: the code
interpreter's (``interpreter.py``) and the filesystem helper (``e2b_files.py``).

Layer 1 of docs/ARCHITECTURE.md, beside image. May import: the foundation
(errors, paths, private, processes, sizes, tables, version, waiting) (the
agent and wire modules: nothing outside the standard library). Never engine or
anything above (checked by tests/unit/test_layers.py).
"""

from __future__ import annotations

from pathlib import Path

#: This package's directory: the agent package, wire.py and tarstream.py as the guest has them side by side.
GUEST_DIR = Path(__file__).resolve().parent


def agent_files() -> dict[str, Path]:
    """What the guest runs, by its path in the guest's agent directory (``/opt/forkd``).

    That is the ``agent`` package with the ``wire`` and ``tarstream`` modules
    beside it. One list for everything that installs or fingerprints the agent (the image
    builder, the fake engine, tests), so a new agent module cannot be left out.
    """
    files = {f"agent/{path.name}": path for path in sorted((GUEST_DIR / "agent").glob("*.py"))}
    files["wire.py"] = GUEST_DIR / "wire.py"
    files["tarstream.py"] = GUEST_DIR / "tarstream.py"
    return files


def interpreter_program() -> Path:
    """The code interpreter's guest program (``interpreter.py``): one persistent Python context per process.

    Not part of the image (so not in :func:`agent_files` nor the image key):
    the E2B server copies it into a VM when a sandbox first runs code.
    """
    return GUEST_DIR / "interpreter.py"


def e2b_files_program() -> Path:
    """The E2B server's filesystem helper (``e2b_files.py``): envd's filesystem calls, answered in the guest.

    Not part of the image either: the E2B server runs it in a template's VM
    (its source on ``python3``'s command line) before the template is snapshotted.
    """
    return GUEST_DIR / "e2b_files.py"


def install_agent(directory: Path) -> Path:
    """Copy :func:`agent_files` into ``directory``; return the agent package there (run it as ``python3 PATH``)."""
    for name, source in agent_files().items():
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    return directory / "agent"
