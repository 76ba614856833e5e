"""What mailpipe knows of its broker, stock kombu on Redis: the queue and task names (`queues`)
and the names kombu gives its Redis keys, read by the sweeper and the heartbeat (`layout`, each
name listed there and checked by tests/unit/broker/test_layout.py)."""
