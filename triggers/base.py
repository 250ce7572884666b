"""The trigger contract: what a user writes to wait on something, and what crosses to the triggerer.

A trigger is stored as a ``(classpath, kwargs)`` pair. The triggerer imports the
classpath, builds the trigger with the kwargs and runs its ``async run()``; the
first event it yields ends the wait. This module never imports the runtime
(``engine``): it is the contract both sides agree on.
"""

from __future__ import annotations

import abc
import datetime as dt
import hashlib
import importlib
import logging
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, Literal, cast

import msgspec

from triggers.values import decode_ext

__all__ = [
    "BaseEventTrigger",
    "BaseTrigger",
    "Checkpoint",
    "CursorEvent",
    "ImportPathError",
    "SerializedTrigger",
    "TaskEndEvent",
    "TaskEndState",
    "TaskFailedEvent",
    "TaskSkippedEvent",
    "TaskSuccessEvent",
    "TriggerEvent",
    "TriggerSerializationError",
    "decode_value",
    "encode_value",
    "import_object",
    "import_path_kwargs",
    "import_trigger_class",
    "rebuild_trigger",
    "validate_trigger",
]

#: Largest encoded trigger kwargs accepted at defer time.
MAX_KWARGS_BYTES = 64 * 1024
#: Largest encoded event payload a trigger may yield.
MAX_PAYLOAD_BYTES = 256 * 1024


# Sorted keys make equal kwargs encode to equal bytes, which is what the
# deduplication key and the rebuild check compare. MessagePack keeps aware
# datetimes as datetimes across the round trip (JSON would turn them to text).
def _stdlib_time(value: Any) -> Any:
    """A subclass of a stdlib time type (pendulum's DateTime, Date, Time, Duration: the
    template context's dates) as the stdlib value it stands for; anything else is refused."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            return dt.datetime.fromtimestamp(value.timestamp(), tz=dt.UTC)
        return dt.datetime(*value.timetuple()[:6], value.microsecond)
    if isinstance(value, dt.date):
        return dt.date(value.year, value.month, value.day)
    if isinstance(value, dt.time):
        return dt.time(value.hour, value.minute, value.second, value.microsecond)
    if isinstance(value, dt.timedelta):
        return dt.timedelta(value.days, value.seconds, value.microseconds)
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")


_encoder = msgspec.msgpack.Encoder(order="sorted", enc_hook=_stdlib_time)
# (Values stored by triggers.values.encode_data carry extensions for dates, UUIDs, decimals.)
_decoder = msgspec.msgpack.Decoder(ext_hook=decode_ext)


class TriggerSerializationError(ValueError):
    """A trigger cannot be stored and rebuilt by its classpath and kwargs."""


class TriggerEvent(msgspec.Struct, frozen=True):
    """What a trigger yields when the wait is over; ``payload`` reaches the resumed method."""

    payload: Any = None


#: How a :class:`TaskEndEvent` ends its task: the trigger outcome kinds other than ``event``
#: (``engine.states.TriggerOutcomeKind``).
TaskEndState = Literal["success", "failed", "skipped"]


class TaskEndEvent(TriggerEvent, frozen=True):
    """An event that ends the waiting task itself, without running it on a worker again."""

    #: Each subclass names its kind. A bare TaskEndEvent's is none of them (empty): the
    #: triggerer refuses it, so its type stays the set an accepted event can carry.
    state: ClassVar[TaskEndState] = cast("TaskEndState", "")


class TaskSuccessEvent(TaskEndEvent, frozen=True):
    """End the task as ``success``; ``payload`` becomes the task's result."""

    state: ClassVar[TaskEndState] = "success"


class TaskFailedEvent(TaskEndEvent, frozen=True):
    """End the task as failed (retries apply); ``payload`` is the error message."""

    state: ClassVar[TaskEndState] = "failed"


class TaskSkippedEvent(TaskEndEvent, frozen=True):
    """End the task as ``skipped``."""

    state: ClassVar[TaskEndState] = "skipped"


