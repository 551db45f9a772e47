"""The validation's calibration runs are timed one repetition at a time,
so `rl_step.run` can interleave them with the methods' repetitions."""
import numpy as np

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
