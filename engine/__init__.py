"""deferral: an engine for tasks that spend most of their life waiting.

Public names: :class:`DAG`, :class:`Variable` and :class:`Connection` (what task code reads at
run time: ``Variable.get("bucket")``, ``Connection.get("warehouse")``), :class:`Settings` and
:func:`load_settings`; :class:`DeadlineAlert` and :class:`DeadlineReference`
(``DAG(deadline=...)``); TaskFlow's :data:`task` decorator, :func:`get_current_context` and
:class:`XComArg`; assets: :class:`Asset`, :class:`AssetAll`, :class:`AssetAny`,
:class:`AssetWatcher`. The processes
(``engine.worker.worker.Worker``, ``engine.triggerer.Triggerer``,
``engine.scheduler.scheduler.Scheduler``) and the store (``engine.store``) are importable from their
modules.
"""

from __future__ import annotations

from engine.config import Settings, load_settings
from engine.dags.dag import DAG
from engine.dags.deadline import DeadlineAlert, DeadlineReference
from engine.usercode.variables import Variable
from engine.version import __version__
from operators.assets import Asset, AssetAll, AssetAny, AssetWatcher
from operators.taskflow import PokeReturnValue, task
from operators.xcom import XComArg, get_current_context
from triggers.connections import Connection

__all__ = [
    "DAG",
    "Asset",
    "AssetAll",
    "AssetAny",
    "AssetWatcher",
    "Connection",
    "DeadlineAlert",
    "DeadlineReference",
    "PokeReturnValue",
    "Settings",
    "Variable",
    "XComArg",
    "__version__",
    "get_current_context",
    "load_settings",
    "task",
]
