"""The sections of ``tools/benchmark.py`` (issue 6). Run ``python tools/benchmark.py --help``; see docs/performance.md.

Modules: ``common`` (machine description, statistics, worker processes), ``train_step`` (section 1, and the gloo
collective counts of section 3), ``memory`` (section 2), ``communication`` (section 3), ``xla_graphs`` (section 4),
``merge`` (section 5, a wrapper around tools/bench_merge.py), ``async_save`` (section 8).

Nothing here imports torch at module level: worker processes import it themselves, after setting their thread counts,
so that every competitor's memory baseline is taken after the same imports.
"""
