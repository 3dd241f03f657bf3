"""A compose service as Docker runs it, in real VMs: its internal network, and its command serving the sample.

One Inspect eval of two configs, against the project image the tests push to
their real registry (:mod:`project_images`):

- ``served-compose.yaml``: the default network is ``internal: true`` and the
  service's ``command`` is an HTTP server on 127.0.0.1:8000 (as the user
  ``agent``, with a healthcheck). forkd starts it once in the parent VM;
  every sample's VM has it running, answering a request, with no default
  route out;
- ``broken-compose.yaml``: a command that exits at once fails its sample
  with its exit status and its output, and the other samples go on.

The rules themselves (every network case, entrypoint and command, healthchecks)
are in tests/integrations/test_compose_docker_rules.py, without VMs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from project_images import BUGGY_CALC
from support import processes_mentioning

from pytest_forkd.waiting import poll_until

pytest.importorskip("inspect_ai", reason="needs inspect-ai: pip install 'pytest-forkd[inspect]'")

from inspect_ai import Task  # noqa: E402
from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai.dataset import Sample  # noqa: E402
from inspect_ai.solver import generate, use_tools  # noqa: E402
from inspect_ai.tool import bash  # noqa: E402
from inspect_scripts import offline_tokens, outputs_of, scripted_model  # noqa: E402

from pytest_forkd.integrations.service_process import LOG_FILE  # noqa: E402
from pytest_forkd.integrations.sessions import SESSIONS  # noqa: E402

pytestmark = pytest.mark.vm

SERVED = """\
services:
  default:
    image: {image}
    user: agent
    working_dir: /srv/project
    command: python3 -m http.server 8000 --bind 127.0.0.1 --directory /srv/project
    healthcheck:
      test: [CMD, bash, -c, "exec 3<>/dev/tcp/127.0.0.1/8000"]
      interval: 2s
      timeout: 10s
      start_period: 5m
    init: true
networks:
  default:
    internal: true
"""

BROKEN = """\
services:
  default:
    image: {image}
    network_mode: none
    entrypoint: ["/bin/sh", "-c", "echo the-service-cannot-start >&2; exit 3"]
"""

#: What a sample runs, in bash alone (a first python3 in a VM of this image compiles its stdlib, slowly under TCG):
#: a curl-like request to the service, and the user its process runs as.
FETCH = "exec 3<>/dev/tcp/127.0.0.1/8000; printf 'GET /calc.py HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3"
SERVER_UID = (
    'for d in /proc/[0-9]*; do read -r -d "" exe < "$d/cmdline"; case $exe in */python3*) '
    'while read -r key value rest; do [ "$key" = Uid: ] && echo "$value"; done < "$d/status";; esac; done'
)


@pytest.fixture
def shm_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = Path(f"/dev/shm/forkd-service-{os.getpid()}-{secrets.token_hex(3)}")
    monkeypatch.setenv("FORKD_SHM_DIR", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def sample(sample_id: str, commands: list[str], config: Path) -> Sample:
    return Sample(id=sample_id, input=json.dumps(commands), sandbox=("forkd", str(config)))


def test_a_service_on_an_internal_network_serves_every_sample_from_its_command(
    project_image: str, shm_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline_tokens(monkeypatch)
    served = tmp_path / "served-compose.yaml"
    served.write_text(SERVED.format(image=project_image))
    broken = tmp_path / "broken-compose.yaml"
    broken.write_text(BROKEN.format(image=project_image))
    commands = [
        "cat /proc/net/route",
        "ip route 2>/dev/null || echo no-ip-tool",
        FETCH,
        SERVER_UID,
        f"cat {LOG_FILE}",
    ]
    samples = [
        sample("served-1", commands, served),
        sample("broken", ["true"], broken),
        sample("served-2", commands, served),
    ]
    task = Task(dataset=samples, solver=[use_tools(bash(timeout=120)), generate()])
    [log] = inspect_eval(
        task, model=scripted_model(), log_dir=str(tmp_path / "logs"), display="none", max_samples=2, fail_on_error=False
    )
    by_id: dict[Any, Any] = {entry.id: entry for entry in log.samples}
    for name in ("served-1", "served-2"):
        assert by_id[name].error is None, by_id[name].error
        routes, ip_route, fetched, uid, logged = outputs_of(by_id[name])
        # No default route (destination 00000000): the internal network reaches nothing outside.
        assert routes.startswith("Iface"), routes
        assert not [line for line in routes.splitlines()[1:] if line.split()[1:2] == ["00000000"]], routes
        assert "default" not in ip_route
        # The service's own command answers, started once in the parent: the image's project file, served.
        head, _, body = fetched.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.0 200") and body == BUGGY_CALC, fetched
        assert uid.split() == ["1000"]  # as the service's user, agent
        assert '"GET /calc.py HTTP/1.0" 200' in logged  # its output, where a user can read it
    error = by_id["broken"].error
    assert error is not None
    assert "the main process `/bin/sh -c echo the-service-cannot-start >&2; exit 3` exited with status 3" in (
        error.message
    )
    assert "the-service-cannot-start" in error.message.partition(f"its output ({LOG_FILE})")[2]  # what it printed
    poll_until(lambda: processes_mentioning(shm_root) == [], timeout=30, interval=0.1, what=f"processes in {shm_root}")
    assert SESSIONS.keys() == []
