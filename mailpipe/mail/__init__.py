"""The email itself: MIME parsing and text decoding, and attached documents turned into text.
Pure functions of bytes and limits: no database, no Redis, no Celery."""
