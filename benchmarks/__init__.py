"""Benchmark scenarios, run by ``deferral bench ...`` or ``python -m benchmarks ...``.

Each scenario is a module here that adds a command to :data:`benchmarks.cli.bench`.
Results are JSON (stdout or ``--out``), with a table on the terminal.
"""
