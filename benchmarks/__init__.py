"""The performance checks (run as ``python benchmarks/<name>.py``); a package so that tests and scripts can do
``from benchmarks import profiling``. The experiments are in ``experiments/``."""
