"""Task lookup by name, for configs (`config.task = 'addition'`)."""
from __future__ import annotations

import importlib

from foremoe_jax import config as config_lib
from foremoe_jax.tasks.addition import AdditionTask
from foremoe_jax.tasks.base import Task
from foremoe_jax.tasks.sorting import SortTask

# Name -> (class or 'module:Class', default keyword arguments). A read-only
# table, not state.
_TASKS = {
    'addition': (AdditionTask, {'num_digits': 2}),
    'addition3': (AdditionTask, {'num_digits': 3}),
    'addition_rev': (AdditionTask, {'num_digits': 2, 'reverse_answer': True}),
    'addition3_rev': (AdditionTask, {'num_digits': 3, 'reverse_answer': True}),
    'sort': (SortTask, {'num_digits': 4}),
    'sort5': (SortTask, {'num_digits': 5}),
    # Imported on use: it needs grain, tokenizers and a dataset file.
    'dataset': ('foremoe_jax.tasks.dataset:DatasetTask', {}),
}


def task_names() -> list[str]:
  return sorted(_TASKS)


def get_task(name: str, **overrides) -> Task:
  """The task called `name`; keyword overrides (num_digits, partial_credit;
  for 'dataset' the `DatasetTask` arguments: train_path, tokenizer_path...)."""
  if name not in _TASKS:
    raise ValueError(f'unknown task {name!r}; known: {task_names()}.')
  cls, defaults = _TASKS[name]
  if isinstance(cls, str):
    module, attr = cls.split(':')
    cls = getattr(importlib.import_module(module), attr)
  return cls(**{**defaults, **overrides})


def task_from_config(config) -> Task:
  """The task an experiment config names (`task`, `task_kwargs`).

  A dataset task without a `tokenizer_path` takes the tokenizer that ships
  with `init_from_hf`'s checkpoint, as its ids must match that model's.
  """
  kwargs = dict(config.get('task_kwargs', {}))
  if config.task == 'dataset' and not kwargs.get('tokenizer_path'):
    if not config.get('init_from_hf'):
      # A real-size config as shipped (configs/_real_rl.py) names neither:
      # its shape and planning tools validate it without a task.
      raise config_lib.ConfigError(
          'task_kwargs.tokenizer_path: empty, and no init_from_hf to take '
          "the checkpoint's tokenizer from; set --config.init_from_hf=DIR "
          '(or tokenizer_path: a tokenizer.json or its directory)')
    kwargs['tokenizer_path'] = config.init_from_hf
  return get_task(config.task, **kwargs)
