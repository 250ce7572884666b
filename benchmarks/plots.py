"""Figures of benchmark results: ``deferral bench plot RESULT.json`` draws a saved result (of
``bench waits``, ``bench fleet`` or ``bench throughput``) as a PNG, and
:func:`require_matplotlib` makes ``--plot`` fail before a run starts when the ``plot`` extra
is not installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

__all__ = ["INSTALL_HINT", "plot", "plot_result", "plot_waits_summary", "require_matplotlib"]

#: What to run for the figures.
INSTALL_HINT = "pip install 'deferral[plot]'"


def require_matplotlib(option: str = "--plot") -> None:
    """A usage error (exit 2) naming the ``plot`` extra when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.UsageError(f"{option} needs matplotlib: {INSTALL_HINT}") from None


def _kind(result: Any) -> str | None:
    if not isinstance(result, dict):
        return None
    if isinstance(result.get("modes"), dict) and "sensors" in result:
        return "fleet"
    if "triggers" in result and isinstance(result.get("resume_latency_ms"), dict):
        return "waits"
    if isinstance(result.get("engine"), dict) or isinstance(result.get("sweep"), list):
        return "throughput"
    return None


#: The stages of a wait, in order, as ``bench waits`` reports them (key, label).
_WAITS_STAGES = (
    ("floor_fire_lateness_ms", "floor: bare asyncio.sleep lateness"),
    ("fire_lateness_ms", "fire lateness (timer -> trigger event)"),
    ("fire_to_event_written_ms", "event -> written to the database"),
    ("event_written_to_worker_claim_ms", "written -> claimed by a worker"),
    ("worker_claim_to_method_ms", "claimed -> resumed method starts"),
    ("resume_latency_ms", "due -> resumed method starts (total)"),
)


def plot_waits_summary(result: dict[str, Any], path: str | Path) -> None:
    """Percentiles of each stage of a wait, and memory per wait against the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [(key, label) for key, label in _WAITS_STAGES if isinstance(result.get(key), dict)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.27
    for i, quantile in enumerate(("p50", "p99", "max")):
        values = [float(result[key].get(quantile) or 0) for key, _ in stages]
        left.barh(
            [n + (i - 1) * width for n in range(len(stages))], values, height=width, label=quantile
        )
    left.set_yticks(range(len(stages)), [label for _, label in stages])
    left.invert_yaxis()
    left.set_xscale("symlog", linthresh=1)
    left.set_xlabel("ms")
    left.legend(ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    left.grid(axis="x", alpha=0.3)
    memory = [
        ("floor", result.get("floor_rss_per_wait_bytes")),
        ("triggerer", result.get("rss_per_wait_bytes")),
    ]
    shown = [(name, float(value)) for name, value in memory if isinstance(value, int | float)]
    right.bar([name for name, _ in shown], [value for _, value in shown], color="tab:gray")
    right.set_ylabel("RSS per wait (bytes)")
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"bench waits: {result['triggers']:,} timers, {result.get('triggerers', 1)} "
        f"triggerer(s), window {result.get('window_s', '?')} s, {result.get('loop', '')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_result(result: dict[str, Any], path: str | Path) -> str:
    """Draw a saved result to ``path``; returns which benchmark it was."""
    kind = _kind(result)
    if kind == "fleet":
        from benchmarks.fleet_run import plot_slots

        plot_slots(result, str(path))
    elif kind == "waits":
        plot_waits_summary(result, path)
    elif kind == "throughput":
        from benchmarks.throughput_run import plot_sweep

        plot_sweep(result, str(path))
    else:
        raise ValueError("not a result of bench waits, bench fleet or bench throughput")
    return kind


@click.command("plot")
@click.argument("result_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the PNG here (default: the result file with .png).",
)
def plot(result_file: Path, out: Path | None) -> None:
    """Draw a saved result of `bench waits`, `fleet` or `throughput` (--out JSON) as a PNG.

    A waits result gives the percentiles of each stage of a wait and the memory per wait
    against the floor; a fleet result, the worker slots held over time in each mode; a
    throughput result, items per second against N for each engine."""
    require_matplotlib("bench plot")
    try:
        result = json.loads(result_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise click.BadParameter(f"cannot read JSON: {exc}", param_hint="RESULT_FILE") from None
    if _kind(result) is None:
        raise click.BadParameter(
            "not a result of bench waits, bench fleet or bench throughput (their --out JSON)",
            param_hint="RESULT_FILE",
        )
    target = out if out is not None else result_file.with_suffix(".png")
    kind = plot_result(result, target)
    click.echo(f"wrote {target} ({kind})")
