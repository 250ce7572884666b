"""Benchmark scenarios, run by ``deferral bench ...`` or ``python -m benchmarks ...``.

Each scenario is a module here that defines one click command (``@click.command("<name>")``)
and imports nothing of :mod:`benchmarks.cli`; :mod:`benchmarks.cli` imports it and adds it to
the ``bench`` group (``bench.add_command(<command>)``, one line per scenario). Results are JSON
(stdout or ``--out``), with a table on the terminal.
"""
