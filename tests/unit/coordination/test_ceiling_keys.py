"""A mailbox's ceiling key: a hash of its name, never the name, on the limiter's shard."""

from __future__ import annotations

from mailpipe.coordination import redis_keys


def test_a_mailboxs_ceiling_is_keyed_by_a_hash_of_its_name_on_its_limiters_shard() -> None:
    key = redis_keys.mailbox_ceiling("model", "ceo@example.org")
    assert "ceo" not in key and "example" not in key
    assert "{model}" in key  # the limiter's hash tag: the script's keys share a shard
    assert key == redis_keys.mailbox_ceiling("model", "ceo@example.org")  # stable
    assert key != redis_keys.mailbox_ceiling("model", "cfo@example.org")
    assert key != redis_keys.mailbox_ceiling("other", "ceo@example.org")
