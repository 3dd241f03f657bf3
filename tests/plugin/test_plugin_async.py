"""The async fixtures (forkd_avm, forkd_aparent) against real VMs, under pytest-asyncio and under anyio."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.vm

# The parent is prepared by an async session fixture through forkd_aparent; each
# test then uses forkd_aparent again from its own event loop.
CONFTESTS = {
    "asyncio": """
import pytest_asyncio


@pytest_asyncio.fixture(scope="session", loop_scope="session", autouse=True)
async def prepared(forkd_aparent):
    await forkd_aparent.exec("echo prepared-in-parent > /etc/prepared", check=True)
""",
    "anyio": """
import pytest


@pytest.fixture(scope="session")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
async def prepared(forkd_aparent, anyio_backend):
    await forkd_aparent.exec("echo prepared-in-parent > /etc/prepared", check=True)
""",
}

SUITE = """
import asyncio
import time

import pytest

pytestmark = pytest.mark.{marker}
children = []


async def test_writes_a_file(forkd_avm):
    assert (await forkd_avm.exec("test -e /root/leak")).exit_code == 1
    await forkd_avm.write_file("/root/leak", "x")


async def test_file_of_previous_test_is_absent(forkd_avm, forkd_aparent):
    assert (await forkd_avm.exec("test -e /root/leak")).exit_code == 1
    assert await forkd_avm.read_file("/etc/prepared") == b"prepared-in-parent\\n"
    assert await forkd_aparent.read_file("/etc/prepared") == b"prepared-in-parent\\n"
    assert forkd_avm.sync is not forkd_aparent.sync


async def test_commands_overlap(forkd_avm):
    async def interval():
        result = await forkd_avm.exec("sleep 1")
        ended = time.monotonic()
        return ended - result.duration_ms / 1000, ended

    await forkd_avm.exec("true")
    intervals = await asyncio.gather(*(interval() for _ in range(3)))
    assert max(start for start, _ in intervals) < min(end for _, end in intervals), intervals


async def test_cancelled_command_is_killed(forkd_avm):
    command = asyncio.create_task(forkd_avm.exec("sleep 30"))
    await asyncio.sleep(0.5)
    command.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(command, timeout=10)
    assert (await forkd_avm.exec("ps | grep -c '[s]leep 30' || true")).stdout == "0\\n"


async def test_checkpoint_rollback_and_fan_out(forkd_avm):
    await forkd_avm.exec("mkdir -p /srv && echo data > /srv/f", check=True)
    async with forkd_avm.checkpoint():
        await forkd_avm.exec("rm -rf /srv", check=True)
    assert await forkd_avm.read_file("/srv/f") == b"data\\n"
    checkpoint = await forkd_avm.checkpoint()
    children.extend(await checkpoint.fork(2))
    assert [await child.read_file("/srv/f") for child in children] == [b"data\\n", b"data\\n"]


async def test_checkpoint_children_died_with_their_test(forkd_avm):
    assert len(children) == 2 and all(child.closed for child in children)


async def test_failure_shows_the_vm(forkd_avm):
    await forkd_avm.exec("echo before-failure")
    assert False, "the agent broke something"
"""


@pytest.mark.parametrize("marker", ["asyncio", "anyio"])
def test_async_fixtures_under_pytest_asyncio_and_anyio(pytester, run_forkd, marker):
    pytester.makeconftest(CONFTESTS[marker])
    pytester.makepyfile(test_async_suite=SUITE.format(marker=marker))
    other_plugin = "no:anyio" if marker == "asyncio" else "no:asyncio"
    result = run_forkd("-v", "-p", other_plugin)
    result.assert_outcomes(passed=6, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*- forkd VM child* -*",
            "*exit 0 * ms  echo before-failure",
        ]
    )
    result.stdout.fnmatch_lines(["*fixture_overhead_ms per test (forkd_vm setup + teardown): p50 * (n=7)*"])


def test_async_fixtures_need_no_async_plugin(pytester, run_forkd):
    pytester.makepyfile(
        test_plain="""
        import asyncio

        def test_sync_code_can_drive_the_async_handle(forkd_avm):
            assert asyncio.run(forkd_avm.exec("echo hi")).stdout == "hi\\n"
    """
    )
    result = run_forkd("-p", "no:asyncio", "-p", "no:anyio")
    result.assert_outcomes(passed=1)


def test_loading_the_plugin_imports_no_async_machinery():
    probe = (
        "import sys, pytest_forkd.plugin; "
        "print(sorted(m for m in ('asyncio', 'pytest_asyncio', 'anyio', 'pytest_forkd.aio') if m in sys.modules))"
    )
    output = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
