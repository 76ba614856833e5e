"""The console's users and tokens (mailpipe/web/auth.py, Settings' MAILPIPE_WEB_*), without a
server: the server's own behaviour is tests/integration/test_web.py."""

from __future__ import annotations

import base64
import threading
import time
from typing import Any
from unittest import mock

import anyio
import bcrypt
import pytest
from argon2 import PasswordHasher
from pydantic import SecretStr, ValidationError
from starlette.requests import HTTPConnection

from mailpipe.settings import Settings, web_users
from mailpipe.web import auth
from mailpipe.web.auth import (
    ACT,
    CSRF_MAX_AGE,
    FAILURES_PER_ADDRESS,
    FAILURES_PER_USER,
    READ,
    Account,
    BasicAuth,
    SignInRefused,
    accounts,
    csrf_refusal,
    csrf_token,
    dummy_hash,
    matches,
)


def test_users_are_split_on_commas_and_an_argon2_hash_keeps_its_parameters() -> None:
    argon2 = PasswordHasher().hash("s3cret")
    assert "," in argon2
    found = web_users(SecretStr(f"alice:{argon2},bob:pa:ss"), "MAILPIPE_WEB_OPERATORS")
    assert found == [("alice", argon2), ("bob", "pa:ss")]
    assert web_users(None, "X") == [] and web_users(SecretStr(" "), "X") == []


