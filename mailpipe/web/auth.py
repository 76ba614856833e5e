"""Who may use the console: HTTP basic auth against MAILPIPE_WEB_OPERATORS and _VIEWERS, and the
CSRF token every action's form carries.

Basic auth signs in on every request, and a password hash is made to be expensive (an argon2
check holds 64 MiB, a bcrypt one a CPU for a quarter of a second), so signing in is bounded
before it is checked, or a flood of wrong passwords would take the server's memory and threads:

- A password is checked against a hash by one request at a time (HASH_CHECKS); one that finds
  no slot within SLOT_WAIT is refused (503) rather than queued.
- Failed sign-ins are limited per client address and per user name (`limits`' moving window, in
  this process's memory). Past either limit, every sign-in of that address or name is refused
  (429, with Retry-After), its right password too: otherwise the limit would still answer
  whether a guess is right.
- A user and password refused once are refused again without a hash for REFUSED_FOR; the right
  ones are accepted without one. Both caches are bounded and keyed by an HMAC (no password held).
- An unknown user's password is checked against a dummy hash of the accounts' most expensive
  kind and cost, so that refusing it takes as long as refusing a known user's.

The CSRF token is the user's name and the time it was made, signed under a secret
(MAILPIPE_WEB_SECRET, or one drawn at start) by itsdangerous. Basic auth is what a forged
request rides on: the browser adds the credentials to any request for this origin, including a
form another site posts. That site cannot send the token: it cannot read the console's pages
(the same-origin policy), and cannot sign one without the secret. So the token needs no session
store. It lasts CSRF_MAX_AGE, so that one that leaks (a saved page) stops working; every page
carries a fresh one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from cachetools import LRUCache, TTLCache
from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer
from limits import RateLimitItem, parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    SimpleUser,
)
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection

from mailpipe.settings import Settings, web_tokens, web_users

log = logging.getLogger("mailpipe.web")

READ = "read"
ACT = "act"
OPEN_PATHS = ("/healthz",)
SIGN_IN = "sign in as a viewer or an operator"

# One check at a time: the web task has a quarter of a CPU, so a second check alongside would
# only halve the speed of both, and would double the memory argon2 holds (64 MiB each).
HASH_CHECKS = 1
SLOT_WAIT = 2.0  # seconds
FAILURES_PER_ADDRESS = parse("20/minute")
FAILURES_PER_USER = parse("10/minute")
# A refused pair stays wrong for the process's life (its accounts are fixed at start): the time
# and the count bound only the memory, ~3 MB when full.
REFUSED_FOR = 600.0  # seconds
REFUSED_KEPT = 10_000
CSRF_MAX_AGE = 8 * 3600  # seconds: a working day's page, not last week's


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


def dummy_hash(stored: Iterable[str]) -> str:
    """A hash of a random password, of the kind and cost of whichever of `stored` takes longest
    to check (each kind and cost timed once, by making its dummy): an unknown user's password is
    checked against it. Plain passwords alone get a random plain one."""
    password = secrets.token_urlsafe(32)
    made: dict[str, tuple[float, str]] = {}
    for each in stored:
        kind = _kind_and_cost(each)
        if kind not in made:
            started = time.perf_counter()
            dummy = _hash_like(each, password)
            made[kind] = (time.perf_counter() - started, dummy)
    return max(made.values(), default=(0.0, password))[1]


def _kind_and_cost(stored: str) -> str:
    """`stored` without its salt and hash: `$2b$12`, `$argon2id$v=19$m=65536,t=3,p=4`, `plain`."""
    if stored.startswith("$2"):
        return stored.rsplit("$", 1)[0]
    if stored.startswith("$argon2"):
        return stored.rsplit("$", 2)[0]
    return "plain"


def _hash_like(stored: str, password: str) -> str:
    """`password` hashed as `stored` was; a malformed hash, refused at once, gets a plain one."""
    if stored.startswith("$2"):
        import bcrypt

        try:
            rounds = int(stored.split("$")[2])
            return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()
        except (IndexError, ValueError):
            return password
    if stored.startswith("$argon2"):
        from argon2 import PasswordHasher, extract_parameters
        from argon2.exceptions import InvalidHashError

        try:
            return PasswordHasher.from_parameters(extract_parameters(stored)).hash(password)
        except InvalidHashError:
            return password
    return password


class SignInRefused(AuthenticationError):
    """A sign-in refused before its password was checked: `status` 429 (too many failures) or
    503 (no slot to check it in), to be tried again after `retry_after` seconds."""

    def __init__(self, status: int, detail: str, retry_after: int) -> None:
        super().__init__(detail)
        self.status = status
        self.retry_after = retry_after


REFUSED_AS = {"address": "from this address", "user": "for this user name"}


def _limited(address: str, user: str) -> list[tuple[RateLimitItem, str, str]]:
    """Each limit with the kind and the key it counts under."""
    return [(FAILURES_PER_ADDRESS, "address", address), (FAILURES_PER_USER, "user", user)]


class FailedSignIns:
    """Failed sign-ins in the last minute per client address and per user name."""

    def __init__(self) -> None:
        self._window = MovingWindowRateLimiter(MemoryStorage())

    def check(self, address: str, user: str) -> None:
        """Raise SignInRefused (429) if the address or the user name is past its limit."""
        for limit, kind, key in _limited(address, user):
            if not self._window.test(limit, kind, key):
                reset = self._window.get_window_stats(limit, kind, key).reset_time
                wait = max(1, math.ceil(reset - time.time()))
                raise SignInRefused(
                    429, f"too many failed sign-ins {REFUSED_AS[kind]}: try again in {wait} s", wait
                )

    def record(self, address: str, user: str, known: bool) -> None:
        for limit, kind, key in _limited(address, user):
            self._window.hit(limit, kind, key)
            if self._window.test(limit, kind, key):
                continue
            # This failure filled the window: said once each time, not on each refusal after.
            named = address if kind == "address" else repr(user) if known else "an unknown user"
            log.warning(
                "failed sign-ins %s %s reached %d a minute: its sign-ins are refused (429) until "
                "the oldest of them is a minute old",
                "from" if kind == "address" else "as",
                named,
                limit.amount,
            )


LOCAL_USER = "local"


class BasicAuth(AuthenticationBackend):
    """Every request but /healthz signs in, bounded as the module says.

    With no user at all, which only loopback allows (`mailpipe.web.server.refusal`), every
    request is the local operator's, as Flower is open on loopback.
    """

    def __init__(self, users: dict[str, Account], secret: bytes) -> None:
        self._users = users
        self._secret = secret
        self._dummy = dummy_hash(account.password for account in users.values())
        self._failures = FailedSignIns()
        self._slots = anyio.Semaphore(HASH_CHECKS)
        # A user has one right password: one entry each. The caches and the limits are read and
        # written on the event loop only; the thread pool does nothing but the hash.
        self._accepted: LRUCache[bytes, bool] = LRUCache(maxsize=max(1, len(users)))
        self._refused: TTLCache[bytes, bool] = TTLCache(maxsize=REFUSED_KEPT, ttl=REFUSED_FOR)

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        if conn.url.path in OPEN_PATHS:
            return None
        if not self._users:
            return AuthCredentials([READ, ACT]), SimpleUser(LOCAL_USER)
        user, password = _credentials(conn.headers.get("authorization", ""))
        if not user:  # a browser's first request, before it asks for a password
            raise AuthenticationError(SIGN_IN)
        address = conn.client.host if conn.client else ""
        self._failures.check(address, user)
        account = self._users.get(user)
        # The key is an HMAC, so that the caches hold no password.
        key = hmac.digest(self._secret, f"{user}\0{password}".encode(), hashlib.sha256)
        if account is not None and key in self._accepted:
            return AuthCredentials(list(account.scopes)), SimpleUser(user)
        if key not in self._refused:
            async with self._slot():
                self._failures.check(address, user)  # failures recorded while this one waited
                stored = self._dummy if account is None else account.password
                right = await run_in_threadpool(matches, password, stored)
            if right and account is not None:
                self._accepted[key] = True
                return AuthCredentials(list(account.scopes)), SimpleUser(user)
            self._refused[key] = True
        self._failures.record(address, user, known=account is not None)
        raise AuthenticationError(SIGN_IN)

    @asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        with anyio.move_on_after(SLOT_WAIT) as waiting:
            await self._slots.acquire()
        if waiting.cancelled_caught:
            wait = math.ceil(SLOT_WAIT)
            raise SignInRefused(503, f"too many sign-ins at once: try again in {wait} s", wait)
        try:
            yield
        finally:
            self._slots.release()


class TokenOrBasicAuth(AuthenticationBackend):
    """The API's sign-in: a bearer token (MAILPIPE_WEB_TOKENS), which machines use, or else
    basic auth as the pages sign in. A token is random and checked by one SHA-256, so a wrong
    one costs nothing to refuse and needs no limit."""

    def __init__(self, basic: BasicAuth, tokens: dict[str, tuple[str, tuple[str, ...]]]) -> None:
        self._basic = basic
        self._tokens = tokens  # SHA-256 hex -> (name, scopes)

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        scheme, _, token = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return await self._basic.authenticate(conn)
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        for known, (name, scopes) in self._tokens.items():
            if hmac.compare_digest(known, digest):
                return AuthCredentials(list(scopes)), SimpleUser(f"token:{name}")
        raise AuthenticationError("the bearer token is not one of MAILPIPE_WEB_TOKENS")


def tokens(settings: Settings) -> dict[str, tuple[str, tuple[str, ...]]]:
    """MAILPIPE_WEB_TOKENS as TokenOrBasicAuth reads them: by SHA-256, the name and scopes."""
    scopes = {"viewer": (READ,), "operator": (READ, ACT)}
    return {digest: (name, scopes[role]) for name, role, digest in web_tokens(settings.web_tokens)}


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
    """MAILPIPE_WEB_SECRET (at least 32 bytes: Settings checks it), or a random one for this
    process."""
    if settings.web_secret is not None:
        return settings.web_secret.get_secret_value().encode()
    return secrets.token_bytes(32)


def _csrf(secret: bytes) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(secret, salt="mailpipe.web.csrf")


def acting(request: HTTPConnection, face: str) -> str:
    """Who acts, as the actions' audit lines name them: the face (`web`, the console's forms, or
    `api`) and the user signed in."""
    return f"{face}:{request.user.username}"


def csrf_token(secret: bytes, user: str) -> str:
    """`user`'s token, made now."""
    return _csrf(secret).dumps(user)


def csrf_refusal(secret: bytes, user: str, token: object) -> str | None:
    """Why `token` is not `user`'s to act with now; None if it is."""
    if not isinstance(token, str) or not token:
        return "the form has no token: reload the page"
    try:
        signed_for = _csrf(secret).loads(token, max_age=CSRF_MAX_AGE)
    except SignatureExpired:
        return (
            f"the form's token has expired (a page's token lasts {CSRF_MAX_AGE // 3600} hours): "
            "reload the page for a fresh one"
        )
    except BadSignature:
        return "the form's token is wrong: reload the page"
    if signed_for != user:
        return "the form's token is another user's: reload the page"
    return None
