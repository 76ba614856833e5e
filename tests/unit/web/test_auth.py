"""The console's users and tokens (mailpipe/web/auth.py, Settings' MAILPIPE_WEB_*), without a
server: the server's own behaviour is tests/integration/test_web.py."""

from __future__ import annotations

import bcrypt
import pytest
from argon2 import PasswordHasher
from pydantic import SecretStr, ValidationError

from mailpipe.settings import Settings, web_users
from mailpipe.web.auth import ACT, READ, accounts, csrf_token, csrf_valid, matches
from mailpipe.web.server import refusal


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


def test_the_csrf_token_is_the_user_s_under_the_secret() -> None:
    token = csrf_token(b"k", "alice")
    assert csrf_valid(b"k", "alice", token)
    assert not csrf_valid(b"k", "bob", token)
    assert not csrf_valid(b"other", "alice", token)
    assert not csrf_valid(b"k", "alice", "")


def test_the_console_refuses_every_interface_without_users() -> None:
    assert refusal(Settings(web_host="127.0.0.1")) is None
    assert refusal(Settings(web_host="localhost")) is None
    assert refusal(Settings(web_host="0.0.0.0", web_operators=SecretStr("op:a"))) is None
    for host in ("0.0.0.0", "::", "10.0.0.5", "console.example"):
        reason = refusal(Settings(web_host=host))
        assert reason is not None and "MAILPIPE_WEB_OPERATORS" in reason
