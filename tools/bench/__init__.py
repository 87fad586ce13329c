"""The benchmark package: ``python -m tools.bench --help`` (and ``tools/benchmark.py``); docs/performance.md.

``__main__`` runs the suite's sections and the tools; each section module measures and returns its figures as plain
data, tables included, which ``common.render`` turns into markdown. Workers are the test harness's pools
(``tests.harness.WorkerGroup``, through ``common.Pool``).
"""
