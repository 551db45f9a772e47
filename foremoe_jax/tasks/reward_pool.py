"""Verifier calls spread over worker processes, for slow or hanging verifiers.

Sits inside a task's `reward`: a list of (completion text, reference) pairs
in, one float each out, in order. With `num_workers=0` the calls run in this
process, one after another; with N > 0 they run in N spawned processes,
each sent a few completions at a time. math-verify parses and compares with sympy
at a few ms a completion, so a step of 1024 long completions costs seconds
on one core; verl and TRL run their reward functions in workers for the same
reason.

A verifier can also hang: sympy simplifying an adversarial expression, a
regex backtracking on a long completion, a user's function waiting on a
socket. With `timeout_s`, a call that runs longer is stopped by killing its
worker (the only way to stop arbitrary code, C extensions included; the
worker is replaced), and the completion scores `timeout_score` (a task
passes the bottom of its reward range: a verifier that cannot decide has
not been convinced). `last_timeouts` / `num_timeouts` count them for the
step's record. A worker returns each score as it has it and starts on its
next completion at once, so a call's clock starts at the previous one's
score (or at the send): it counts the call itself, not the queue, and a
worker still starting up (spawn, imports) is not sent work. The
completions queued behind a stopped call go to the other workers.

Workers are started with 'spawn' (forking a process that runs JAX threads
is unsafe) and ignore SIGINT and SIGTERM: a Ctrl-C or a scheduler's signal
reaches the whole process group, and the trainer, which finishes its step
and checkpoints before it exits, needs the workers alive until then. The
verifier function travels by pickle, so it must be importable by name
(defined at a module's top level); a lambda or a closure is refused when the
pool is built, not in the middle of a run. A verifier that raises stops the
call with its traceback (verifiers must score unreadable output 0.0, not
raise: `tasks.rewards`).
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import time
import traceback
from typing import Callable, Sequence

RewardFn = Callable[[str, str], float]

_READY = 'ready'  # A worker's first message: it can take completions.
_MAX_BATCH = 8  # Completions sent to a worker at once.


def _ignore_signals():
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _score_all(fn: RewardFn, texts: Sequence[str], refs: Sequence[str]
               ) -> list[float]:
  return [float(fn(t, r)) for t, r in zip(texts, refs)]


def _worker_main(conn, fn: RewardFn) -> None:
  """A worker's loop: a list of (index, text, reference) in, one (index,
  score, error text or None) out per item as it is scored, until None or
  the pipe closes."""
  _ignore_signals()
  conn.send(_READY)
  while True:
    try:
      msg = conn.recv()
    except EOFError:
      return
    if msg is None:
      return
    for i, text, ref in msg:
      try:
        conn.send((i, float(fn(text, ref)), None))
      except Exception:  # pylint: disable=broad-except
        conn.send((i, None, traceback.format_exc()))


@dataclasses.dataclass
class _Worker:
  process: multiprocessing.Process
  conn: multiprocessing.connection.Connection
  ready: bool = False
  # The completions sent and not yet scored, the first being scored.
  items: collections.deque = dataclasses.field(
      default_factory=collections.deque)
  since: float = 0.0  # time.monotonic() when it started on items[0].

  def stop(self, kill: bool = False) -> None:
    if not kill:
      try:
        self.conn.send(None)
      except (OSError, ValueError):
        pass
      self.process.join(5.0)
    if self.process.is_alive():
      self.process.kill()
      self.process.join()
    self.conn.close()


class RewardPool:
  """Calls `fn(text, reference)` for many pairs, in-process or in workers.

  timeout_s: stop a call after this many seconds (its completion scores
    `timeout_score`); None: no limit. Needs workers: a call in this process
    cannot be stopped.
  """

  def __init__(self, fn: RewardFn, num_workers: int = 0,
               timeout_s: float | None = None, timeout_score: float = 0.0):
    if num_workers < 0:
      raise ValueError(f'reward_workers must be >= 0, got {num_workers}.')
    if timeout_s is not None:
      if not timeout_s > 0:
        raise ValueError(f'reward_timeout_s must be > 0 (or off), got '
                         f'{timeout_s}.')
      if not num_workers:
        raise ValueError(
            f'a reward timeout ({timeout_s} s) needs reward_workers >= 1: a '
            'verifier call in the trainer\'s own process cannot be stopped.')
    if num_workers:
      try:
        pickle.dumps(fn)
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(
            f'reward function {fn!r} cannot be sent to worker processes '
            f'({type(e).__name__}: {e}); define it at the top level of an '
            'importable module, or set reward_workers=0.') from None
    self.fn, self.num_workers = fn, num_workers
    self.timeout_s, self.timeout_score = timeout_s, float(timeout_score)
    self.last_timeouts = 0  # Calls stopped in the last __call__.
    self.num_timeouts = 0  # ... and in all of them.
    self._workers: list[_Worker] = []

  def _spawn(self) -> _Worker:
    ctx = multiprocessing.get_context('spawn')
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_worker_main, args=(child, self.fn),
                          daemon=True)
    process.start()
    child.close()
    return _Worker(process, parent)

  def _died(self, w: _Worker, texts) -> RuntimeError:
    w.process.join(1.0)
    what = ('while starting' if not w.items else
            f'scoring completion {w.items[0]} ({texts[w.items[0]][:200]!r})')
    return RuntimeError(f'a reward worker exited (code {w.process.exitcode}) '
                        f'{what}.')

  def __call__(self, texts: Sequence[str], refs: Sequence[str]
               ) -> list[float]:
    if len(texts) != len(refs):
      raise ValueError(f'{len(texts)} texts but {len(refs)} references.')
    self.last_timeouts = 0
    if not self.num_workers or not texts:
      return _score_all(self.fn, texts, refs)
    try:
      return self._in_workers(texts, refs)
    except BaseException:
      # Workers may be busy with this call's completions (an error, a
      # Ctrl-C in the main process): the next call starts afresh.
      self.close(kill=True)
      raise

  def _in_workers(self, texts, refs) -> list[float]:
    while len(self._workers) < self.num_workers:  # Kept for the run.
      self._workers.append(self._spawn())
    out: list[float | None] = [None] * len(texts)
    todo = collections.deque(range(len(texts)))
    done = 0
    while done < len(texts):
      for w in self._workers:
        if w.ready and not w.items and todo:
          # A few at a time: no round trip between a worker's calls, and
          # the queue still spreads over the workers at the end.
          n = max(1, min(_MAX_BATCH, len(todo) // (2 * self.num_workers)))
          batch = [todo.popleft() for _ in range(n)]
          w.items.extend(batch)
          w.since = time.monotonic()
          w.conn.send([(i, texts[i], refs[i]) for i in batch])
      busy = [w for w in self._workers if w.items]
      wait_s = None
      if self.timeout_s is not None and busy:
        wait_s = max(0.0, min(w.since for w in busy) + self.timeout_s
                     - time.monotonic())
      waiting = [w for w in self._workers if w.items or not w.ready]
      ready = multiprocessing.connection.wait([w.conn for w in waiting],
                                              wait_s)
      for w in waiting:
        if w.conn not in ready:
          continue
        try:
          msg = w.conn.recv()
        except EOFError:
          raise self._died(w, texts) from None
        if msg == _READY:
          w.ready = True
          continue
        i, score, error = msg
        if error is not None:
          raise RuntimeError(f'the reward function raised on completion {i} '
                             f'({texts[i][:200]!r}, reference {refs[i]!r}):'
                             f'\n{error}')
        assert w.items.popleft() == i
        out[i], w.since, done = score, time.monotonic(), done + 1
      if self.timeout_s is None:
        continue
      now = time.monotonic()
      for k, w in enumerate(self._workers):
        if w.items and now - w.since >= self.timeout_s:
          out[w.items.popleft()], done = self.timeout_score, done + 1
          self.last_timeouts += 1
          todo.extendleft(reversed(w.items))  # Not started: to the others.
          w.items.clear()
          w.stop(kill=True)
          self._workers[k] = self._spawn()
    self.num_timeouts += self.last_timeouts
    return out

  def close(self, kill: bool = False) -> None:
    """Stops the workers (they start again on the next call)."""
    workers, self._workers = self._workers, []
    for w in workers:
      w.stop(kill=kill or bool(w.items))