class BaseTrigger(abc.ABC):
    """Base class of every trigger.

    Subclasses implement :meth:`serialize` (the classpath and the keyword
    arguments that rebuild an equal trigger) and :meth:`run` (an async
    generator that yields one :class:`TriggerEvent` when the wait is over).
    ``run()`` must never block the event loop: it shares it with thousands of
    other triggers. :meth:`cleanup` runs on every exit (event, error,
    cancellation, release to another triggerer).
    """

    #: Names of the keyword arguments whose values are import paths (``"package.module.name"``)
    #: that the trigger imports and calls (``PythonTrigger``'s ``check``, say). The runtime
    #: checks each of them against its allow-list, like the classpath, before it builds the
    #: trigger: a stored row cannot make the triggerer import and run any callable it names.
    import_path_kwargs: ClassVar[tuple[str, ...]] = ()
    #: True for a trigger whose kwargs hold a command it runs (``BashTrigger``): no allow-list
    #: can judge a command, so a triggerer with an encryption key runs one only from kwargs
    #: stored sealed (encrypted with that key, as the engine writes them), never from a row
    #: whose kwargs were written in plaintext by whoever can write to the database.
    runs_commands: ClassVar[bool] = False

    @abc.abstractmethod
    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return ``(classpath, kwargs)`` such that ``classpath(**kwargs)`` is an equal trigger."""

    @abc.abstractmethod
    def run(self) -> AsyncIterator[TriggerEvent]:
        """Wait, then yield one event: ``async def run(self): ... yield TriggerEvent(...)``."""

    async def cleanup(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Release what ``run()`` acquired. Runs on every exit; keep it short."""

    @property
    def log(self) -> logging.Logger:
        """A logger named after the trigger's class; its lines carry the trigger id."""
        cls = type(self)
        return logging.getLogger(f"{cls.__module__}.{cls.__qualname__}")

    def __repr__(self) -> str:
        try:
            classpath, kwargs = self.serialize()
        except Exception:
            return f"<{type(self).__qualname__}>"
        # Names only: kwargs often carry tokens, and a repr ends up in logs and errors.
        args = ", ".join(f"{k}=..." for k in kwargs)
        return f"{classpath.rsplit('.', 1)[-1]}({args})"


class CursorEvent(TriggerEvent, frozen=True):
    """An event of an event trigger together with the trigger's cursor *after* it.

    ``payload`` (a dict, or None) becomes the asset event's ``extra``; ``cursor`` (plain data,
    MessagePack-encodable) is stored with that asset event in the same statement, so the
    stored cursor always says exactly which outside events have been recorded."""

    cursor: Any = None


class Checkpoint(TriggerEvent, frozen=True):
    """A new cursor without an event: what an event trigger saw that is not an event (the
    state it started from, a response it compares the next ones with). Stored like an
    event's cursor, fenced, and nothing else is recorded. Its ``payload`` is ignored."""

    cursor: Any = None


class BaseEventTrigger(BaseTrigger):
    """Base class of an *event trigger*: what an asset watcher runs on the triggerer.

    Unlike a deferral's trigger, whose first event ends it, an event trigger's ``run()``
    yields events for as long as it runs and never returns on its own (a return or an error
    is a fault: the triggerer records it and starts the trigger again, with backoff). Each
    yielded event becomes one asset event, its ``payload`` (a dict or None) the event's
    ``extra``.

    **The cursor.** An event trigger may keep a cursor: plain data saying how far into its
    source it has read (a last id, an offset, a high-water mark of modification times, the
    hash of the last response). The triggerer sets :attr:`cursor` to the last cursor stored
    for the watcher before it calls ``run()`` (None the very first time), and stores the
    cursor carried by each :class:`CursorEvent` (or :class:`Checkpoint`) in the same
    statement as that event, only while it still owns the watcher with the fence it claimed.
    A trigger that starts from the stored cursor and yields, after each event, the cursor
    that follows it therefore neither repeats an event already recorded nor skips one that
    was not, whatever process stopped where: an event yielded but not yet written when its
    triggerer died is yielded again by the next one, from the cursor before it. A plain
    :class:`TriggerEvent` leaves the stored cursor as it is.

    Kwargs are the watcher's identity, as for every trigger; the cursor is not a kwarg."""

    #: The cursor stored for this watcher when the triggerer started it (None: none yet).
    cursor: Any = None

    def resume_from(self, cursor: Any) -> None:
        """Set the cursor ``run()`` starts from (the triggerer calls this before ``run()``)."""
        self.cursor = cursor


class SerializedTrigger(msgspec.Struct, frozen=True):
    """A validated trigger as stored: classpath, encoded kwargs, and its deduplication key."""

    classpath: str
    kwargs: bytes
    dedup_key: str


