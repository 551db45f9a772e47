"""Verifier calls spread over worker processes, for slow verifiers.

Sits inside a task's `reward`: a list of (completion text, reference) pairs
in, one float each out, in order. With `num_workers=0` the calls run in this
process, one after another; with N > 0 they run in N spawned processes, in
contiguous chunks. math-verify parses and compares with sympy at a few ms a
completion, so a step of 1024 long completions costs seconds on one core;
verl and TRL run their reward functions in workers for the same reason.

Workers are started with 'spawn' (forking a process that runs JAX threads
is unsafe) and ignore SIGINT and SIGTERM: a Ctrl-C or a scheduler's signal
reaches the whole process group, and the trainer, which finishes its step
and checkpoints before it exits, needs the workers alive until then. The
verifier function travels by pickle, so it must be importable by name
(defined at a module's top level); a lambda or a closure is refused when the
pool is built, not in the middle of a run.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle
import signal
from typing import Callable, Sequence

RewardFn = Callable[[str, str], float]


def _ignore_signals():
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _score_chunk(fn: RewardFn, texts: Sequence[str], refs: Sequence[str]
                 ) -> list[float]:
  return [float(fn(t, r)) for t, r in zip(texts, refs)]


class RewardPool:
  """Calls `fn(text, reference)` for many pairs, in-process or in workers."""

  def __init__(self, fn: RewardFn, num_workers: int = 0):
    if num_workers < 0:
      raise ValueError(f'reward_workers must be >= 0, got {num_workers}.')
    if num_workers:
      try:
        pickle.dumps(fn)
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(
            f'reward function {fn!r} cannot be sent to worker processes '
            f'({type(e).__name__}: {e}); define it at the top level of an '
            'importable module, or set reward_workers=0.') from None
    self.fn, self.num_workers = fn, num_workers
    self._executor = None

  def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
    if self._executor is None:  # Started on first use, kept for the run.
      self._executor = concurrent.futures.ProcessPoolExecutor(
          self.num_workers, mp_context=multiprocessing.get_context('spawn'),
          initializer=_ignore_signals)
    return self._executor

  def __call__(self, texts: Sequence[str], refs: Sequence[str]
               ) -> list[float]:
    if len(texts) != len(refs):
      raise ValueError(f'{len(texts)} texts but {len(refs)} references.')
    if not self.num_workers or len(texts) < 2:
      return _score_chunk(self.fn, texts, refs)
    # Contiguous chunks, a few per worker so one slow chunk does not hold
    # the others idle.
    n = min(len(texts), 4 * self.num_workers)
    bounds = [len(texts) * i // n for i in range(n + 1)]
    futures = [self._pool().submit(_score_chunk, self.fn, texts[a:b],
                                   refs[a:b])
               for a, b in zip(bounds[:-1], bounds[1:])]
    return [x for f in futures for x in f.result()]

  def close(self) -> None:
    if self._executor is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)
      self._executor = None
