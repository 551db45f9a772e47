"""bench_rl_step's idle twin of a step's transfer (`_installed`): the same
local work, nothing across devices, so the update timed with it differs
from the real one by the transfers alone (its exposed_transfer_s)."""
import numpy as np
import pytest

from foremoe_jax import placement as placement_lib
from foremoe_jax.benchmarks import rl_step
from foremoe_jax.planner.topology import Topology
from foremoe_jax.transfer import engine, schedule

D = 8


def _device_fields(st):
  return {(k, f): np.asarray(v)
          for k in ('fill', 'steps', 'flush')
          for f, v in engine.device_transition(getattr(st, k)).items()}


@pytest.mark.parametrize('mode', ['exact', 'rounds'])
def test_static_layout_has_nothing_to_idle(mode):
  """Static EP moves nothing: its twin is itself, field for field (the
  twin used to switch off the gradients' home adds and copy slot 0 into
  every slot at every transition: local work static pays too)."""
  topo = Topology(1, D, 3)
  home = placement_lib.identity_placement(2, 16, D, 3).slot_expert
  se_MLS = np.broadcast_to(home, (4,) + home.shape)
  st = schedule.build_step_transfer(
      se_MLS, 16, topo, schedule.TransferBudget(8, 2, mode=mode))
  real, idle = _device_fields(st), _device_fields(rl_step._installed(st))  # pylint: disable=protected-access
  assert real.keys() == idle.keys()
  for k in real:
    np.testing.assert_array_equal(idle[k], real[k], err_msg=str(k))


@pytest.mark.parametrize('mode', ['exact', 'rounds'])
def test_moves_are_idled_and_local_work_kept(mode):
  rng = np.random.default_rng(0)
  topo = Topology(2, D // 2, 3)
  se_MLS = np.stack([rng.permutation(np.arange(24) % 16).reshape(1, 24)
                     for _ in range(4)])
  st = schedule.build_step_transfer(
      se_MLS, 16, topo, schedule.TransferBudget(24, 24, mode=mode))
  assert st.remote_fills_M().sum() > 0
  idle = rl_step._installed(st)  # pylint: disable=protected-access
  for k in ('fill', 'steps', 'flush'):
    t, i = getattr(st, k), getattr(idle, k)
    for f in ('local_src_LS', 'evict_LS', 'ret_local_LS'):
      np.testing.assert_array_equal(getattr(i, f), getattr(t, f))
    sends = (('count_LPDD', 'ret_count_LPDD') if mode == 'exact'
             else ('shift_LR', 'ret_shift_LR'))
    for f in sends:
      assert not getattr(i, f).any(), (k, f)
