"""The ``llamapool`` command and its process plumbing.

Signals, systemd notification, logging setup, the supervisor of ``up``, the
gunicorn launcher, the load generator and the test-model writer. Imports run
one way: ``protocol <- workers <- frontend <- llamapool``.
"""