@pytest.mark.parametrize("value", [":pw", "alice", "alice:", "alice:a,alice:b"])
def test_a_malformed_user_list_is_refused_without_its_passwords(value: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(web_operators=SecretStr(value))
    message = str(refused.value.errors()[0]["msg"])
    assert "MAILPIPE_WEB_OPERATORS" in message
    for secret in ("pw", ":a", ":b"):
        assert secret not in message


def test_a_user_is_an_operator_or_a_viewer_not_both() -> None:
    with pytest.raises(ValidationError, match="both name alice"):
        Settings(web_operators=SecretStr("alice:a"), web_viewers=SecretStr("alice:b"))
    users = accounts(Settings(web_operators=SecretStr("op:a"), web_viewers=SecretStr("vi:b")))
    assert users["op"].scopes == (READ, ACT) and users["vi"].scopes == (READ,)


def test_passwords_match_plain_bcrypt_and_argon2() -> None:
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    for stored in ("s3cret", hashed, PasswordHasher().hash("s3cret")):
        assert matches("s3cret", stored)
        assert not matches("wrong", stored)
        assert not matches("", stored)
    assert not matches("x" * 100, hashed)  # past bcrypt's 72 bytes: refused, not an error
    assert not matches("s3cret", "$argon2id$not-a-hash")


def test_the_csrf_token_is_the_user_s_under_the_secret_and_expires() -> None:
    token = csrf_token(b"k", "alice")
    assert csrf_refusal(b"k", "alice", token) is None
    assert "another user's" in str(csrf_refusal(b"k", "bob", token))
    assert "is wrong" in str(csrf_refusal(b"other", "alice", token))
    assert "is wrong" in str(csrf_refusal(b"k", "alice", token[:-1]))
    for missing in ("", None):
        assert "has no token" in str(csrf_refusal(b"k", "alice", missing))
    with mock.patch("time.time", return_value=time.time() - CSRF_MAX_AGE - 60):
        expired = csrf_token(b"k", "alice")
    assert "has expired" in str(csrf_refusal(b"k", "alice", expired))
    with mock.patch("time.time", return_value=time.time() - CSRF_MAX_AGE + 60):
        assert csrf_refusal(b"k", "alice", csrf_token(b"k", "alice")) is None


@pytest.mark.parametrize("secret", ["", "short", "x" * 31, "é" * 15])
def test_a_web_secret_under_32_bytes_is_refused(secret: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(web_secret=SecretStr(secret))
    error = refused.value.errors()[0]
    assert error["loc"] == ("web_secret",)
    assert "at least 32 bytes" in error["msg"]
    for enough in ("x" * 32, "é" * 16):  # bytes, as the key is
        assert Settings(web_secret=SecretStr(enough)).web_secret is not None
    assert Settings(web_secret=None).web_secret is None


# --- signing in, bounded: each request as AuthenticationMiddleware hands it over -----------------


async def authenticate(users: BasicAuth, user: str, password: str, address: str) -> Any:
    """`users.authenticate` of a request with these credentials from `address`: the credentials
    and the user, or the AuthenticationError it raised."""
    pair = base64.b64encode(f"{user}:{password}".encode())
    conn = HTTPConnection(
        {
            "type": "http",
            "scheme": "http",
            "server": ("console", 80),
            "path": "/",
            "query_string": b"",
            "headers": [(b"authorization", b"Basic " + pair)],
            "client": (address, 40000),
        }
    )
    try:
        return await users.authenticate(conn)
    except auth.AuthenticationError as exc:
        return exc


def sign_in(users: BasicAuth, user: str, password: str, address: str = "10.0.0.1") -> Any:
    return anyio.run(authenticate, users, user, password, address)


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stored password or hash of each password check, in order."""
    seen: list[str] = []

    def counted(password: str, stored: str) -> bool:
        seen.append(stored)
        return matches(password, stored)

    monkeypatch.setattr(auth, "matches", counted)
    return seen


def bcrypt_hash(password: str, rounds: int = 4) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()


def test_a_pair_is_checked_once_then_answered_from_the_cache(checked: list[str]) -> None:
    hashed = bcrypt_hash("right")
    users = BasicAuth({"alice": Account(hashed, (READ,))}, b"k" * 32)
    for _ in range(3):
        assert isinstance(sign_in(users, "alice", "wrong"), auth.AuthenticationError)
        credentials, user = sign_in(users, "alice", "right")
        assert user.username == "alice" and credentials.scopes == [READ]
    assert checked == [hashed, hashed]


def test_an_unknown_user_is_checked_against_a_dummy_of_the_accounts_kind(
    checked: list[str],
) -> None:
    users = BasicAuth({"alice": Account(bcrypt_hash("right", rounds=6), (READ,))}, b"k" * 32)
    refused = sign_in(users, "nobody", "right")
    assert isinstance(refused, auth.AuthenticationError) and str(refused) == auth.SIGN_IN
    [dummy] = checked
    assert dummy.startswith("$2b$06$") and not matches("right", dummy)


def test_the_dummy_is_of_the_most_expensive_kind() -> None:
    argon2 = PasswordHasher().hash("a")
    assert dummy_hash(["plain", bcrypt_hash("b"), argon2]).startswith(argon2.rsplit("$", 2)[0])
    assert dummy_hash(["plain", bcrypt_hash("b", rounds=5), bcrypt_hash("c", rounds=9)]).startswith(
        "$2b$09$"
    )
    plain = dummy_hash(["plain"])
    assert not plain.startswith("$") and len(plain) >= 32


def refused_with(result: Any, status: int) -> int:
    """The Retry-After of a SignInRefused with `status`."""
    assert isinstance(result, SignInRefused), result
    assert result.status == status, str(result)
    assert 1 <= result.retry_after <= 60
    return result.retry_after


def test_failures_are_limited_per_user_name_even_for_the_right_password(
    checked: list[str],
) -> None:
    users = BasicAuth(
        {"alice": Account("right", (READ,)), "bob": Account("pw", (READ,))}, b"k" * 32
    )
    assert not isinstance(sign_in(users, "alice", "right", "10.0.9.9"), Exception)
    for number in range(FAILURES_PER_USER.amount):
        sign_in(users, "alice", f"wrong{number}", f"10.0.0.{number}")
    for password in ("wrong-again", "right"):
        refused = sign_in(users, "alice", password, "10.0.1.1")
        refused_with(refused, 429)
        assert "for this user name" in str(refused)
    assert not isinstance(sign_in(users, "bob", "pw", "10.0.1.1"), Exception)
    assert len(checked) == 1 + FAILURES_PER_USER.amount + 1  # nothing checked once over


def test_failures_are_limited_per_client_address() -> None:
    users = BasicAuth({"alice": Account("right", (READ,))}, b"k" * 32)
    for number in range(FAILURES_PER_ADDRESS.amount):
        sign_in(users, f"nobody{number}", "wrong", "10.0.0.1")
    refused = sign_in(users, "alice", "right", "10.0.0.1")
    refused_with(refused, 429)
    assert "from this address" in str(refused)
    assert not isinstance(sign_in(users, "alice", "right", "10.0.0.2"), Exception)


def test_a_check_that_finds_no_slot_is_refused_not_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "SLOT_WAIT", 0.2)
    release = threading.Event()
    started = threading.Event()

    def slow(password: str, stored: str) -> bool:
        started.set()
        release.wait(10)
        return False

    monkeypatch.setattr(auth, "matches", slow)
    users = BasicAuth({"alice": Account("right", (READ,))}, b"k" * 32)

    async def both() -> list[Any]:
        answers: list[Any] = []

        async def one(password: str, address: str) -> None:
            answers.append(await authenticate(users, "alice", password, address))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(one, "first", "10.0.0.1")
            await anyio.to_thread.run_sync(started.wait, 10)
            await one("second", "10.0.0.2")
            release.set()
        return answers

    second, first = anyio.run(both)
    refused_with(second, 503)
    assert str(first) == auth.SIGN_IN
