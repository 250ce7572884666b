"""``deferral webserver``: the status page."""

from __future__ import annotations

import os

import click

from engine.cli.common import TEXT, _run, _settings, _usage_exit


@click.command()
@click.option(
    "--host",
    type=TEXT,
    help="Address to listen on (default 127.0.0.1, setting webserver_host; any other "
    "exposes the page to the network).",
)
@click.option(
    "--port",
    type=click.IntRange(min=0, max=65535),
    help="Port to listen on (default 8793, setting webserver_port; 0: any free port).",
)
@click.option(
    "--enable-actions",
    is_flag=True,
    help="Offer the actions (clear, mark success/failed, pause, cancel a trigger), each "
    "needing the token of DEFERRAL_WEBSERVER_TOKEN and written to the audit table. Without "
    "it the page is read-only.",
)
@click.pass_context
def webserver(ctx: click.Context, host: str | None, port: int | None, enable_actions: bool) -> None:
    """Serve the status page: fleet, DAGs, runs, task tries, triggers.

    Server-rendered HTML that refreshes itself every 2 s (and works, without the refresh,
    with JavaScript off). Read-only unless --enable-actions."""
    from engine.web.actions import TOKEN_ENV
    from engine.web.server import run_webserver

    token = None
    if enable_actions:
        token = os.environ.get(TOKEN_ENV, "")
        if not token.strip():
            _usage_exit(f"--enable-actions needs a token: set {TOKEN_ENV} (the actions' password)")
    settings = _settings(ctx).replace(webserver_host=host, webserver_port=port)
    _run(run_webserver, settings, token)
