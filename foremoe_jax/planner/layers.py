"""A step's layers planned side by side, and replaced one chunk at a time.

Every planner here treats the MoE layers independently: a layer's plan
depends on its own loads, its own current placement (and, for EPLB-step,
its own load history) and nothing else; arrays over L only batch the numpy
work. So the plan of a step is the plans of any split of its layers put
back side by side along L. This module holds that split:

* ``chunks``: contiguous, even runs of layers.
* ``take`` / ``join``: a StepPlan's layers out, and chunks' plans back in.
* ``plan_chunk``: one chunk planned by one method, as a picklable call a
  worker process runs (``LayerPool``). Processes by default: much of the
  planner is small numpy calls that hold the GIL (two processes planned
  DeepSeek-V3-like at EP 256 in 5.2 s, two threads in 5.7 s, one thread
  in 7.9 s; docs/results.md).

What this buys the trainer (`guard.StepPlanner`): planning time shared by
the workers (less the copies of loads and plans between processes), and a
deadline that costs only the late chunks. A chunk that
misses the deadline or fails is replaced by the fallback plan's same
layers (`StepPlan.fell_back_L`), never the whole step.

Shape letters: M micro-steps, L layers, D devices, E experts, S slots.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import sys
import time
import types

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner.plan import StepPlan


def chunks(num_layers: int, num_chunks: int) -> list[np.ndarray]:
  """`num_chunks` contiguous runs of layer indices, sizes within one of
  each other (fewer when there are fewer layers)."""
  num_chunks = max(1, min(int(num_chunks), num_layers))
  return [c for c in np.array_split(np.arange(num_layers), num_chunks)
          if len(c)]


def take_placement(p: placement_lib.Placement, layers, axis: int
                   ) -> placement_lib.Placement:
  """The given layers of a placement: axis 0 for one placement ([L, S],
  [L, D, S]), 1 for a step's stack ([M, L, S], [M, L, D, S])."""
  pick = lambda x: np.take(np.asarray(x), layers, axis=axis)
  return placement_lib.Placement(pick(p.slot_expert), pick(p.slot_share))


def take(plan: StepPlan, layers, bytes_per_expert: float) -> StepPlan:
  """The plan of the given layers alone (the same plan the planner makes
  for them alone)."""
  layers = np.asarray(layers)
  pick = lambda x: None if x is None else np.asarray(x)[:, layers]
  moves_MLD = pick(plan.moves_MLD)
  return plan._replace(
      placement=take_placement(plan.placement, layers, axis=1),
      loads_MLD=pick(plan.loads_MLD), slot_loads_MLS=pick(plan.slot_loads_MLS),
      max_cell_ML=pick(plan.max_cell_ML), moves_MLD=moves_MLD,
      bytes_moved_M=moves_MLD.sum(axis=(1, 2)) * float(bytes_per_expert),
      from_split_L=(None if plan.from_split_L is None
                    else np.asarray(plan.from_split_L)[layers]),
      fell_back_L=(None if plan.fell_back_L is None
                   else np.asarray(plan.fell_back_L)[layers]))


_PER_LAYER = ('loads_MLD', 'slot_loads_MLS', 'max_cell_ML', 'moves_MLD')


def join(parts, num_layers: int) -> StepPlan:
  """One StepPlan from (layers, StepPlan) parts that cover every layer
  once. `from_split_L` / `fell_back_L` are kept where any part has them
  (False for the layers of parts that do not); `fell_back` only when every
  part fell back."""
  parts = list(parts)
  covered = np.concatenate([np.asarray(ls) for ls, _ in parts])
  if np.sort(covered).tolist() != list(range(num_layers)):
    raise ValueError(f'parts cover layers {sorted(covered.tolist())}, not '
                     f'each of 0..{num_layers - 1} once.')
  first = parts[0][1]

  def joined(get):
    ref = np.asarray(get(first))
    out = np.zeros(ref.shape[:1] + (num_layers,) + ref.shape[2:], ref.dtype)
    for ls, p in parts:
      out[:, ls] = get(p)
    return out

  def flags(name):
    if all(getattr(p, name) is None for _, p in parts):
      return None
    out = np.zeros(num_layers, bool)
    for ls, p in parts:
      if getattr(p, name) is not None:
        out[ls] = getattr(p, name)
    return out

  return StepPlan(
      placement_lib.Placement(joined(lambda p: p.placement.slot_expert),
                              joined(lambda p: p.placement.slot_share)),
      *(joined(lambda p, f=f: getattr(p, f)) for f in _PER_LAYER),
      bytes_moved_M=np.sum([p.bytes_moved_M for _, p in parts], axis=0),
      fell_back=all(p.fell_back for _, p in parts),
      from_split_L=flags('from_split_L'), fell_back_L=flags('fell_back_L'))


