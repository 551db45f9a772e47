"""Where a compiled step's device time goes, by kind of XLA op.

Reads a `jax.profiler` trace of one call and the compiled program's HLO
text, and sums each op's *exclusive* time (its own span minus the spans of
the ops nested in it, e.g. a while loop minus its body's ops) per thread,
then per category:

* ``expert_ffn``: ops under the ``grouped_swiglu`` name scope: the expert
  SwiGLU after dispatch (its tile layout and GEMMs), forward and backward;
  what balancing the experts' rows shrinks;
* ``matmul``: every other dot (attention, router, projections, logits);
* ``collective``: all-to-alls, gathers, reductions, permutes and the
  waits of their rendezvous;
* ``copy``: slices, updates of slices, copies, broadcasts, gathers and
  scatters (memory traffic that moves data without arithmetic);
* ``other``: elementwise fusions, reductions, control flow.

On CPU the trace has one thread per simulated device ('tf_XLAEigen/...';
a lone device runs on its client thread), and with more devices than
cores the threads share the cores, so a
thread's span counts time it waited for a core too: shares between
categories are what to read, not seconds. Plain Python over the trace's
events; jax is imported only to read a trace file.
"""
from __future__ import annotations

import collections
import glob
import os
import re

CATEGORIES = ('expert_ffn', 'matmul', 'collective', 'copy', 'other')
EXPERT_SCOPE = 'grouped_swiglu'  # `model.grouped_swiglu.SCOPE`.

_COLLECTIVE = re.compile(
    r'^(all-to-all|all_to_all|all-gather|all_gather|all-reduce|all_reduce|'
    r'reduce-scatter|collective-permute|ppermute|psum|pmax|Rendezvous|'
    r'InvokeRendezvous|Wait)')
_COPY = re.compile(r'(dynamic-slice|dynamic-update-slice|dynamic_slice|'
                   r'dynamic_update_slice|copy|broadcast|gather|scatter|'
                   r'slice|concatenate|transpose|pad)')
_MATMUL = re.compile(r'(^ynn_fusion|dot|convolution|gemm|matmul)')
_CONTROL = ('ThunkExecutor::Execute',)


def hlo_op_names(hlo_text: str) -> dict:
  """{instruction name: its op_name metadata} of compiled HLO text (the
  JAX-level path, with name scopes, of what each op came from)."""
  out = {}
  for m in re.finditer(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?op_name="([^"]*)"',
                       hlo_text, re.M):
    out[m.group(1)] = m.group(2)
  return out


def category(event: str, op_name: str = '') -> str:
  """The category of one trace event (an HLO instruction or a runtime
  span), given its op_name (empty when unknown)."""
  if EXPERT_SCOPE in op_name:
    return 'expert_ffn'
  if _COLLECTIVE.match(event):
    return 'collective'
  if _MATMUL.search(event):
    return 'matmul'
  if event in _CONTROL or event.startswith(('while', 'conditional', 'call')):
    return 'other'
  if _COPY.search(event):
    return 'copy'
  return 'other'


def exclusive_seconds(lines) -> tuple[collections.Counter, collections.Counter]:
  """({event name: exclusive seconds}, {event name: count}) over `lines`,
  each an iterable of (start_ns, duration_ns, name) on one thread; an
  event nested in another (starts inside it) is subtracted from it."""
  excl, count = collections.Counter(), collections.Counter()
  for events in lines:
    stack = []  # [end_ns, name, duration_ns, children_ns]

    def close():
      end, name, dur, children = stack.pop()
      excl[name] += (dur - children) / 1e9

    for start, dur, name in sorted(events, key=lambda e: (e[0], -e[1])):
      while stack and stack[-1][0] <= start:
        close()
      if stack:
        stack[-1][3] += dur
      stack.append([start + dur, name, dur, 0])
      count[name] += 1
    while stack:
      close()
  return excl, count


def breakdown(excl, count, op_names: dict, top: int = 12) -> dict:
  """Shares of the total exclusive time per category, and the `top`
  costliest ops with their category, count and op_name."""
  total = sum(excl.values())
  per = collections.Counter()
  for name, sec in excl.items():
    per[category(name, op_names.get(name, ''))] += sec
  ops = [dict(op=name, category=category(name, op_names.get(name, '')),
              share=sec / total if total else 0.0, count=count[name],
              op_name=op_names.get(name, '')[-160:])
         for name, sec in excl.most_common(top)]
  return dict(shares={c: (per[c] / total if total else 0.0)
                      for c in CATEGORIES},
              thread_seconds=total, top_ops=ops)


def _is_marker(name: str) -> bool:
  """Runtime spans that are not an op: completion markers, thread-pool
  regions, and a client thread's wait for the devices it launched (whose
  ops are on the devices' threads)."""
  return (name.startswith(('end: ', 'ThreadpoolListener'))
          or name.endswith('(wait for completion)'))


def device_thread_events(trace_dir: str, thread_prefix: str = 'tf_XLA'):
  """The op events of XLA's threads in the newest trace under trace_dir,
  as `exclusive_seconds` takes them (on CPU a lone device runs on its
  client thread, several devices on 'tf_XLAEigen' threads)."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  files = sorted(glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'),
                           recursive=True), key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f'no *.xplane.pb trace under {trace_dir}')
  data = ProfileData.from_file(files[-1])
  lines = []
  for plane in data.planes:
    for line in plane.lines:
      if line.name.startswith(thread_prefix):
        lines.append([(e.start_ns, e.duration_ns, e.name)
                      for e in line.events if not _is_marker(e.name)])
  return lines
