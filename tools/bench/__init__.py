"""The benchmark package (``python -m tools.bench --help``; docs/performance.md): each section module returns its
figures as plain data, tables included, which ``common.render`` turns into markdown. Functions named ``case_*`` run in
the worker processes (tests/harness.py's convention); the rest in the driver."""