def plan_chunk(run, loads_MLDE, current: placement_lib.Placement,
               history_LE, deadline_unix: float | None):
  """`run(loads_MLDE, current, history_LE, deadline)` for one chunk of
  layers, in a worker process. The deadline travels as a Unix time (each
  process has its own `perf_counter` origin) and is turned back into this
  process's `perf_counter` clock, which `foremoe.plan_step` checks."""
  deadline = (None if deadline_unix is None
              else time.perf_counter() + (deadline_unix - time.time()))
  return run(loads_MLDE, current, history_LE, deadline)


KINDS = ('process', 'thread')


@contextlib.contextmanager
def _bare_main():
  """Starts processes without the parent's `__main__`.

  A spawned or forkserver child imports the parent's main module before it
  runs anything (multiprocessing's `spawn.prepare`), so a user's script
  without an `if __name__ == '__main__':` guard would run again in every
  planner worker, training included. The workers need only this package,
  importable by name, so while they start `__main__` is an empty module:
  multiprocessing then records no main module to re-import.
  """
  main = sys.modules.get('__main__')
  sys.modules['__main__'] = types.ModuleType('__main__')
  try:
    yield
  finally:
    sys.modules['__main__'] = main


class LayerPool:
  """Worker processes that plan chunks of layers (`plan_chunk`).

  Started lazily on first use, all at once, with 'forkserver' where the
  platform has it ('spawn' elsewhere): the trainer's process runs XLA's
  threads, and a plain fork of a threaded process may deadlock in the
  child. A worker imports numpy and the planner once and is reused for
  every step; it never runs the parent's `__main__` (`_bare_main`).
  kind='thread' runs the chunks on threads instead (no start-up and no
  copies, but only the large numpy calls release the GIL; for tests and
  for hosts where processes are not allowed).
  """

  def __init__(self, workers: int, kind: str = 'process'):
    if workers < 2:
      raise ValueError(f'a LayerPool needs at least 2 workers, got {workers}.')
    if kind not in KINDS:
      raise ValueError(f'kind must be one of {KINDS}, got {kind!r}.')
    self.workers, self.kind = int(workers), kind
    self._pool: concurrent.futures.Executor | None = None

  def _executor(self) -> concurrent.futures.Executor:
    if self._pool is None and self.kind == 'thread':
      self._pool = concurrent.futures.ThreadPoolExecutor(
          max_workers=self.workers, thread_name_prefix='foremoe-layers')
    if self._pool is None:
      methods = multiprocessing.get_all_start_methods()
      ctx = multiprocessing.get_context(
          'forkserver' if 'forkserver' in methods else 'spawn')
      self._pool = concurrent.futures.ProcessPoolExecutor(
          max_workers=self.workers, mp_context=ctx)
      # Every worker starts now, under a bare __main__ (`_bare_main`).
      with _bare_main():
        started = [self._pool.submit(time.sleep, 0.05)
                   for _ in range(self.workers)]
      concurrent.futures.wait(started)
    return self._pool

  def warm(self) -> None:
    """Starts every worker now (a timed first plan should not pay for the
    processes' start and imports)."""
    self._executor()

  def submit(self, fn, *args) -> concurrent.futures.Future:
    return self._executor().submit(fn, *args)

  def restart(self) -> None:
    """A fresh set of workers (those still busy with an abandoned step
    finish it on their own and exit)."""
    self.close()

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
      self._pool = None