def encode_value(value: Any) -> bytes:
    """Encode kwargs, payloads and results the way the store keeps them (MessagePack)."""
    return _encoder.encode(value)


def decode_value(data: bytes) -> Any:
    """Inverse of :func:`encode_value`."""
    return _decoder.decode(data)


class ImportPathError(ValueError):
    """A dotted import path (``package.module.name``) does not name what it should.

    Every import by path in the engine (trigger classpaths, checks passed by path, lazily
    loaded commands) goes through :func:`import_object` and fails with this one shape:
    ``<what> '<path>' <reason>``. Messages name the path, never a value found there."""


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__qualname__}"


def import_object(
    path: str,
    what: str,
    *,
    accept: Callable[[Any], bool] | None = None,
    wanted: str = "",
) -> Any:
    """Import ``package.module.name`` and, with ``accept``, check the object (``wanted``
    says what it must be, for the error).

    ``what`` names the path's role in errors ("trigger classpath", "check", ...). Raises
    :class:`ImportPathError`. Code run by the import is user code: any exception it raises,
    ``SystemExit`` included, becomes an ``ImportPathError`` instead of ending the process.
    """
    if not isinstance(path, str) or "." not in path.strip(".") or path != path.strip():
        raise ImportPathError(f"{what} {path!r} must be a dotted import path 'module.name'")
    if path == "__main__" or path.startswith("__main__."):
        raise ImportPathError(
            f"{what} {path!r} points into __main__, which other processes cannot import; "
            "define it in a module (for instance next to your DAG files)"
        )
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # user code: even a SystemExit there must not end the process
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
            # Most often a module next to the DAG files, in a process not given their folder.
            hint = (
                "; if it is defined in the DAGs folder, this process needs that folder "
                "(--dags or DEFERRAL_DAGS_FOLDER)"
            )
        raise ImportPathError(
            f"{what} {path!r} cannot be imported: module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}{hint}"
        ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ImportPathError(
            f"{what} {path!r} cannot be imported: module {module_name!r} has no attribute {attr!r}"
        ) from None
    if accept is not None and not accept(obj):
        raise ImportPathError(f"{what} {path!r} names {_describe(obj)}, which is not {wanted}")
    return obj


#: Classes :func:`import_trigger_class` found, by classpath, with the module they were found
#: in (bounded: classpaths come from trigger rows, which anyone writing the table can vary).
_found_classes: dict[str, tuple[str, str, Any, type]] = {}
_FOUND_MAX = 4096


def import_trigger_class(classpath: str) -> type[BaseTrigger]:
    """Import ``package.module.ClassName`` and check it names a :class:`BaseTrigger` subclass.

    A classpath found before answers at once while its module is still the one in
    ``sys.modules`` (fully imported) and still holds that class under that name: what the
    import would find again (a reloaded DAG file's module, or a name bound anew, is looked
    up afresh)."""
    found = _found_classes.get(classpath)
    if found is not None:
        module_name, attr, module, known = found
        if (
            sys.modules.get(module_name) is module
            and getattr(module, attr, None) is known
            and not getattr(getattr(module, "__spec__", None), "_initializing", False)
        ):
            return cast("type[BaseTrigger]", known)
    try:
        cls: type[BaseTrigger] = import_object(
            classpath,
            "trigger classpath",
            accept=lambda obj: isinstance(obj, type) and issubclass(obj, BaseTrigger),
            wanted="a BaseTrigger subclass",
        )
    except ImportPathError as exc:
        raise TriggerSerializationError(str(exc)) from exc
    module_name, _, attr = classpath.rpartition(".")
    module = sys.modules.get(module_name)
    if module is not None and getattr(module, attr, None) is cls:
        if len(_found_classes) >= _FOUND_MAX:
            _found_classes.clear()
        _found_classes[classpath] = (module_name, attr, module, cls)
    return cls


def import_path_kwargs(cls: type[BaseTrigger], kwargs: dict[str, Any]) -> dict[str, object]:
    """The kwargs ``cls`` declares in :attr:`BaseTrigger.import_path_kwargs` that are given
    (not ``None``), by name: what an allow-list must accept before ``cls(**kwargs)`` runs."""
    return {name: kwargs[name] for name in cls.import_path_kwargs if kwargs.get(name) is not None}


def rebuild_trigger(
    classpath: str, kwargs: dict[str, Any], cls: type[BaseTrigger] | None = None
) -> BaseTrigger:
    """Build the trigger a stored ``(classpath, kwargs)`` pair describes; ``cls`` is the
    class already imported from that classpath, if the caller has it."""
    if cls is None:
        cls = import_trigger_class(classpath)
    try:
        return cls(**kwargs)
    except BaseException as exc:  # user code: a SystemExit there must not end the process
        raise TriggerSerializationError(
            f"trigger {classpath} cannot be rebuilt from its kwargs {sorted(kwargs)}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _encode_kwargs(classpath: str, kwargs: Any) -> bytes:
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TriggerSerializationError(
            f"trigger {classpath}: serialize() must return kwargs as a dict with str keys, "
            f"got {type(kwargs).__name__}"
        )
    try:
        data = _encoder.encode(kwargs)
    except (TypeError, ValueError, OverflowError) as whole:
        # (Encoded whole first: a dict encodes if and only if each of its values does, and
        # the kwarg to blame is looked for only when one does not.)
        for key, value in kwargs.items():
            try:
                _encoder.encode(value)
            except (TypeError, ValueError, OverflowError) as exc:
                raise TriggerSerializationError(
                    f"trigger {classpath}: kwarg {key!r} (a {type(value).__qualname__}) cannot "
                    f"be serialized ({type(exc).__name__}); pass plain data (str, numbers, "
                    "bools, None, lists, dicts, aware datetimes) or an import path instead of "
                    "live objects"
                ) from None
        raise TriggerSerializationError(
            f"trigger {classpath}: kwargs cannot be serialized ({type(whole).__name__}: {whole})"
        ) from whole
    if len(data) > MAX_KWARGS_BYTES:
        raise TriggerSerializationError(
            f"trigger {classpath}: kwargs encode to {len(data)} bytes, over the limit of "
            f"{MAX_KWARGS_BYTES}; store large data elsewhere and pass a reference"
        )
    return data


def _differences(before: dict[str, Any], after: Any) -> str:
    """Which kwargs differ after a round trip, by name only."""
    if not isinstance(after, dict):
        return f"kwargs of type {type(after).__name__}"
    missing = sorted(set(before) - set(after))
    added = sorted(set(after) - set(before))
    changed = sorted(
        k for k in set(before) & set(after) if _encoder.encode(before[k]) != _safe(after[k])
    )
    parts = [
        f"{label} {names}"
        for label, names in (("missing", missing), ("new", added), ("changed values of", changed))
        if names
    ]
    return "; ".join(parts) if parts else "kwargs that encode differently"


def _safe(value: Any) -> bytes | None:
    try:
        return _encoder.encode(value)
    except (TypeError, ValueError, OverflowError):
        return None


def validate_trigger(trigger: BaseTrigger) -> SerializedTrigger:
    """Prove a trigger survives the trip to the triggerer, before anything is written.

    Checks that ``serialize()`` returns an importable ``BaseTrigger`` classpath,
    that its kwargs encode, and that rebuilding from the decoded kwargs gives a
    trigger that serializes to the same bytes.
    """
    if not isinstance(trigger, BaseTrigger):
        raise TriggerSerializationError(
            f"a {type(trigger).__qualname__} is not a BaseTrigger instance"
        )
    try:
        classpath, kwargs = trigger.serialize()
    except Exception as exc:
        raise TriggerSerializationError(
            f"{type(trigger).__qualname__}.serialize() raised {type(exc).__name__}: {exc}"
        ) from exc
    data = _encode_kwargs(classpath, kwargs)
    rebuilt = rebuild_trigger(classpath, _decoder.decode(data))
    try:
        re_classpath, re_kwargs = rebuilt.serialize()
    except Exception as exc:
        raise TriggerSerializationError(
            f"rebuilt trigger {classpath}.serialize() raised {type(exc).__name__}: {exc}"
        ) from exc
    if re_classpath != classpath or _encode_kwargs(classpath, re_kwargs) != data:
        # Names only, never values: kwargs often carry tokens, and this error reaches the
        # task's stored error and the logs.
        raise TriggerSerializationError(
            f"trigger {classpath} does not survive a round trip: rebuilt from its kwargs it "
            f"serializes to {re_classpath!r} with {_differences(kwargs, re_kwargs)}; check "
            "that serialize() returns every argument __init__ needs, as plain data"
        )
    digest = hashlib.sha256(classpath.encode() + b"\0" + data).hexdigest()
    return SerializedTrigger(classpath=classpath, kwargs=data, dedup_key=digest)
