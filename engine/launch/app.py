"""Build and run the engine's processes from settings (what the CLI commands call)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Protocol

import anyio

from engine.config import Settings
from engine.dags.dagbag import DagBag, add_to_sys_path
from engine.dags.timetables.custom import allow_custom_timetables
from engine.runtime import logs
from engine.runtime.health import Check, HealthServer, WithHealth, database_check
from engine.runtime.metrics import Metrics
from engine.runtime.metrics import use as use_metrics
from engine.runtime.runner import (
    STOP,
    SUPERVISOR_FD_ENV,
    Component,
    exit_without_threads,
    serve,
    supervisor_fd,
)
from engine.scheduler.scheduler import Scheduler
from engine.security.allow import TriggerAllowList
from engine.security.keys import child_key_env
from engine.store import Store, database_url, open_store
from engine.triggerer import Triggerer
from engine.usercode.logsink import LogLimits
from engine.usercode.variables import bind_store
from engine.worker.worker import Worker
from triggers.connections import DEFAULT_DEFERRAL_CONN_ID, connection_defaults

__all__ = [
    "Child",
    "engine_connections",
    "log_limits",
    "make_scheduler",
    "make_triggerer",
    "make_worker",
    "run_component",
    "spawn",
    "stop_children",
    "trigger_allow_list",
]

log = logging.getLogger(__name__)


def trigger_allow_list(settings: Settings) -> TriggerAllowList:
    """The allow-list the setting ``trigger_allow`` gives (its default when unset)."""
    return TriggerAllowList.from_setting(settings.trigger_allow, settings.dags_folder)


def log_limits(settings: Settings) -> LogLimits:
    """The bounds of the stored logs the settings log_* give."""
    return LogLimits(
        max_lines_per_s=settings.log_max_lines_per_s,
        max_try_bytes=settings.log_max_try_bytes,
        max_trigger_bytes=settings.log_max_trigger_bytes,
        max_line_bytes=settings.log_max_line_bytes,
        buffer_bytes=settings.log_buffer_bytes,
    )


def make_worker(store: Store, settings: Settings, metrics: Metrics | None = None) -> Worker:
    return Worker(
        store,
        DagBag(settings.dags_folder, processor_timeout_s=settings.dag_file_processor_timeout_s),
        slots=settings.worker_slots,
        queues=settings.worker_queues,
        parallelism=settings.parallelism,
        poll_interval_s=settings.worker_poll_interval_s,
        heartbeat_s=settings.worker_heartbeat_s,
        shutdown_grace_s=settings.worker_shutdown_grace_s,
        allow=trigger_allow_list(settings),
        default_deferrable=settings.default_deferrable,
        metrics=metrics,
        log_limits=log_limits(settings),
        xcom_max_bytes=settings.xcom_max_bytes,
    )


def make_triggerer(store: Store, settings: Settings, metrics: Metrics | None = None) -> Triggerer:
    add_to_sys_path(settings.dags_folder)
    return Triggerer(
        store,
        capacity=settings.triggerer_capacity,
        lease_s=settings.triggerer_lease_s,
        poll_interval_s=settings.triggerer_poll_interval_s,
        claim_batch=settings.triggerer_claim_batch,
        blocked_loop_s=settings.triggerer_blocked_loop_s,
        cleanup_timeout_s=settings.triggerer_cleanup_timeout_s,
        cancel_blocking_after=settings.triggerer_cancel_blocking_after,
        max_block_s=settings.triggerer_max_block_s,
        allow=trigger_allow_list(settings),
        dags_folder=settings.dags_folder,
        metrics=metrics,
        queues=settings.triggerer_queues,
        log_limits=log_limits(settings),
    )


def make_scheduler(store: Store, settings: Settings, metrics: Metrics | None = None) -> Scheduler:
    # A custom timetable's class is imported by path under the trigger classpaths' rule.
    allow_custom_timetables(trigger_allow_list(settings))
    return Scheduler(
        store,
        (
            DagBag(settings.dags_folder, processor_timeout_s=settings.dag_file_processor_timeout_s)
            if settings.dags_folder
            else None
        ),
        interval_s=settings.scheduler_interval_s,
        zombie_threshold_s=settings.zombie_threshold_s,
        timeout_backstop_grace_s=settings.timeout_backstop_grace_s,
        dag_rescan_interval_s=settings.dag_rescan_interval_s,
        metrics=metrics,
        log_retention_days=settings.log_retention_days,
    )


@contextlib.contextmanager
def engine_connections(store: Store) -> Iterator[None]:
    """The connections an engine on ``store`` provides to the tasks and triggers it runs
    within the block: ``deferral`` is its own database, and the connections and Variables
    stored in it (``deferral connections add``, ``deferral variables set``) are read through
    ``store`` (after the environment's ``DEFERRAL_CONN_*`` / ``DEFERRAL_VAR_*``). Entered on
    the running event loop."""
    with connection_defaults({DEFAULT_DEFERRAL_CONN_ID: store.url}), bind_store(store):
        yield


class _Probed(Component, Protocol):
    def health_checks(self) -> dict[str, Check]: ...


_MAKERS: dict[str, Callable[[Store, Settings, Metrics], _Probed]] = {
    "worker": make_worker,
    "triggerer": make_triggerer,
    "scheduler": make_scheduler,
}


async def run_component(kind: str, settings: Settings) -> None:
    """Run one process kind (worker, triggerer, scheduler) until signalled (or, started by
    ``spawn``, until its supervisor asks)."""
    logs.set_process_name(kind)
    supervisor = supervisor_fd()
    metrics = use_metrics(Metrics(max_series=settings.metrics_max_series))
    store = await open_store(settings)
    try:
        made = _MAKERS[kind](store, settings, metrics)
        component: Component = made
        if settings.metrics_port:
            checks = {"database": database_check(store.now), **made.health_checks()}
            server = HealthServer(
                metrics, host=settings.metrics_host, port=settings.metrics_port, checks=checks
            )
            component = WithHealth(made, server)
        # The connection id "deferral" (TaskStateTrigger, ExternalTaskSensor) is this database,
        # also when it is the embedded server, whose URL is known only now. (Operators read
        # default_deferrable from their context: the worker puts it there.)
        with engine_connections(store):
            cancelled = await serve([component], supervisor=supervisor)
    finally:
        with anyio.move_on_after(5, shield=True):
            await store.close()
    if cancelled:
        exit_without_threads()


class Child(subprocess.Popen[bytes]):
    """An engine process started by ``spawn``: in a session of its own, so that the
    terminal's Ctrl-C reaches only its supervisor, which asks it to stop through a pipe."""

    kind: str
    control: int | None

    def ask(self, what: bytes) -> bool:
        """Write ``runner.STOP`` or ``runner.CANCEL`` to the child; False when it is gone."""
        if self.control is None or self.poll() is not None:
            return False
        try:
            os.write(self.control, what)
        except OSError:  # BrokenPipeError: it exited meanwhile
            return False
        return True

    def close_control(self) -> None:
        if self.control is not None:
            with contextlib.suppress(OSError):
                os.close(self.control)
            self.control = None

    @property
    def label(self) -> str:
        return logs.process_label(self.kind, self.pid)


def spawn(
    kind: str,
    settings: Settings,
    *extra: str,
    env: dict[str, str] | None = None,
    stderr: IO[bytes] | None = None,
) -> Child:
    """Start ``deferral <kind>`` as a child process on the same database and DAGs folder.

    The child runs in a new session (a terminal's SIGINT goes to the caller only) and is
    stopped through a pipe (``Child.ask``, ``stop_children``); it stops gracefully by itself
    when the caller dies and the pipe closes."""
    child_env = {**os.environ, **(env or {})}
    child_env["DEFERRAL_DATABASE_URL"] = database_url(settings)
    # Handed the URL, the child sees an external database: it needs this process's keys.
    child_env.update(child_key_env(settings))
    if settings.dags_folder:
        child_env["DEFERRAL_DAGS_FOLDER"] = str(Path(settings.dags_folder).resolve())
    child_env["DEFERRAL_LOG_LEVEL"] = settings.log_level
    child_env["DEFERRAL_LOG_FORMAT"] = settings.log_format
    child_env["DEFERRAL_METRICS_HOST"] = settings.metrics_host
    if settings.trigger_allow is not None:
        child_env["DEFERRAL_TRIGGER_ALLOW"] = ",".join(settings.trigger_allow)
    read_end, write_end = os.pipe()
    child_env[SUPERVISOR_FD_ENV] = str(read_end)
    try:
        child = Child(
            [sys.executable, "-m", "engine", kind, *extra],
            env=child_env,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            pass_fds=(read_end,),
            start_new_session=True,
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    child.kind = kind
    child.control = write_end
    return child


def stop_children(children: Sequence[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """Ask every child to stop gracefully (once), wait up to ``grace_s``, then SIGKILL what
    is left."""
    for child in children:
        if isinstance(child, Child):
            if not child.ask(STOP) and child.poll() is None:
                child.terminate()
        elif child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("process %s did not stop in %.0fs; killing it", child.pid, grace_s)
            child.kill()
            child.wait()
        if isinstance(child, Child):
            child.close_control()
