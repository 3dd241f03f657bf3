"""``forkd cp`` argument checks, before any VM starts."""

from __future__ import annotations

import pytest

from pytest_forkd.cli import main
from pytest_forkd.cli.cp_cmd import GuestSide, guest_side


def test_snapshot_paths_are_tag_colon_absolute_path() -> None:
    assert guest_side("base:/srv/app") == GuestSide("base", "/srv/app")
    assert guest_side("./base:/srv/app") is None
    assert guest_side("base:relative") is None
    assert guest_side("/tmp/x") is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["cp", "a", "b"], "neither names a snapshot path"),
        (["cp", "base:/a", "base:/b"], "both name a snapshot path"),
        (["cp", "./src", "base:/srv"], "needs --save NEWTAG"),
        (["cp", "base:/etc", "out", "--save", "x"], "--save only applies"),
        (["cp", "./src", "base:/srv", "--save", "base"], "pick a new tag"),
        (["cp", "./src", "base:/srv", "--save", "bad tag!"], "bad tag"),
    ],
)
def test_bad_command_lines_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 4
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
