"""Helpers shared by tests and benchmarks: local stand-ins for services mailpipe calls."""
