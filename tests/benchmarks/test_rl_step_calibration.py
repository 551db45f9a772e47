"""The validation's calibration runs are timed one repetition at a time,
so `rl_step.run` can interleave them with the methods' repetitions."""
import numpy as np
import pytest

from foremoe_jax.benchmarks import rl_step


class _FakeRL:
  """Records the order of the programs run, each returning a jax-free
  value (block_until_ready passes plain values through)."""

  def __init__(self):
    self.calls = []

  def recompute(self, state, batch, layout):
    self.calls.append(('recompute', batch['id'], layout.capacity))
    return np.zeros(1)

  def update(self, state, batch, logps, plan):
    self.calls.append(('update', batch['id'], plan))
    return np.zeros(1)


def _calib(n):
  return dict(logps=np.zeros(1), runs=[
      dict(batch={'id': i}, capacity=100 * (i + 1), cell=8, plan=f'plan{i}',
           times=[], recompute_times=[]) for i in range(n)])


def test_one_repetition_times_each_run_once_recompute_then_update():
  rl, calib = _FakeRL(), _calib(3)
  state = {'w': np.ones(2)}
  rl_step._time_calibration(rl, state, calib)  # pylint: disable=protected-access
  assert rl.calls == [c for i in range(3) for c in (
      ('recompute', i, 100 * (i + 1)), ('update', i, f'plan{i}'))]
  for r in calib['runs']:
    assert len(r['times']) == 1 and len(r['recompute_times']) == 1
    assert r['times'][0] >= 0 and r['recompute_times'][0] >= 0
  rl_step._time_calibration(rl, state, calib)  # pylint: disable=protected-access
  assert all(len(r['times']) == 2 for r in calib['runs'])


def test_the_compiling_pass_records_nothing():
  rl, calib = _FakeRL(), _calib(2)
  rl_step._time_calibration(rl, {'w': np.ones(2)}, calib, record=False)  # pylint: disable=protected-access
  assert len(rl.calls) == 4
  assert all(not r['times'] and not r['recompute_times']
             for r in calib['runs'])


def _ladder_bucket(skew):
  """A stand-in bucket of a skew: the rung of the ladder 1000, 1250, 1563,
  1954, 2443, 3054, ... (x1.25, rounded up) that holds 1000 * (1 + 4 *
  skew) rows (skew 0: the balanced bucket)."""
  rows, b = 1000 * (1 + 4 * skew), 1000
  while b < rows - 1e-9:
    b = int(np.ceil(b * 1.25))
  return b


def test_calibration_skews_are_moved_off_the_judged_buckets():
  judged = {_ladder_bucket(0.0), _ladder_bucket(0.2)}
  assert judged == {1000, 1954}
  chosen = rl_step.held_out_skews((0.0, 0.2, 0.22), _ladder_bucket, judged)
  assert [c[0] for c in chosen] == [0.0, 0.2, 0.22]
  buckets = [_ladder_bucket(c[1]) for c in chosen]
  # Disjoint from the judged ones and from each other.
  assert not set(buckets) & judged and len(set(buckets)) == 3
  # Each moved by the fewest SKEW_STEPs that do it, by hand: skew 0 leaves
  # 1000 at 0.02 (1080 rows: 1250); 0.2 leaves 1954 at 0.24 (1960 rows:
  # 2443); 0.22 (1880 rows: 1954, judged) reaches 2443 at 0.24 too, taken
  # by the run before, and leaves it at 0.38 (2520 rows: 3054).
  assert [c[1] for c in chosen] == [0.02, 0.24, 0.38]
  assert buckets == [1250, 2443, 3054]


def test_calibration_skews_that_cannot_be_held_out_raise():
  with pytest.raises(ValueError, match='no calibration skew'):
    rl_step.held_out_skews((0.9,), lambda s: 7, {7})
