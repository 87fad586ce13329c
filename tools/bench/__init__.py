"""The benchmark package behind the CLIs in tools/ (``python tools/benchmark.py --help``; docs/performance.md).

``tools/benchmark.py`` (issue 6) runs the sections, ``suite`` prints the report: ``common`` (machine description,
statistics, worker processes), ``train_step`` (section 1, and the gloo collective counts of section 3), ``memory``
(section 2), ``communication`` (section 3), ``xla_graphs`` (section 4), ``merge`` (section 5, over ``merge_timing``),
``activation_memory`` (section 6), ``zero1`` (section 7), ``async_save`` (section 8).

Measurements with a CLI of their own: ``merge_timing`` (tools/bench_merge.py), ``pretrained_loading``
(tools/bench_pretrained_loading.py), ``verification`` (tools/bench_verify.py), ``divergence``
(tools/bench_divergence.py); ``rss`` holds the memory probes they share.

The sections import torch only inside functions: worker processes import it themselves, after setting their thread
counts, so that every competitor's memory baseline is taken after the same imports. (``divergence`` runs alone and
imports torch at once, after setting its thread count.)
"""
