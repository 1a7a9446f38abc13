"""Modules an inference server imports too: this directory is put on its PYTHONPATH.

Each one needs only the standard library and torch (the server's own
environment has no rlgate); their top-level names start with `rlgate_`.
"""
