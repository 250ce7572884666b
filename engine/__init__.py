"""deferral: an engine for tasks that spend most of their life waiting.

Public names: :class:`DAG`, :class:`Settings` and :func:`load_settings`. The processes
(``engine.worker.worker.Worker``, ``engine.triggerer.Triggerer``,
``engine.scheduler.scheduler.Scheduler``) and the store (``engine.store``) are importable from their
modules.
"""

from __future__ import annotations

from engine.config import Settings, load_settings
from engine.dags.dag import DAG
from engine.version import __version__

__all__ = ["DAG", "Settings", "__version__", "load_settings"]
