"""Several processes, one mesh: start-up and the host <-> device boundary.

Sits under every stage: the entry point calls `initialize_from_env` before
any jax work, and the host-side shell (trainer, sampler) moves arrays
through `global_arrays` and `to_host`, so the same code runs when the mesh
spans processes (one per host on a cluster, or `experiments.launch`'s local
processes on CPU).

The scheme (WORKSPACE.md, "Several processes"): every process runs the same
host code with the same seed, so host-side data (prompts, rewards, plans,
micro-batches) is the same everywhere. A host array enters jit as a global
array that every process builds from its own full copy, each contributing
the shards its devices hold (`jax.make_array_from_callback`); an array the
host reads back is gathered from all processes (`process_allgather`), since
`jax.device_get` cannot fetch shards another process holds. Only process 0
writes logs and plots (`is_primary`); checkpoints are written by all of
them together (orbax coordinates).

Environment (set by `experiments.launch`, or by hand):
  FOREMOE_COORDINATOR_ADDRESS  host:port of process 0's coordinator
  FOREMOE_NUM_PROCESSES        number of processes
  FOREMOE_PROCESS_ID           this process's id, 0 .. N-1
  FOREMOE_DISTRIBUTED=auto     instead of the three above: let
                               `jax.distributed.initialize()` detect them
                               (Cloud TPU pod slices, SLURM, Open MPI)
"""
from __future__ import annotations

import os
import pickle
import sys

import numpy as np

# jax is imported inside the functions that use it: the host-side loggers
# (utils/metrics.py, utils/tensorboard.py) and the launcher import this
# module and stay jax-free.

COORDINATOR_ENV = 'FOREMOE_COORDINATOR_ADDRESS'
NUM_PROCESSES_ENV = 'FOREMOE_NUM_PROCESSES'
PROCESS_ID_ENV = 'FOREMOE_PROCESS_ID'
AUTO_ENV = 'FOREMOE_DISTRIBUTED'


def initialize_from_env(environ=None) -> bool:
  """Joins the distributed runtime the environment describes; False (and
  nothing done) when it describes none.

  Must run before anything touches a jax backend. On CPU the processes
  exchange collectives over TCP with gloo (jaxlib's CPU client picks it
  from `jax_cpu_collectives_implementation` when the distributed client
  exists; without one each process would only see its own devices).
  """
  import jax  # pylint: disable=g-import-not-at-top
  env = os.environ if environ is None else environ
  if env.get(AUTO_ENV, '').lower() in ('auto', '1', 'true'):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize()
    return True
  names = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
  given = [n for n in names if env.get(n)]
  if not given:
    return False
  # A ConfigError, so an entry point (utils.cli) says it in one line.
  from foremoe_jax.config import ConfigError  # pylint: disable=g-import-not-at-top
  if len(given) != len(names):
    missing = sorted(set(names) - set(given))
    raise ConfigError(f'distributed run: {", ".join(given)} set but '
                      f'{", ".join(missing)} missing')
  try:
    num, index = int(env[NUM_PROCESSES_ENV]), int(env[PROCESS_ID_ENV])
  except ValueError:
    num = index = -1
  if not 0 <= index < num:
    raise ConfigError(
        f'distributed run: {PROCESS_ID_ENV}={env[PROCESS_ID_ENV]!r} must be '
        f'an integer in [0, {NUM_PROCESSES_ENV}) and {NUM_PROCESSES_ENV}='
        f'{env[NUM_PROCESSES_ENV]!r} an integer >= 1')
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # All three given: skip the cluster auto-detection (it would look for
  # SLURM / MPI variables that a local launch may inherit).
  jax.distributed.initialize(env[COORDINATOR_ENV], num_processes=num,
                             process_id=index,
                             cluster_detection_method='deactivate')
  return True


def is_primary() -> bool:
  """True in the process that writes logs, plots and summaries (process 0).

  A process that has not loaded jax runs no distributed job: it is primary.
  """
  jax = sys.modules.get('jax')
  return jax is None or jax.process_index() == 0


