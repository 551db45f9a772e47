"""SIGINT / SIGTERM as a request to stop cleanly at the next step boundary.

A scheduler's SIGTERM (preemption) or the user's Ctrl-C sets a flag instead
of killing the job; the training loop reads it after each step, saves a
checkpoint and returns. A second signal aborts at once (KeyboardInterrupt),
for a job that must die now. Handlers are installed only in the main thread
(Python delivers signals there) and the previous ones come back on exit.
"""
from __future__ import annotations

import signal
import sys
import threading

from foremoe_jax.utils import distributed


class PreemptionGuard:
  """Context manager; `requested` turns true at the first SIGINT/SIGTERM."""

  def __init__(self, signals=(signal.SIGINT, signal.SIGTERM)):
    self._signals = tuple(signals)
    self._previous = {}
    self.signum: int | None = None

  @property
  def requested(self) -> bool:
    return self.signum is not None

  @property
  def exit_code(self) -> int:
    """128 + the signal number: what a shell reports for that signal."""
    return 128 + (self.signum or 0)

  def _handle(self, signum, frame):
    del frame
    if self.signum is not None:
      self._restore()
      raise KeyboardInterrupt(f'second {signal.Signals(signum).name}')
    self.signum = signum
    # Every process of a launch gets the signal; one line says it for all.
    if not distributed.is_primary():
      return
    print(f'\n{signal.Signals(signum).name}: finishing the current step, '
          'then saving a checkpoint (signal again to abort now)',
          file=sys.stderr, flush=True)

  def _restore(self):
    for s, h in self._previous.items():
      signal.signal(s, h)
    self._previous = {}

  def __enter__(self) -> 'PreemptionGuard':
    if threading.current_thread() is threading.main_thread():
      for s in self._signals:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    self._restore()
