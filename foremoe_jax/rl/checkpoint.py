"""Checkpoints of the whole run state (orbax), so a crashed job resumes
exactly where it was.

Host-side shell around `orbax.checkpoint.CheckpointManager`. One checkpoint
holds the device state (params, optimizer state, the reference policy of
the KL term) as orbax array items and everything else the run depends on as
one JSON item, `meta`: the phase ('warmstart_done', 'distill_done' or 'rl'), the step and a
`host` record (the numpy RNG state, the JAX key, the planner's state, the
data position; see `trainer.host_state`). Restores lay arrays out like the
given templates (shardings included), so a resumed run continues on the
same mesh.

A checkpoint that cannot be read (a crash while orbax finalised it, a disk
that lost a file) is reported in one line and skipped: `restore_latest`
falls back to the newest one that restores whole, as MaxText does with
orbax's step list. Orbax writes each step under a temporary name and renames
it when complete, so a save cut short never shows up as a step at all.

Host memory per save. tensorstore (0.1.86) turns a JSON object into a
Python dict with `PyDict_SetItem` on references it has released, so every
key and value of every dict it returns keeps one reference too many and is
never freed. Orbax reads tensorstore's metric registry through that path
twice per array item on every save (for its raw-bytes throughput log),
which was about half of the ~140 kB a save kept; `Checkpointer` swaps that
reader for one that reads the same counters as Prometheus text, which is
returned as plain strings (`_raw_bytes_without_leak`). The rest (~70 kB a
save on configs/tiny.py: the `KvStore.Spec.to_json` orbax calls per array,
and tensorstore's own state) is left as is; `experiments.soak` measures it.
After each save the freed heap pages go back to the system
(`host_memory.trim`), so the save's transient host copies do not stay
resident.
"""
from __future__ import annotations

import os
import shutil
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from foremoe_jax import config as config_lib
from foremoe_jax.utils import distributed
from foremoe_jax.utils import host_memory

ARRAY_ITEMS = ('params', 'opt_state', 'ref_params')
# tensorstore's byte counters, one per kvstore driver, under this prefix.
_KVSTORE_METRICS = '/tensorstore/kvstore/'


def _raw_bytes_without_leak(direction=None) -> int:
  """Total bytes tensorstore's kvstore drivers have written (or read).

  The same sum as orbax's `tensorstore_utils.get_tensorstore_raw_bytes`
  (every `/tensorstore/kvstore/<driver>/bytes_written` counter), read from
  the Prometheus text form, whose lines are plain strings, instead of the
  dict form that leaks every key and value (see the module docstring).
  """
  read = getattr(direction, 'value', direction) == 'read'
  suffix = '_bytes_read' if read else '_bytes_written'
  total = 0
  for line in ts.experimental_collect_prometheus_format_metrics(
      _KVSTORE_METRICS):
    if line.startswith('#'):
      continue
    name, _, value = line.rpartition(' ')
    if name.split('{', 1)[0].endswith(suffix):
      total += int(float(value))
  return total


def avoid_tensorstore_metrics_leak() -> bool:
  """Points orbax's raw-bytes reader at `_raw_bytes_without_leak`; False
  (and nothing changed) where this orbax has no such reader."""
  try:
    from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  if not hasattr(tensorstore_utils, 'get_tensorstore_raw_bytes'):
    return False
  tensorstore_utils.get_tensorstore_raw_bytes = _raw_bytes_without_leak
  return True


class ConfigMismatchError(config_lib.ConfigError):
  """A checkpoint whose arrays are not this config's (another model or
  optimizer), as opposed to a damaged one; entry points print it as one
  line, like any config error."""


# Suffix of a step set aside while a later phase of the same step is saved
# in its place (`Checkpointer.save(replace=True)`).
REPLACED = '.replaced'


