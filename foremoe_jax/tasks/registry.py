"""Task lookup by name, for configs (`config.task = 'addition'`)."""
from __future__ import annotations

from foremoe_jax.tasks.addition import AdditionTask
from foremoe_jax.tasks.base import Task
from foremoe_jax.tasks.sorting import SortTask

# Name -> (class, default keyword arguments). A read-only table, not state.
_TASKS = {
    'addition': (AdditionTask, {'num_digits': 2}),
    'addition3': (AdditionTask, {'num_digits': 3}),
    'addition_rev': (AdditionTask, {'num_digits': 2, 'reverse_answer': True}),
    'addition3_rev': (AdditionTask, {'num_digits': 3, 'reverse_answer': True}),
    'sort': (SortTask, {'num_digits': 4}),
    'sort5': (SortTask, {'num_digits': 5}),
}


def task_names() -> list[str]:
  return sorted(_TASKS)


def get_task(name: str, **overrides) -> Task:
  """The task called `name`; keyword overrides (num_digits, partial_credit)."""
  if name not in _TASKS:
    raise ValueError(f'unknown task {name!r}; known: {task_names()}.')
  cls, defaults = _TASKS[name]
  return cls(**{**defaults, **overrides})
