"""Built-in tasks and the task loader.

:data:`BUILTIN_TASKS` is the one list of built-in task names, each mapped to its factory (keyword options
``optimizer``, ``lr``, ``batch_size``, ``steps``, ``seed`` and the task's own). :func:`load_task` resolves a
built-in name, a ``FILE.py:ATTR`` or a ``MODULE:ATTR`` to a :class:`~shardcheck.task.Task`.
"""

from __future__ import annotations

from collections.abc import Callable

from shardcheck.task import Task
from shardcheck.tasks.digits import digits_task
from shardcheck.tasks.loading import load_task
from shardcheck.tasks.regression import diabetes_task, linnerud_task, regression_task
from shardcheck.tasks.tiny_lm import TinyLM, TinyLMConfig, tiny_lm_task

BUILTIN_TASKS: dict[str, Callable[..., Task]] = {
    "diabetes": diabetes_task,
    "linnerud": linnerud_task,
    "digits": digits_task,
    "tiny-lm": tiny_lm_task,
}

__all__ = [
    "BUILTIN_TASKS",
    "TinyLM",
    "TinyLMConfig",
    "diabetes_task",
    "digits_task",
    "linnerud_task",
    "load_task",
    "regression_task",
    "tiny_lm_task",
]
