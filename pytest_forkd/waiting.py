"""One way to wait: poll a predicate until it holds, with a deadline and backoff.

Every wait in forkd (a QMP status, a snapshot another process is still
writing, a guest port that starts listening, a migration, a pool refill)
goes through :func:`poll_until`, built on tenacity, so each has a deadline,
backs off instead of spinning, and fails with a :class:`~pytest_forkd.errors.WaitTimeout`
(or the caller's error) naming what it waited for, never with a bare
``RetryError`` or an endless loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryError,
    Retrying,
    retry_base,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    stop_never,
    wait_exponential,
    wait_fixed,
)

from pytest_forkd.errors import InvalidArgument, WaitTimeout

T = TypeVar("T")

__all__ = ["poll_until"]


def poll_until(
    predicate: Callable[[], T | None],
    *,
    timeout: float | None,
    what: str,
    interval: float = 0.01,
    backoff: float | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
    error: Callable[[str], BaseException] = WaitTimeout,
) -> T:
    """Call ``predicate`` until it returns a true value, and return that value.

    Waits ``interval`` seconds between calls, or with ``backoff`` set, starts
    at ``interval`` and doubles up to ``backoff`` seconds. ``timeout`` is the
    deadline in seconds (``None``: wait as long as it takes). Exceptions of
    the types in ``retry_on`` count as "not yet"; any other propagates at
    once. When the deadline passes, raises ``error(message)`` (default
    :class:`~pytest_forkd.errors.WaitTimeout`), the message saying
    "timed out after N s waiting for ``what``" and, if an attempt failed,
    its last exception; the exception keeps it as ``last_error`` too.
    """
    if timeout is not None and timeout < 0:
        raise InvalidArgument(f"timeout={timeout!r} waiting for {what}: give a number of seconds >= 0, or None")
    if interval <= 0 or (backoff is not None and backoff < interval):
        raise InvalidArgument(
            f"interval={interval!r}, backoff={backoff!r} waiting for {what}: give interval > 0 "
            "and backoff >= interval (or no backoff)"
        )
    wait = wait_fixed(interval) if backoff is None else wait_exponential(multiplier=interval, min=interval, max=backoff)
    retry: retry_base = retry_if_result(lambda value: not value)
    if retry_on:
        retry = retry | retry_if_exception_type(retry_on)
    retrying = Retrying(
        stop=stop_never if timeout is None else stop_after_delay(timeout), wait=wait, retry=retry, reraise=False
    )
    try:
        value = retrying(predicate)
    except RetryError as exc:
        last = exc.last_attempt.exception() if exc.last_attempt.failed else None
        message = f"timed out after {timeout:g} s waiting for {what}"
        if last is not None:
            message += f" (last attempt: {type(last).__name__}: {last})"
        failure = error(message)
        setattr(failure, "last_error", last)  # noqa: B010 - any exception type the caller chose
        raise failure from last
    assert value  # tenacity only returns a value that ended the retries
    return value
