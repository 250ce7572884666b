"""``deferral health``: a readiness probe for ``exec`` probes (exit 0 ready, 1 not)."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import click

from engine.cli.common import TEXT, _run, _settings
from engine.config import Settings
from engine.runtime.health import DB_TIMEOUT_S

#: How long the probe waits for the process's answer.
PROBE_TIMEOUT_S = 5.0


def _probe_url(url: str, path: str) -> tuple[bool, str]:
    target = f"{url.rstrip('/')}{path}?verbose"
    try:
        with urllib.request.urlopen(target, timeout=PROBE_TIMEOUT_S) as reply:
            return reply.status == 200, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return False, exc.read().decode(errors="replace")
    except (OSError, ValueError) as exc:
        return False, f"cannot reach {target}: {exc}\n"


async def _probe_database(settings: Settings) -> tuple[bool, str]:
    import anyio

    from engine.store import open_store

    try:
        with anyio.fail_after(DB_TIMEOUT_S + 4):
            store = await open_store(settings, migrate=False)
            try:
                await store.now()
            finally:
                await store.close()
    except Exception as exc:
        return False, f"[-]database failed: {type(exc).__name__}: {exc}\nnot ready\n"
    return True, "[+]database ok\nready\n"


@click.command()
@click.option(
    "--url",
    type=TEXT,
    help="A process's metrics server, http://HOST:PORT (default: http://127.0.0.1:"
    "METRICS_PORT when the setting metrics_port is set; without one, the database is checked "
    "directly).",
)
@click.option("--live", is_flag=True, help="Ask /livez (the loop answers) instead of /readyz.")
@click.pass_context
def health(ctx: click.Context, url: str | None, live: bool) -> None:
    """Exit 0 when the process is ready (its /readyz answers 200), else 1; the checks are
    printed. For exec probes; HTTP probes ask /livez and /readyz on the metrics port."""
    settings = _settings(ctx)
    if url is None and settings.metrics_port:
        url = f"http://127.0.0.1:{settings.metrics_port}"
    if url is not None:
        ok, text = _probe_url(url, "/livez" if live else "/readyz")
    elif live:
        raise click.UsageError("--live needs --url (or the setting metrics_port)")
    else:
        ok, text = _run(_probe_database, settings)
    (sys.stdout if ok else sys.stderr).write(text)
    sys.exit(0 if ok else 1)
