"""Token split (planner.split) against independent references."""
import numpy as np
import pytest
from scipy.optimize import linprog

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import packing, split
from foremoe_jax.planner.topology import Topology

import planner_testlib as lib


def lp_min_max(se_S, w_E, topo):
  """Min over splits of the max device load (reference LP)."""
  num_slots = len(se_S)
  c = np.zeros(num_slots + 1)
  c[-1] = 1.0
  a_eq = np.zeros((len(w_E), num_slots + 1))
  a_eq[se_S, np.arange(num_slots)] = 1.0
  a_ub = np.zeros((topo.num_devices, num_slots + 1))
  a_ub[topo.device_of_slot(), np.arange(num_slots)] = 1.0
  a_ub[:, -1] = -1.0
  res = linprog(c, A_ub=a_ub, b_ub=np.zeros(topo.num_devices), A_eq=a_eq,
                b_eq=w_E, bounds=[(0, None)] * (num_slots + 1), method='highs')
  return res.fun


def test_water_fill_levels_bins():
  base = np.array([[1.0, 5.0, 2.0, 9.0]])
  valid = np.array([[True, True, True, False]])
  x = split.water_fill(base, np.array([6.0]), valid)
  # Level 4.5: bins at 1 and 2 fill to it, 5 and the invalid 9 stay.
  np.testing.assert_allclose(x, [[3.5, 0.0, 2.5, 0.0]])
  assert split.fill_level(base, np.array([0.0]), valid)[0] == 1.0


@pytest.mark.parametrize('sweeps', [4])
def test_balanced_flows_near_lp_optimum(sweeps):
  trace, topo = lib.one_node()
  se_LS = packing.hierarchical_placement(
      trace.step(0).sum(axis=(0, 2)), topo).astype(np.int64)
  w_LE = trace.step(1)[0].sum(axis=1).astype(np.float64)
  x_LS, y_LD = split.balanced_flows(se_LS, w_LE, topo, sweeps=sweeps)
  # Flows conserve every expert's load and match the device totals.
  sums = np.zeros_like(w_LE)
  for l in range(se_LS.shape[0]):
    np.add.at(sums[l], se_LS[l], x_LS[l])
  np.testing.assert_allclose(sums, w_LE, rtol=1e-9)
  np.testing.assert_allclose(y_LD, split.device_totals(x_LS, topo))
  for l in range(se_LS.shape[0]):
    opt = lp_min_max(se_LS[l], w_LE[l], topo)
    assert y_LD[l].max() <= opt * 1.01 + 1e-6
    assert y_LD[l].max() >= opt * (1 - 1e-9)


@pytest.mark.parametrize('nodes', [1, 2])
def test_split_tokens_exact(nodes):
  trace, topo = lib.one_node() if nodes == 1 else lib.two_nodes()
  loads_LDE = trace.step(1)[2]
  se_LS = packing.hierarchical_placement(
      trace.step(0).sum(axis=(0, 2)), topo).astype(np.int64)
  x_LS, _ = split.balanced_flows(se_LS, loads_LDE.sum(1), topo)
  for prefer_local in (False, True):
    share_LDS, slot_LS, cell_L = split.split_tokens(loads_LDE, se_LS, x_LS,
                                                     topo, prefer_local)
    p = placement_lib.Placement(se_LS.astype(np.int32), share_LDS)
    placement_lib.validate_placement(p, loads_LDE.shape[-1],
                                     topo.slots_per_device)
    counts_LDS = placement_lib.slot_counts(loads_LDE, p)
    np.testing.assert_array_equal(counts_LDS.sum(1), slot_LS)
    np.testing.assert_array_equal(counts_LDS.max(axis=(1, 2)), cell_L)
    # The same shares as placement.shares_from_slot_counts gives.
    np.testing.assert_array_equal(
        share_LDS, placement_lib.shares_from_slot_counts(counts_LDS, se_LS))
    # The integer split follows the flows to within rounding.
    assert np.abs(slot_LS - x_LS).max() <= topo.num_devices


def test_prefer_local_keeps_tokens_on_node():
  trace, topo = lib.two_nodes()
  loads_LDE = trace.step(1)[0]
  se_LS = packing.hierarchical_placement(loads_LDE.sum(1), topo).astype(np.int64)
  x_LS, _ = split.balanced_flows(se_LS, loads_LDE.sum(1), topo)
  node_S = topo.node_of_device()[topo.device_of_slot()]
  node_D = topo.node_of_device()

  def cross(prefer_local):
    counts = split.split_counts(loads_LDE, se_LS, x_LS, topo, prefer_local)
    return sum(counts[:, d, node_S != node_D[d]].sum()
               for d in range(topo.num_devices))

  assert cross(True) < cross(False)
  # Per-slot totals (hence device loads) do not depend on the preference.
  _, a, _ = split.split_tokens(loads_LDE, se_LS, x_LS, topo, True)
  _, b, _ = split.split_tokens(loads_LDE, se_LS, x_LS, topo, False)
  assert np.abs(a - b).max() <= topo.num_devices


def test_uniform_flows_is_even_split():
  se = np.array([[0, 1, 0, 2, 0, 1]])
  w = np.array([[6.0, 4.0, 1.0]])
  np.testing.assert_allclose(split.uniform_flows(se, w),
                             [[2.0, 2.0, 2.0, 1.0, 2.0, 2.0]])
