"""The store's part for DAG files that fail to import: the scheduler's scan (and the commands
that parse a folder themselves) records them, ``deferral dags list`` and the status page's
banner show them until the file imports again or is gone. Mixed into
:class:`engine.store.store.Store`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from engine.store.core import StoreCore
from engine.store.models.importerrors import ImportErrorRow

__all__ = ["MAX_ERROR_CHARS", "ImportErrorRow", "ImportErrors"]

#: The most characters of one error kept (a traceback's end is what matters: it is kept).
MAX_ERROR_CHARS = 20_000


def _kept(error: str) -> str:
    error = error.replace("\x00", "\\x00")  # (no text column holds a NUL)
    if len(error) <= MAX_ERROR_CHARS:
        return error
    return "...\n" + error[-MAX_ERROR_CHARS:]


class ImportErrors(StoreCore):
    """Store methods for import errors. Expects the Store's pool and queries."""

    async def record_import_errors(
        self, folder: str, errors: Mapping[str, str], importing: Iterable[str] = ()
    ) -> tuple[int, int]:
        """Record what a scan of ``folder`` found: ``errors`` by file; the files of
        ``importing`` (still importing) keep the row they have. Returns how many rows were
        written and removed (both 0 when nothing changed)."""
        prefix = folder.rstrip("/") + "/"
        files = sorted(errors)
        row = await self._pool.fetchrow(
            self._q["record_import_errors"],
            prefix,
            files,
            [_kept(errors[f]) for f in files],
            sorted(importing),
        )
        assert row is not None
        return row["written"], row["gone"]

    async def import_errors(self, limit: int = 1000) -> list[ImportErrorRow]:
        """The files that failed to import, by path."""
        rows = await self._pool.fetch(self._q["list_import_errors"], limit)
        return msgspec.convert([dict(r) for r in rows], list[ImportErrorRow])
