"""Real processes and services for the tests, the benchmarks and the demo: `celery` workers and
beats started as an operator starts them, a PostgreSQL database of a run's own, an S3-compatible
server on loopback, and a Redis key prefix of a run's own."""
