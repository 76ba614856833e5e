"""The `mailpipe` command line (`main`), ingest of mail files, and the demo."""