class Checkpointer:

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = directory
    avoid_tensorstore_metrics_leak()
    self._recover_replaced()
    self._mgr = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

  def _recover_replaced(self) -> None:
    """A step set aside by a replacing save that did not finish comes back;
    one whose replacement was saved whole goes."""
    if distributed.is_primary() and os.path.isdir(self.directory):
      for name in os.listdir(self.directory):
        if not name.endswith(REPLACED):
          continue
        aside = os.path.join(self.directory, name)
        step_dir = os.path.join(self.directory, name[:-len(REPLACED)])
        if os.path.exists(step_dir):
          shutil.rmtree(aside)
        else:
          os.replace(aside, step_dir)
    distributed.max_over_processes(0)  # The others wait for process 0.

  def save(self, step: int, params, *, phase: str, opt_state=None,
           ref_params=None, host: dict | None = None,
           replace: bool = False) -> None:
    """Saves one step; `host` is JSON-able state beside the arrays.

    replace: a later phase of the same step (the MSA distillation after the
    warm start, both step 0) takes the step's place; orbax refuses to save
    a step twice. The old step is set aside (renamed) until the new one is
    saved whole, so a crash in between leaves it to restore (the next
    Checkpointer puts it back).
    """
    aside = None
    if replace and int(step) in self._mgr.all_steps():
      aside = os.path.join(self.directory, f'{int(step)}{REPLACED}')
      if distributed.is_primary():
        if os.path.exists(aside):
          shutil.rmtree(aside)
        os.replace(os.path.join(self.directory, str(int(step))), aside)
      distributed.max_over_processes(0)
      self._mgr.reload()
    arrays = dict(params=params, opt_state=opt_state, ref_params=ref_params)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    items = {k: ocp.args.StandardSave(v) for k, v in arrays.items()}
    items['meta'] = ocp.args.JsonSave({
        'phase': phase, 'step': int(step), 'items': sorted(arrays),
        'host': host or {}})
    self._mgr.save(int(step), args=ocp.args.Composite(**items), force=True)
    self._mgr.wait_until_finished()
    if aside is not None and distributed.is_primary():
      shutil.rmtree(aside)
    host_memory.trim()  # The save's host copies are free now; return them.

  def _set_aside(self, steps: list[int], log) -> None:
    """Moves unreadable steps out of the manager's directory, so the resumed
    run can save those steps again; kept, not deleted, for a post-mortem.
    In a multi-process run process 0 moves them (one shared directory)."""
    if not steps:
      return
    if distributed.is_primary():
      aside = os.path.normpath(self.directory) + '.unreadable'
      os.makedirs(aside, exist_ok=True)
      stamp = time.strftime('%Y%m%d-%H%M%S')
      for step in steps:
        src = os.path.join(self.directory, str(step))
        if os.path.exists(src):
          dst = os.path.join(aside, f'{step}.{stamp}')
          os.replace(src, dst)
          log(f'moved the unreadable step {step} to {dst}')
    # The others list the directory only once process 0 has moved them:
    # a process that reloaded first would still count the moved steps, and
    # its save of such a step would be refused or race the move.
    distributed.max_over_processes(0)
    self._mgr.reload()

  def steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  def restore(self, step: int, templates: dict) -> dict:
    """{'phase', 'step', 'host', and each saved array item} of one step.

    templates: item name -> a pytree laid out as the restored one should be
    ('params' is required; 'opt_state' and 'ref_params' are restored when
    both the checkpoint holds them and a template is given).
    """
    meta = self._mgr.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta
    # Checkpoints written before `items` existed said only `has_opt_state`.
    saved = meta.get('items', ['params'] + (
        ['opt_state'] if meta.get('has_opt_state') else []))
    wanted = [k for k in ARRAY_ITEMS
              if k in saved and templates.get(k) is not None]
    r = self._mgr.restore(step, args=ocp.args.Composite(
        **{k: ocp.args.StandardRestore(templates[k]) for k in wanted}))
    out = dict(phase=meta['phase'], step=meta['step'],
               host=meta.get('host', {}))
    out.update({k: r[k] for k in wanted})
    return out

  def _shape_mismatch(self, step: int, templates: dict) -> str:
    """Why step's arrays cannot be this run's ('' if their shapes match,
    or the step's metadata cannot be read: then the restore decides).
    Compared as sorted lists of leaf shapes per item, which does not
    depend on how either side spells its tree's paths."""
    try:
      meta = self._mgr.item_metadata(step)
      items = [k for k in ARRAY_ITEMS
               if templates.get(k) is not None and k in meta
               and meta[k] is not None]
      saved = {k: sorted(tuple(x.shape) for x in jax.tree.leaves(
          getattr(meta[k], 'tree', meta[k]))) for k in items}
    except Exception:  # pylint: disable=broad-except
      return ''
    for k in items:
      want = sorted(tuple(np.shape(x)) for x in jax.tree.leaves(templates[k]))
      if want != saved[k]:
        extra = sorted(set(saved[k]) - set(want))[:3]
        missing = sorted(set(want) - set(saved[k]))[:3]
        return (f'its {k} hold {len(saved[k])} arrays, this config\'s '
                f'{len(want)}; shapes only in the checkpoint {extra}, only '
                f'in this config {missing}')
    return ''

  def restore_latest(self, params_template, *, log=print, **templates):
    """The newest checkpoint that restores whole (see `restore`), or None.

    A newer checkpoint that fails to restore is named in one line (through
    `log`) and the next older one is tried; once one restores, the
    unreadable ones are moved to `<directory>.unreadable/` so the run can
    save those steps again. When checkpoints exist but none
    restores, this raises: starting over silently would discard the run.
    """
    templates = dict(params=params_template, **templates)
    steps = self.steps()
    errors = []
    for step in reversed(steps):
      why = self._shape_mismatch(step, templates)
      if why:
        # Not damage: another config. Falling back to an older step (the
        # warm start's, which holds no optimizer state) would restart RL
        # and set the run's own checkpoints aside.
        raise ConfigMismatchError(
            f'the checkpoint at step {step} in {self.directory} was written '
            f'under another config ({why}). Rerun with the run\'s config '
            f'(config.first.json beside checkpoints/), or pass a new '
            f'--workdir for a new run.')
      try:
        restored = self.restore(step, templates)
      except Exception as err:  # pylint: disable=broad-except
        # Which exception a damaged checkpoint raises depends on what broke
        # (tensorstore, JSON, a missing directory); all mean "unusable".
        reason = f'{type(err).__name__}: {str(err).splitlines()[0][:200]}' \
            if str(err) else type(err).__name__
        errors.append((step, reason))
        older = [s for s in steps if s < step]
        then = (f'falling back to step {older[-1]}' if older
                else 'no older checkpoint is left')
        log(f'checkpoint at step {step} in {self.directory} is unreadable '
            f'({reason}); {then}')
        continue
      self._set_aside([s for s, _ in errors], log)
      return restored
    if errors:
      raise RuntimeError(
          f'no checkpoint in {self.directory} restores (steps '
          f'{[s for s, _ in errors]}); move the directory away to start over')
    return None
