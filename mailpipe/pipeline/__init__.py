"""The job's steps as plain Python: no Celery here, so every step is tested without a broker."""
