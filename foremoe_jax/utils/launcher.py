"""Local multi-process launch: N processes of one entry point, one mesh.

The stand-in for a cluster's launcher (a TPU pod slice's one process per
host, SLURM's srun) on one machine: `experiments.launch` starts N
`python -m MODULE FLAGS` processes, each with K simulated CPU devices and
the FOREMOE_* variables that `utils.distributed.initialize_from_env` reads,
so together they hold one mesh of N * K devices. Each child's output is
streamed with a `[pI]` prefix; when a child fails the others are stopped
and the launch fails with the child's status. Plain Python (no jax): the
launcher itself never starts a backend.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from foremoe_jax.utils.distributed import (COORDINATOR_ENV, NUM_PROCESSES_ENV,
                                           PROCESS_ID_ENV)

_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'
# How long stopped children get to exit after SIGTERM before SIGKILL.
_GRACE_S = 10.0
# After a forwarded SIGINT/SIGTERM: how long the other children may take to
# finish their step and checkpoint once one child has exited.
_STOP_WAIT_S = 120.0


def free_port() -> int:
  """A TCP port free on localhost now (the coordinator binds it shortly
  after; another program could take it in between, which fails loudly)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def xla_flags_with_devices(xla_flags: str, devices: int) -> str:
  """`xla_flags` with the simulated CPU device count set to `devices`
  (replacing any count already there, such as the test suite's 8)."""
  flags = re.sub(rf'{_DEVICE_COUNT_FLAG}=\S*', '', xla_flags or '').split()
  return ' '.join(flags + [f'{_DEVICE_COUNT_FLAG}={devices}'])


def process_env(base: dict, process_id: int, num_processes: int,
                devices_per_process: int, coordinator: str) -> dict:
  """The environment of child `process_id`."""
  env = dict(base)
  env['XLA_FLAGS'] = xla_flags_with_devices(env.get('XLA_FLAGS', ''),
                                            devices_per_process)
  env.setdefault('JAX_PLATFORMS', 'cpu')  # Simulated devices are CPU ones.
  env[COORDINATOR_ENV] = coordinator
  env[NUM_PROCESSES_ENV] = str(num_processes)
  env[PROCESS_ID_ENV] = str(process_id)
  env['PYTHONUNBUFFERED'] = '1'  # Lines reach the prefixer as printed.
  return env


# gloo's C++ side prints one line per communicator it connects (24 for
# the tiny job on 2 processes) to stdout, with no switch to turn it off.
# Its threads write unsynchronised, so lines come interleaved, word by word
# ("[Gloo] Rank [Gloo] Rank 1 is connected ...", "... to 7[Gloo] Rank 2
# ...", the other thread's tail alone, or its last number on a line of its
# own). A number may run into the next thread's word ("to 3Expected"), so
# a line is cut into its marker, words, numbers and punctuation, not at
# spaces. A line is gloo's when it carries the message's marker and nothing
# but the message's words, numbers and punctuation.
_GLOO_WORDS = frozenset(['[Gloo]', 'Rank', 'is', 'connected', 'to', 'peer',
                         'ranks', 'Expected', 'number', 'of', '.', ':'])
_GLOO_TOKEN = re.compile(r'\[Gloo\]|[A-Za-z]+|\d+|\S')


def _only_gloo_words(text: str) -> bool:
  return all(w in _GLOO_WORDS or w.isdigit()
             for w in _GLOO_TOKEN.findall(text))


def is_gloo_noise(text: str) -> bool:
  """True for gloo's connect lines, whole or interleaved fragments."""
  if '[Gloo] Rank' not in text and 'peer ranks' not in text:
    return False
  return _only_gloo_words(text)


def drop_gloo_noise(lines):
  """`lines` without gloo's connect lines, nor what follows one with only
  the message's words in it (a blank line, a bare number, " is connected
  to ": a message's tail cut off by another thread's newline)."""
  after_noise = False
  for text in lines:
    if is_gloo_noise(text) or (after_noise and _only_gloo_words(text)):
      after_noise = True
      continue
    after_noise = False
    yield text


def _stream(proc: subprocess.Popen, prefix: str, out, lock) -> None:
  lines = (line.decode('utf-8', errors='replace').rstrip('\n')
           for line in iter(proc.stdout.readline, b''))
  for text in drop_gloo_noise(lines):
    with lock:
      out.write(f'{prefix}{text}\n')
      out.flush()


def _stop(procs, sig=signal.SIGTERM) -> None:
  """Signals the children still running, then kills those that outlive the
  grace period."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(sig)
  deadline = time.monotonic() + _GRACE_S
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def _shell_status(returncode: int) -> int:
  """Popen's -N (killed by signal N) as a shell reports it: 128 + N."""
  return 128 - returncode if returncode < 0 else returncode


def launch(module: str, args: list[str], num_processes: int,
           devices_per_process: int, *, out=None, env=None,
           poll_s: float = 0.1) -> int:
  """Runs `python -m module *args` as `num_processes` processes; returns 0
  when all succeed, else the first failure's status (a child killed by a
  signal counts as 128 + the signal, as a shell reports it).

  A SIGINT or SIGTERM to the launcher is passed on to every child (the
  entry point's own handling applies) and the launcher then waits for them.
  """
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError(f'num_processes ({num_processes}) and '
                     f'devices_per_process ({devices_per_process}) must be '
                     f'>= 1')
  out = sys.stdout if out is None else out
  base = dict(os.environ if env is None else env)
  coordinator = f'localhost:{free_port()}'
  lock = threading.Lock()
  procs, threads = [], []
  for i in range(num_processes):
    p = subprocess.Popen(
        [sys.executable, '-m', module, *args],
        env=process_env(base, i, num_processes, devices_per_process,
                        coordinator),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        # Their own session: a terminal's Ctrl-C reaches the children only
        # through `forward` below, once; a second copy from the terminal's
        # process group would count as "signal again, abort now".
        start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_stream, args=(p, f'[p{i}] ', out, lock),
                         daemon=True)
    t.start()
    threads.append(t)

  forwarded = []

  def forward(signum, frame):
    del frame
    forwarded.append(signum)
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)
  # Handlers can only be set from the main thread (tests call from others).
  on_main = threading.current_thread() is threading.main_thread()
  old = ({s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
         if on_main else {})
  status, first_exit = 0, None
  try:
    while True:
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes):
        bad = [c for c in codes if c != 0]
        status = _shell_status(bad[0]) if bad else 0
        break
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if first_exit is None and any(c is not None for c in codes):
        first_exit = time.monotonic()
      # After a forwarded signal every child stops on its own (checkpoint
      # first), so a child's non-zero exit is expected; only one that
      # outlives the others by _STOP_WAIT_S is stopped.
      if failed and (not forwarded
                     or time.monotonic() - first_exit > _STOP_WAIT_S):
        i, c = failed[0]
        status = _shell_status(c)
        with lock:
          out.write(f'[launch] process {i} exited with status {status}; '
                    f'stopping the others\n')
          out.flush()
        _stop(procs)
        break
      time.sleep(poll_s)
  finally:
    for s, h in old.items():
      signal.signal(s, h)
    if any(p.poll() is None for p in procs):
      _stop(procs)
    for t in threads:
      t.join(timeout=5.0)
  return status
