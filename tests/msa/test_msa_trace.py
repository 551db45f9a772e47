"""trace.py: per-kernel sums of a profiler trace, by hand and on a real
CPU trace."""
import types

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.msa import trace


def _line(name, events):
  return types.SimpleNamespace(name=name, events=[
      types.SimpleNamespace(name=n, start_ns=s, duration_ns=d)
      for s, d, n in events])


def test_busy_is_the_union_of_the_intervals():
  # [0, 10) and [5, 12) overlap (12 ns), [12, 13) touches, [20, 25) apart,
  # [21, 22) nested: 12 + 1 + 5.
  events = [(5, 7, 'b'), (0, 10, 'a'), (12, 1, 'c'), (20, 5, 'd'),
            (21, 1, 'e')]
  assert trace.busy_ns(events) == 18
  assert trace.busy_ns([]) == 0


def test_summary_of_two_calls_by_hand():
  # Two calls of: scores 30 ns, top-k 10 ns, then a 20 ns gap, combine
  # 5 ns; the second call starts 100 ns after the first.
  one = [(0, 30, 'scores'), (30, 10, 'topk'), (60, 5, 'combine')]
  events = one + [(s + 100, d, n) for s, d, n in one]
  out = trace.summarize(events, calls=2, top=2)
  assert out['kernels'] == 3
  assert out['span_us'] == pytest.approx(165 / 2 / 1e3)
  assert out['busy_us'] == pytest.approx(45 / 1e3)
  assert out['idle_share'] == pytest.approx(1 - 90 / 165)
  assert [k['name'] for k in out['top']] == ['scores', 'topk']
  assert out['top'][0]['us'] == pytest.approx(30 / 1e3)
  assert out['top'][0]['launches'] == 1
  assert out['top'][0]['share'] == pytest.approx(60 / 90)
  assert trace.summarize([], calls=3)['kernels'] == 0


def test_gpu_streams_are_read_and_derived_lines_left_out():
  gpu = types.SimpleNamespace(name='/device:GPU:0', lines=[
      _line('Stream #13(Compute)', [(0, 4, 'msa_index_scores')]),
      _line('Stream #14', [(4, 2, 'fusion.3')]),
      # A derived line repeats the stream's kernels as XLA ops.
      _line('XLA Ops', [(0, 6, 'custom-call.1')]),
      _line('XLA Modules', [(0, 6, 'jit_step')])])
  host = types.SimpleNamespace(name='/host:CPU', lines=[
      _line('tf_XLAEigen/1', [(0, 9, 'host-op')])])
  source, events = trace.plane_events([host, gpu])
  assert source == 'gpu'
  assert sorted(events) == [(0, 4, 'msa_index_scores'), (4, 2, 'fusion.3')]
  # A GPU plane whose lines are not named as streams: every line but the
  # derived ones.
  other = types.SimpleNamespace(name='/device:GPU:0', lines=[
      _line('0', [(0, 4, 'k')]), _line('Launch Stats', [(0, 4, 'k')])])
  assert trace.plane_events([other]) == ('gpu', [(0, 4, 'k')])
  # No GPU: XLA's threads, without the runtime's markers.
  cpu = types.SimpleNamespace(name='/host:CPU', lines=[
      _line('tf_XLAEigen/1', [(0, 9, 'fusion'), (9, 1, 'end: fusion')]),
      _line('python', [(0, 50, 'f')])])
  assert trace.plane_events([cpu]) == ('cpu', [(0, 9, 'fusion')])


def test_a_real_cpu_trace():
  x = jnp.ones((256, 256))
  out = trace.profile(lambda a: jnp.tanh(a @ a) @ a, (x,), calls=2)
  assert out['source'] == 'cpu' and out['calls'] == 2
  assert out['kernels'] > 0 and out['top']
  assert 0 < out['busy_us'] <= out['span_us'] * (1 + 1e-9)
  assert 0 <= out['idle_share'] < 1
