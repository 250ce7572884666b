"""Branching: a task that decides which of its downstream tasks run.

A branching task ends as ``success`` and returns, with its value, the tasks it skips
(:class:`operators.signals.SkipTasks`): the worker skips those still pending with the success
(one statement: both land or neither), then resolves their downstreams by their trigger
rules, so skipping propagates (a join after the branches wants
``trigger_rule="none_failed_min_one_success"``).

:class:`BaseBranchOperator` is the base: ``choose_branch(context)`` returns a task id, a list
of task ids or None (follow none: every direct downstream task is skipped). A branch may defer
like any operator: the method it resumes at returns the task ids to follow in the same way.
:class:`operators.python.BranchPythonOperator` and ``@task.branch`` call a function instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from operators.base import BaseOperator, Context
from operators.signals import SkipTasks
from triggers.base import BaseTrigger

__all__ = ["BaseBranchOperator", "BranchMixIn", "descendants", "follow_branches"]

#: The resume kwarg that names the method a deferred branch resumes at (see ``defer``).
_RESUME_AT = "_branch_method"


def _tasks_of(op: BaseOperator) -> Mapping[str, BaseOperator]:
    tasks = getattr(op.dag, "tasks", None)
    if not isinstance(tasks, Mapping):
        raise RuntimeError(f"task {op.task_id}: a branching task must belong to a DAG")
    return tasks


def descendants(op: BaseOperator, task_ids: Iterable[str]) -> set[str]:
    """Every task downstream of ``task_ids`` (transitively), not counting them."""
    tasks = _tasks_of(op)
    seen: set[str] = set()
    todo = [d for t in task_ids for d in tasks[t].downstream_task_ids]
    while todo:
        task_id = todo.pop()
        if task_id not in seen:
            seen.add(task_id)
            todo.extend(tasks[task_id].downstream_task_ids)
    return seen


def _as_task_ids(op: BaseOperator, branches: Any) -> list[str]:
    if branches is None:
        return []
    if isinstance(branches, str):
        chosen = [branches]
    elif isinstance(branches, Iterable) and not isinstance(branches, bytes | Mapping):
        chosen = list(branches)
    else:
        raise TypeError(
            f"task {op.task_id}: a branch must return a task id, a list of task ids or None, "
            f"got {type(branches).__name__}"
        )
    bad = [b for b in chosen if not isinstance(b, str)]
    if bad:
        raise TypeError(
            f"task {op.task_id}: a branch must return task ids (str), got {bad!r} among them"
        )
    unknown = sorted(set(chosen) - set(_tasks_of(op)))
    if unknown:
        raise ValueError(
            f"task {op.task_id}: the branch chose {', '.join(map(repr, unknown))}, which "
            f"{'is not a task' if len(unknown) == 1 else 'are not tasks'} of this DAG"
        )
    return list(dict.fromkeys(chosen))


def follow_branches(op: BaseOperator, branches: Any) -> SkipTasks:
    """What a branching task returns when it follows ``branches`` (a task id, a list of them,
    or None): its direct downstream tasks that are neither followed nor downstream of a
    followed one are skipped. (A direct downstream task that is also downstream of a followed
    task, such as a join the branch points at too, is followed.) Its value is the task ids, as
    a list, or None."""
    chosen = _as_task_ids(op, branches)
    followed = set(chosen) | descendants(op, chosen)
    skip = [t for t in sorted(op.downstream_task_ids) if t not in followed]
    value = None if branches is None else branches if isinstance(branches, str) else chosen
    op.log.info(
        "following %s; skipping %s", ", ".join(chosen) or "no task", ", ".join(skip) or "nothing"
    )
    return SkipTasks(value, skip)


class BranchMixIn:
    """Branching for an operator: ``do_branch``, and deferral whose resumed method returns the
    task ids to follow."""

    def do_branch(self, context: Context, branches: Any) -> SkipTasks:
        """Follow ``branches`` (a task id, a list of task ids or None)."""
        del context
        assert isinstance(self, BaseOperator)
        return follow_branches(self, branches)

    def defer(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: Any = None,
    ) -> NoReturn:
        """Defer as any operator does; the method resumed returns the task ids to follow (it
        is called through :meth:`resume_branch`, which follows them)."""
        assert isinstance(self, BaseOperator)
        method = getattr(self, method_name, None) if isinstance(method_name, str) else None
        if not callable(method):  # BaseOperator.defer says what is wrong
            BaseOperator.defer(self, trigger=trigger, method_name=method_name, timeout=timeout)
        BaseOperator.defer(
            self,
            trigger=trigger,
            method_name=(
                "resume_branch_async" if inspect.iscoroutinefunction(method) else "resume_branch"
            ),
            kwargs={**(kwargs or {}), _RESUME_AT: method_name},
            timeout=timeout,
        )

    def resume_branch(self, context: Context, event: Any = None, **kwargs: Any) -> Any:
        """Call the method a deferral named and follow the task ids it returns (it may defer
        again)."""
        method = getattr(self, kwargs.pop(_RESUME_AT))
        return self.do_branch(context, method(context, event=event, **kwargs))

    async def resume_branch_async(self, context: Context, event: Any = None, **kwargs: Any) -> Any:
        """:meth:`resume_branch` for an ``async def`` resumed method."""
        method = getattr(self, kwargs.pop(_RESUME_AT))
        return self.do_branch(context, await method(context, event=event, **kwargs))


class BaseBranchOperator(BranchMixIn, BaseOperator):
    """A branching operator: implement ``choose_branch(context)``, returning a task id, a list
    of task ids or None. It may defer (``self.defer(...)``); the method it resumes at returns
    the task ids to follow."""

    def choose_branch(self, context: Context) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} must implement choose_branch()")

    def execute(self, context: Context) -> Any:
        return self.do_branch(context, self.choose_branch(context))
