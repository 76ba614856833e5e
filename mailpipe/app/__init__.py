"""The Celery face: the configuration, the task shells, the signal handlers of worker and beat
processes, and beat's scheduler. Nothing below this layer imports Celery's app."""
