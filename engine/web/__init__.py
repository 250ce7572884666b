"""The status page: ``deferral webserver`` (aiohttp, server-rendered Jinja2 HTML).

* ``render`` — the autoescaping template environment and the filters the pages share;
* ``views`` — one function per page: what it reads from the store, as a template context;
* ``actions`` — the POST actions (only with ``--enable-actions`` and the token), audited;
* ``hooks`` — what other parts of the engine fill in (why a task is not running, log lines);
* ``app`` — the aiohttp application and its routes; ``server`` — running it.

Pages refresh themselves with ``static/live.js`` (a few lines: it fetches the page again and
swaps the regions marked ``data-live``); without JavaScript they are plain pages and links.
"""
