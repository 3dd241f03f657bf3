"""Latency: timing samples, statistics, budgets, stored baselines and their comparison.

Pure bookkeeping with no VM in sight, so the plugin and the CLI can gate a
run on its figures: timings (samples), stats, budgets, runs (stored runs),
compare (two runs compared), shards (the runs of parallel shards merged),
html_report (one run drawn as a self-contained HTML page).

Layer 3 of docs/ARCHITECTURE.md, beside storage. May import: the foundation
(errors, paths, private, processes, sizes, tables, version, waiting), guest,
image and engine (today it needs only the foundation). Never storage, core or
anything above (checked by tests/unit/test_layers.py).
"""
