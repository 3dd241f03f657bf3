"""Every ``forkd`` command with actions lists when no action is named, and takes ``list`` for ``ls``."""

from __future__ import annotations

import argparse

import pytest

from pytest_forkd import cli


def commands_with_actions() -> dict[str, argparse._SubParsersAction[argparse.ArgumentParser]]:
    """Each command of the real parser whose words start with an action, by name."""
    parser = cli.build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    found = {}
    for name, command in commands.choices.items():
        actions = [action for action in command._actions if isinstance(action, argparse._SubParsersAction)]
        if actions:
            found[name] = actions[0]
    return found


def test_the_commands_with_actions_are_found() -> None:
    assert {"snapshots", "image"} <= set(commands_with_actions())


@pytest.mark.parametrize("command", sorted(commands_with_actions()))
def test_every_command_with_actions_lists_by_default_and_takes_list(command: str) -> None:
    actions = commands_with_actions()[command]
    assert cli.DEFAULT_ACTION in actions.choices, f"forkd {command} has no {cli.DEFAULT_ACTION} action to default to"
    dest = actions.dest
    parser = cli.build_parser()

    for words in ([command], [command, "list"], [command, cli.DEFAULT_ACTION]):
        args = parser.parse_args(words)
        assert getattr(args, dest) == cli.DEFAULT_ACTION, words
        assert callable(args.run), words


def test_an_option_alone_goes_to_the_default_action() -> None:
    args = cli.build_parser().parse_args(["snapshots", "--all"])

    assert (args.action, args.all) == ("ls", True)


def test_help_is_the_command_s_own_not_its_default_action_s(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["image", "--help"])

    out = capsys.readouterr().out
    assert out.startswith("usage: forkd image [-h] ACTION") and "prune" in out


def test_a_new_action_named_ls_gets_the_alias_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command module added later needs nothing of its own for either."""

    def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        group = subparsers.add_parser("things")
        actions = group.add_subparsers(dest="things_action", metavar="ACTION", required=True)
        actions.add_parser("pull").set_defaults(run=lambda args: 0)
        actions.add_parser("ls", help="list things").set_defaults(run=lambda args: 0)

    real_build = cli.build_parser

    def build_parser() -> argparse.ArgumentParser:
        parser = real_build()
        add_parser(next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction)))
        return parser

    monkeypatch.setattr(cli, "COMMAND_MODULES", ())
    monkeypatch.setattr(cli, "build_parser", build_parser)
    parser = cli.build_parser()

    assert parser.parse_args(["things"]).things_action == "ls"
    assert parser.parse_args(["things", "list"]).things_action == "ls"
    assert parser.parse_args(["things", "pull"]).things_action == "pull"
