"""Which XLA compiles happened, how long each took: a context manager.

Each capacity bucket the host picks is one compile of the update, so a run
that wanders over buckets pays compile time; the trainer logs every
compile with its bucket and the benchmarks count them. JAX reports each
backend compile through `jax.monitoring` (event
'/jax/core/compile/backend_compile_duration', with the jitted function's
name); `CompileLog` listens while it is open and forgets on exit, so it
leaves no listener behind.
"""
from __future__ import annotations

import dataclasses
import threading

import jax

BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


@dataclasses.dataclass(frozen=True)
class Compile:
  fun_name: str
  seconds: float


def _plain_name(fun_name) -> str:
  """'jit(update)' -> 'update': the jitted Python function's name."""
  name = str(fun_name)
  while name.startswith('jit(') and name.endswith(')'):
    name = name[4:-1]
  return name


class CompileLog:
  """Collects the compiles that happen while it is open.

  with CompileLog() as log:
    ...
    new = log.take()  # compiles since the last take()
  log.compiles: every compile seen.
  """

  def __init__(self):
    self.compiles: list[Compile] = []
    self._unread = 0
    self._lock = threading.Lock()

  def _listen(self, event: str, duration: float, **kw) -> None:
    if event == BACKEND_COMPILE_EVENT:
      with self._lock:
        self.compiles.append(Compile(_plain_name(kw.get('fun_name', '?')),
                                     float(duration)))

  def __enter__(self) -> 'CompileLog':
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listen)

  def take(self) -> list[Compile]:
    """Compiles since the previous take()."""
    with self._lock:
      new = self.compiles[self._unread:]
      self._unread = len(self.compiles)
    return new

  def count(self, fun_name: str | None = None) -> int:
    return sum(1 for c in self.compiles
               if fun_name is None or c.fun_name == fun_name)

  def seconds(self, fun_name: str | None = None) -> float:
    return sum(c.seconds for c in self.compiles
               if fun_name is None or c.fun_name == fun_name)
