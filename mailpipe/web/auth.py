"""Who may use the console: HTTP basic auth against MAILPIPE_WEB_OPERATORS and _VIEWERS, and the
CSRF token every action's form carries.

The CSRF token is an HMAC of the user's name under a secret (MAILPIPE_WEB_SECRET, or one drawn at
start). Basic auth is what a forged request rides on: the browser adds the credentials to any
request for this origin, including a form another site posts. That site cannot send the token:
it cannot read the console's pages (the same-origin policy), and cannot compute the token
without the secret. So an HMAC needs no session store, and checking it with `compare_digest`
tells an attacker nothing about its bytes. It is the same for every page a user opens until the
secret changes (a restart, when it is drawn), which is what a user who signs in on every request
has instead of a session.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass

from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    SimpleUser,
)
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection

from mailpipe.settings import Settings, web_users

READ = "read"
ACT = "act"
OPEN_PATHS = ("/healthz",)


@dataclass(frozen=True)
class Account:
    password: str  # plain, or a bcrypt or argon2 hash
    scopes: tuple[str, ...]


def accounts(settings: Settings) -> dict[str, Account]:
    operators = web_users(settings.web_operators, "MAILPIPE_WEB_OPERATORS")
    viewers = web_users(settings.web_viewers, "MAILPIPE_WEB_VIEWERS")
    found = {user: Account(password, (READ,)) for user, password in viewers}
    found |= {user: Account(password, (READ, ACT)) for user, password in operators}
    return found


def matches(password: str, stored: str) -> bool:
    """Whether `password` is the one `stored` holds, plain or hashed."""
    if stored.startswith(("$2a$", "$2b$", "$2y$")):
        import bcrypt

        try:
            return bcrypt.checkpw(password.encode(), stored.encode())
        except ValueError:  # over bcrypt's 72 bytes, or a malformed hash
            return False
    if stored.startswith("$argon2"):
        from argon2 import PasswordHasher
        from argon2.exceptions import InvalidHashError, VerificationError

        try:
            return PasswordHasher().verify(stored, password)
        except (VerificationError, InvalidHashError):
            return False
    return hmac.compare_digest(password.encode(), stored.encode())


LOCAL_USER = "local"


class BasicAuth(AuthenticationBackend):
    """Every request but /healthz signs in; a hash is checked once per process and password (a
    bcrypt check costs a quarter of a second, and basic auth signs in on every request).

    With no user at all, which only loopback allows (`mailpipe.web.server.refusal`), every
    request is the local operator's, as Flower is open on loopback.
    """

    def __init__(self, users: dict[str, Account], secret: bytes) -> None:
        self._users = users
        self._secret = secret
        self._verified: set[bytes] = set()
        self._lock = threading.Lock()

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        if conn.url.path in OPEN_PATHS:
            return None
        if not self._users:
            return AuthCredentials([READ, ACT]), SimpleUser(LOCAL_USER)
        user, password = _credentials(conn.headers.get("authorization", ""))
        account = self._users.get(user)
        if account is None or not await run_in_threadpool(self._check, user, password, account):
            raise AuthenticationError("sign in as a viewer or an operator")
        return AuthCredentials(list(account.scopes)), SimpleUser(user)

    def _check(self, user: str, password: str, account: Account) -> bool:
        # The key is an HMAC, so that the set holds no password.
        key = hmac.digest(self._secret, f"{user}\0{password}".encode(), hashlib.sha256)
        with self._lock:
            if key in self._verified:
                return True
        if not matches(password, account.password):
            return False
        with self._lock:
            if len(self._verified) > 10_000:  # bounded whatever is tried
                self._verified.clear()
            self._verified.add(key)
        return True


def _credentials(header: str) -> tuple[str, str]:
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return "", ""
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return "", ""
    user, _, password = decoded.partition(":")
    return user, password


def secret_of(settings: Settings) -> bytes:
    """MAILPIPE_WEB_SECRET, or a random one for this process."""
    if settings.web_secret is not None:
        return settings.web_secret.get_secret_value().encode()
    return secrets.token_bytes(32)


def csrf_token(secret: bytes, user: str) -> str:
    return hmac.new(secret, f"csrf\0{user}".encode(), hashlib.sha256).hexdigest()


def csrf_valid(secret: bytes, user: str, token: str) -> bool:
    return hmac.compare_digest(csrf_token(secret, user).encode(), token.encode())
