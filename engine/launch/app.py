"""Build and run the engine's processes from settings (what the CLI commands call)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
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
from engine.runtime.heap import settle_heap
from engine.runtime.listen import (
    LISTEN_FD_ENV,
    ListenError,
    bound_port,
    inherited_socket,
    listen,
    listen_url,
)
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
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.scheduler import Scheduler
from engine.security.allow import TriggerAllowList
from engine.security.keys import child_key_env
from engine.store import Store, database_url, open_store
from engine.store.endpoints import advertised
from engine.triggerer import Triggerer
from engine.triggerer.config import TriggererConfig
from engine.usercode.loglimits import LogLimits
from engine.usercode.variables import bind_store
from engine.worker.config import WorkerConfig
from engine.worker.worker import Worker
from triggers.connections import DEFAULT_DEFERRAL_CONN_ID, connection_defaults

__all__ = [
    "Child",
    "dag_bag",
    "engine_connections",
    "log_limits",
    "make_scheduler",
    "make_triggerer",
    "make_worker",
    "run_component",
    "spawn",
    "start_child",
    "stop_children",
    "trigger_allow_list",
]

log = logging.getLogger(__name__)


def trigger_allow_list(settings: Settings) -> TriggerAllowList:
    """The allow-list the setting ``trigger_allow`` gives (its default when unset)."""
    return TriggerAllowList.from_settings(settings)


def log_limits(settings: Settings) -> LogLimits:
    """The bounds of the stored logs the settings log_* give."""
    return LogLimits.from_settings(settings)


def dag_bag(settings: Settings) -> DagBag:
    """The DAGs of the settings' folder (setting ``dags_folder``), each file imported first
    in a child process (``dag_file_processor_timeout_s``)."""
    return DagBag(settings.dags_folder, processor_timeout_s=settings.dag_file_processor_timeout_s)


# Each process is given its config, built from the settings in one place (its config's
# ``from_settings``), and its collaborators: the store, the DAG bag, the metrics.


def make_worker(store: Store, settings: Settings, metrics: Metrics | None = None) -> Worker:
    return Worker(store, dag_bag(settings), WorkerConfig.from_settings(settings), metrics=metrics)


def make_triggerer(store: Store, settings: Settings, metrics: Metrics | None = None) -> Triggerer:
    add_to_sys_path(settings.dags_folder)
    return Triggerer(store, TriggererConfig.from_settings(settings), metrics=metrics)


def make_scheduler(store: Store, settings: Settings, metrics: Metrics | None = None) -> Scheduler:
    # A custom timetable's class is imported by path under the trigger classpaths' rule.
    allow_custom_timetables(trigger_allow_list(settings))
    return Scheduler(
        store,
        dag_bag(settings) if settings.dags_folder else None,
        SchedulerConfig.from_settings(settings),
        metrics=metrics,
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


#: The process kinds whose pool is opened in full at start and kept (latency is their product).
_WARM_POOL = frozenset({"worker", "triggerer"})

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
    sock = inherited_socket() or _metrics_socket(settings)
    metrics = use_metrics(Metrics(max_series=settings.metrics_max_series, kind=kind))
    # Workers and triggerers open their whole pool now: a burst of resumes or events must not
    # wait for new connections (see create_pool).
    store = await open_store(settings, warm=kind in _WARM_POOL)
    try:
        await _prime(kind, store)
        made = _MAKERS[kind](store, settings, metrics)
        if isinstance(made, Worker):
            # (Its modules frozen out of the cycle collector's passes; the DAGs it imports
            # next are not, so that a DAG file that changes leaves nothing behind.)
            settle_heap()
            await _import_dags(made)
        component: Component = made
        where: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()
        if sock is not None:
            checks = {"database": database_check(store.now), **made.health_checks()}
            port = bound_port(sock)
            server = HealthServer(
                metrics, host=settings.metrics_host, port=port, checks=checks, sock=sock
            )
            component = WithHealth(made, server)
            # (`deferral status` says where it listens.)
            url = listen_url(settings.metrics_host, port, "/metrics")
            where = advertised(store, "metrics", kind, url)
        # The connection id "deferral" (TaskStateTrigger, ExternalTaskSensor) is this database,
        # also when it is the embedded server, whose URL is known only now. (Operators read
        # default_deferrable from their context: the worker puts it there.)
        with engine_connections(store):
            async with where:
                cancelled = await serve([component], supervisor=supervisor)
    finally:
        with anyio.move_on_after(5, shield=True):
            await store.close()
    if cancelled:
        exit_without_threads()


async def _prime(kind: str, store: Store) -> None:
    """The hot statements of a worker or a triggerer run once on each connection of its pool
    (``prime_worker_connections``): the first burst meets warm backends. Only latency depends
    on it, so a failure is a warning."""
    prime = {
        "worker": store.prime_worker_connections,
        "triggerer": store.prime_triggerer_connections,
    }.get(kind)
    if prime is None:
        return
    try:
        await prime()
    except Exception as exc:  # (the process runs all the same, its first burst slower)
        log.warning("could not prime the database connections: %s: %s", type(exc).__name__, exc)


async def _import_dags(worker: Worker) -> None:
    """A worker imports its DAGs folder before it claims anything. Else it imports a DAG at
    the first try of it that it claims, and every try of that DAG it claimed meanwhile waits,
    holding its pool's slots: a worker that ran none of a fleet's deferrals (the other took
    them all) met the first due resumes with a 1,000-task DAG file to import. A file that
    fails is an import error, as it would be at the first try (and a slow one goes on in its
    own child, see ``DagBag.collect``)."""
    try:
        await anyio.to_thread.run_sync(functools.partial(worker.dagbag.collect, wait_slow=False))
    except Exception as exc:  # (its tries import it again, and fail as they would have)
        log.warning("could not import the DAGs folder: %s: %s", type(exc).__name__, exc)


def _metrics_socket(settings: Settings) -> socket.socket | None:
    """The metrics server's socket when the settings ask for one (``metrics_port``; 0: a free
    port). A port that cannot be bound is logged: the process runs on without metrics."""
    if settings.metrics_port is None:
        return None
    try:
        return listen(settings.metrics_host, settings.metrics_port)
    except ListenError as exc:
        log.error("cannot serve metrics: %s; running without them", exc.strerror)
        return None


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
    sock: socket.socket | None = None,
) -> Child:
    """Start ``deferral <kind>`` as a child process on the same database and DAGs folder
    (supervised: see ``start_child``). ``sock``: a listening socket the child serves on (its
    metrics server, or the status page), bound here already."""
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
    return start_child([kind, *extra], child_env, stderr=stderr, sock=sock)


def start_child(
    args: Sequence[str],
    env: dict[str, str],
    *,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
    sock: socket.socket | None = None,
) -> Child:
    """Start ``python -m engine <args>`` with the environment ``env``, supervised.

    The child runs in a new session (a terminal's SIGINT goes to the caller only) and is
    stopped through a pipe (``Child.ask``, ``stop_children``); it stops gracefully by itself
    when the caller dies, however it dies, and the pipe closes. ``sock``: a listening socket
    it serves on."""
    child_env = dict(env)
    read_end, write_end = os.pipe()
    child_env[SUPERVISOR_FD_ENV] = str(read_end)
    passed = [read_end]
    if sock is not None:
        child_env[LISTEN_FD_ENV] = str(sock.fileno())
        passed.append(sock.fileno())
    try:
        child = Child(
            [sys.executable, "-m", "engine", *args],
            env=child_env,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            pass_fds=tuple(passed),
            start_new_session=True,
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    child.kind = args[0]
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
