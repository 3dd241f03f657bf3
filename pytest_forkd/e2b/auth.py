"""Who may call what: the API key, each sandbox's access tokens, signed file URLs, the user of a call.

The SDKs send the API key as ``X-API-Key`` on every call of the sandbox API;
in-sandbox calls carry the sandbox's ``X-Access-Token`` (envd) or
``E2B-Traffic-Access-Token`` (the code interpreter's port), both handed out
when the sandbox is created; download and upload URLs are signed with the
envd token (``v1_`` + SHA-256 of ``path:operation:user:token[:expiration]``,
as ``e2b/sandbox/signature.py`` makes them). Every comparison is constant
time. The user a call runs as travels as HTTP basic auth with an empty
password (``e2b/envd/utils.py``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import string
import time
from collections.abc import Mapping

from pytest_forkd.e2b.api_errors import ApiError

_ID_ALPHABET = string.ascii_lowercase + string.digits
API_KEY_HEADER = "x-api-key"
ACCESS_TOKEN_HEADER = "x-access-token"
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"


def new_id(length: int = 20) -> str:
    """A sandbox id as E2B's look: lowercase letters and digits, unguessable."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


def new_token() -> str:
    return secrets.token_urlsafe(32)


def same(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def check_api_key(headers: Mapping[str, str], api_key: str) -> None:
    """401 (AuthenticationException in the SDKs) unless the request carries the server's key."""
    given = headers.get(API_KEY_HEADER)
    if given is None:
        raise ApiError(401, "missing API key: set E2B_API_KEY to the key `forkd e2b serve` printed")
    if not same(given, api_key):
        raise ApiError(401, "invalid API key: use the key `forkd e2b serve` printed (E2B_API_KEY)")


def user_of(headers: Mapping[str, str]) -> str | None:
    """The user a call runs as (``Authorization: Basic base64(user:)``); None: the sandbox's default user."""
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, encoded = value.partition(" ")
    if scheme.lower() != "basic":
        raise ApiError(400, f"unsupported Authorization scheme {scheme!r}: envd takes `Basic base64(user:)`")
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise ApiError(400, "malformed Authorization header: expected Basic base64(user:)") from None
    user = decoded.partition(":")[0]
    if not user or len(user) > 64 or not all(c.isalnum() or c in "._-" for c in user):
        raise ApiError(400, f"malformed user name {user!r} in the Authorization header")
    return user


def signature_of(path: str, operation: str, user: str | None, token: str, expiration: int | None) -> str:
    """The signature the SDK puts on a file URL (``e2b/sandbox/signature.py``)."""
    raw = f"{path}:{operation}:{user or ''}:{token}" + (f":{expiration}" if expiration is not None else "")
    digest = hashlib.sha256(raw.encode("utf-8")).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def signature_valid(
    signature: str, path: str, operation: str, user: str | None, token: str, expiration: str | None
) -> bool:
    """Whether ``signature`` signs this file operation with ``token`` and has not expired."""
    expires: int | None = None
    if expiration:
        try:
            expires = int(expiration)
        except ValueError:
            return False
        if expires < time.time():
            return False
    return same(signature, signature_of(path, operation, user, token, expires))
