"""Where one call's device time goes: a profiler trace, summed per kernel.

The GPU bench times whole functions (a decode step, a prefill); their
medians do not say whether a step is its kernels' time or the gaps
between a dozen small launches. `profile` traces a few back-to-back calls
of a compiled function and `summarize` reduces the trace to, per call:

* ``span_us``: first kernel start to last kernel end, over the calls;
* ``busy_us``: the union of the kernels' intervals (so ``span - busy`` is
  time the device sat idle between launches);
* ``kernels``: launches per call, and the costliest kernels by name with
  their time and launches per call.

On a GPU the kernels are the events of the stream lines of the
'/device:GPU:N' planes (derived lines such as 'XLA Ops' repeat them and
are left out). A CPU trace has no device plane; there the events of XLA's
threads stand in (the CPU dry run checks the plumbing, it measures
nothing). Plain Python over the trace's events; jax only reads the file.
"""
from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax

GPU_PLANE = '/device:GPU:'
# Lines a device plane may carry beside its streams, made from them.
DERIVED_LINES = ('XLA Modules', 'XLA Ops', 'Async XLA Ops', 'Launch Stats',
                 'Steps', 'TensorFlow Ops', 'TensorFlow Name Scope',
                 'Framework Ops', 'Framework Name Scope', 'Source code',
                 'Host Offload Ops', '_counters_')
CPU_THREADS = 'tf_XLA'
# CPU runtime spans that are not an op (op_profile's markers).
_CPU_MARKERS = ('end: ', 'ThreadpoolListener')


def _newest_trace(trace_dir: str) -> str:
  files = sorted(glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'),
                           recursive=True), key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f'no *.xplane.pb trace under {trace_dir}')
  return files[-1]


def kernel_events(trace_dir: str) -> tuple[str, list]:
  """(source, events) of the newest trace under trace_dir
  (`plane_events`)."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  return plane_events(ProfileData.from_file(_newest_trace(trace_dir)).planes)


def plane_events(planes) -> tuple[str, list]:
  """(source, events): 'gpu' with each GPU stream's (start_ns,
  duration_ns, name) kernels, or 'cpu' with XLA's threads' ops where no
  GPU plane has any. `planes`: a trace's, each with a name and lines, each
  line with a name and events (name, start_ns, duration_ns)."""
  gpu, cpu = [], []
  for plane in planes:
    if plane.name.startswith(GPU_PLANE):
      lines = [l for l in plane.lines if l.name not in DERIVED_LINES]
      streams = [l for l in lines if l.name.startswith('Stream')]
      for line in streams or lines:
        gpu += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    for line in plane.lines:
      if line.name.startswith(CPU_THREADS):
        cpu += [(e.start_ns, e.duration_ns, e.name) for e in line.events
                if not e.name.startswith(_CPU_MARKERS)
                and not e.name.endswith('(wait for completion)')]
  return ('gpu', gpu) if gpu else ('cpu', cpu)


def busy_ns(events) -> float:
  """Length of the union of the events' [start, start + duration)."""
  total, end = 0.0, float('-inf')
  for start, dur, _ in sorted(events):
    stop = start + dur
    if stop <= end:
      continue
    total += stop - max(start, end)
    end = stop
  return total


def summarize(events, calls: int, top: int = 10) -> dict:
  """Per call: span, busy time and launches, and the `top` kernels by
  total time (name, us and launches per call, share of the summed kernel
  time). `events`: (start_ns, duration_ns, name) of `calls` calls."""
  calls = max(1, calls)
  if not events:
    return {'calls': calls, 'kernels': 0, 'span_us': 0.0, 'busy_us': 0.0,
            'idle_share': 0.0, 'top': []}
  start = min(e[0] for e in events)
  stop = max(e[0] + e[1] for e in events)
  per_name, launches = collections.Counter(), collections.Counter()
  for _, dur, name in events:
    per_name[name] += dur
    launches[name] += 1
  summed = sum(per_name.values())
  span, busy = (stop - start) / calls, busy_ns(events) / calls
  return {
      'calls': calls,
      'kernels': len(events) / calls,
      'span_us': span / 1e3,
      'busy_us': busy / 1e3,
      'idle_share': 1.0 - busy / span if span else 0.0,
      'top': [{'name': name[:120], 'us': ns / calls / 1e3,
               'launches': launches[name] / calls,
               'share': ns / summed if summed else 0.0}
              for name, ns in per_name.most_common(top)],
  }


def profile(fn, args, calls: int = 3, trace_dir: str | None = None,
            top: int = 10) -> dict:
  """`fn(*args)` compiled and run once, then `calls` back-to-back calls
  traced and summarized (`summarize`, with 'source': 'gpu' or 'cpu')."""
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as tmp:
    where = trace_dir or tmp
    with jax.profiler.trace(where):
      outs = [compiled(*args) for _ in range(calls)]
      jax.block_until_ready(outs)
    del outs
    source, events = kernel_events(where)
  return {'source': source, **summarize(events, calls, top)}
