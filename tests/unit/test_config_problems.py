"""Reporting every mistake of a file at once (ConfigProblems) and naming the key a misspelt one meant."""

from __future__ import annotations

import pytest

from pytest_forkd.errors import ConfigError, ConfigProblems, InvalidArgument, did_you_mean


@pytest.mark.parametrize(
    ("word", "choices", "hint"),
    [
        ("snapshot", ("settings", "images", "snapshots", "budgets"), "did you mean 'snapshots'? "),
        ("p95", ("p50_ms", "p95_ms", "max_ms"), "did you mean 'p95_ms'? "),
        ("Setpu", ("from", "setup"), "did you mean 'setup'? "),
        ("colour", ("recipe", "packages", "files", "setup"), ""),
        (3, ("settings",), ""),
    ],
)
def test_did_you_mean_names_the_closest_valid_name(word: object, choices: tuple[str, ...], hint: str) -> None:
    assert did_you_mean(word, choices) == hint


def test_no_mistake_raises_nothing() -> None:
    problems = ConfigProblems()
    with problems.collect():
        pass
    assert not problems
    problems.raise_all()


def test_every_mistake_is_a_line_of_one_config_error() -> None:
    problems = ConfigProblems()
    with problems.collect():
        raise ConfigError("f.yaml: a: wrong")
    problems.add("f.yaml: b: wrong too")
    assert problems.attempt(lambda: int("3"), 0) == 3
    with problems.collect():
        raise ConfigError("f.yaml: c: one\nf.yaml: d: two")  # one already listing two

    with pytest.raises(ConfigError) as error:
        problems.raise_all()

    assert type(error.value) is ConfigError
    assert str(error.value).splitlines() == [
        "f.yaml: a: wrong",
        "f.yaml: b: wrong too",
        "f.yaml: c: one",
        "f.yaml: d: two",
    ]


def test_a_single_mistake_is_raised_as_it_was() -> None:
    problems = ConfigProblems()
    original = InvalidArgument("f.yaml: memory: expected a whole number")

    def check() -> int:
        raise original

    assert problems.attempt(check, None) is None

    with pytest.raises(InvalidArgument) as error:
        problems.raise_all()

    assert error.value is original


def test_other_exceptions_are_not_swallowed() -> None:
    problems = ConfigProblems()
    with pytest.raises(KeyError), problems.collect():
        raise KeyError("a bug is not a mistake of the user's")
    assert not problems