def prints_output(environ=None) -> bool:
  """Whether this process prints progress and errors: process 0 of a job,
  or a process alone.

  Unlike `is_primary` it never starts a jax backend, so an entry point's
  error path may call it before `initialize_from_env`: it reads the process
  id the launcher (or the user) set, else jax's process index once the
  distributed runtime is up, else answers True.
  """
  env = os.environ if environ is None else environ
  if env.get(PROCESS_ID_ENV):
    return env[PROCESS_ID_ENV].strip() == '0'
  jax = sys.modules.get('jax')
  if jax is None:
    return True
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  if getattr(jax_distributed.global_state, 'client', None) is None:
    return True
  return jax.process_index() == 0


def quiet_unless_primary() -> bool:
  """Sends this process's Python stdout to /dev/null unless it is process
  0; returns whether it did.

  Every process runs the same host code with the same seed, so their
  progress lines (and summaries) are the same; only process 0's are
  printed, as only it writes logs and plots. stderr stays: a warning or
  a traceback of any process still shows. Call after `initialize_from_env`.
  """
  if is_primary():
    return False
  sys.stdout.flush()
  sys.stdout = open(os.devnull, 'w')  # pylint: disable=consider-using-with
  return True


def global_array(x, sharding):
  """A global jax.Array with `sharding` from the full host value `x`, which
  every process holds identically; each process fills only its devices'
  shards."""
  import jax  # pylint: disable=g-import-not-at-top
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def global_arrays(tree, mesh, spec=None):
  """`global_array` over a pytree of host arrays, every leaf laid out as the
  PartitionSpec `spec` on `mesh` (default: replicated)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  sharding = NamedSharding(mesh, P() if spec is None else spec)
  return jax.tree.map(lambda x: global_array(x, sharding), tree)


def settle(tree):
  """`tree`, once computed, when several CPU devices share this process;
  at once elsewhere.

  XLA:CPU runs a multi-device program's devices on the host's shared
  threads. A second such program dispatched while the first still runs
  can take the threads that the first's collectives wait for; its devices
  then wait at their own first collective for devices that never come, and
  past XLA's 40 s rendezvous timeout the process aborts (seen here:
  consecutive warm-start steps of d_model 256 aborted every run within 60
  steps; settled after each step, never). Callers that dispatch programs
  back to back settle the first.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() == 'cpu' and jax.local_device_count() > 1:
    jax.block_until_ready(tree)
  return tree


def to_host(tree):
  """numpy copies of a pytree of arrays, whichever processes hold them.

  Fully addressable leaves are fetched with `jax.device_get`; the rest are
  gathered from every process (a collective: all processes must call this
  with the same tree, in the same order).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  def fetch(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return jax.device_get(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(fetch, tree)


def max_over_processes(value: int) -> int:
  """The largest of every process's `value` (`value` itself when the job is
  one process, with no collective). All processes must call it together;
  they all get the same answer, so they take the same branch after it."""
  jax = sys.modules.get('jax')
  if jax is None or jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.max(multihost_utils.process_allgather(
      np.asarray(value, np.int32))))


def from_process_0(obj):
  """Process 0's `obj` on every process (`obj` itself when the job is one
  process, with no collective): for host data that may differ between
  processes although their inputs agree, as a plan made against each
  process's own clock does when one misses its deadline and another not.
  All processes must call it together. A pickle, sent as bytes."""
  jax = sys.modules.get('jax')
  if jax is None or jax.process_count() == 1:
    return obj
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  primary = jax.process_index() == 0
  data = np.frombuffer(pickle.dumps(obj) if primary else b'', np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(
      np.asarray(data.size, np.int32)))
  buf = np.zeros(size, np.uint8)
  if primary:
    buf[:] = data
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return obj if primary else pickle.loads(buf.tobytes())
