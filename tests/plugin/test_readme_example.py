"""The first test README.md and the docs' home page show a new user, run as written against real VMs.

The code is read out of the Markdown files, so an edit that breaks the
example fails here rather than on a user's first run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]


def python_block(markdown: Path, first_line: str) -> str:
    """The fenced Python block of ``markdown`` whose first line is ``first_line`` (or that starts with a def)."""
    for block in re.findall(r"```python\n(.*?)```", markdown.read_text(), flags=re.DOTALL):
        if block.startswith(first_line):
            return str(block)
    raise AssertionError(f"{markdown.name} has no Python block starting with {first_line!r}")


def test_readme_first_test_and_home_page_example_pass(
    pytester: pytest.Pytester, run_forkd: Callable[..., pytest.RunResult]
) -> None:
    pytester.makepyfile(
        test_agent=python_block(REPO / "README.md", "# test_agent.py"),
        test_home=python_block(REPO / "docs" / "index.md", "def test_"),
    )
    result = run_forkd("-q")
    result.assert_outcomes(passed=4)
    assert result.ret == 0
