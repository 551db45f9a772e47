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


@pytest.mark.parametrize('nodes', [1, 2])
def test_split_shares_sum_exactly_in_any_order(nodes):
  """split_tokens' shares are whole steps of 2^-24 that add up to exactly 1
  per (layer, source, expert), so an expert's cumulative bounds are the
  same float32 bits in slot order and in any other (the device's masked
  sum): each slot's upper bound is the next one's lower bound."""
  trace, topo = lib.one_node() if nodes == 1 else lib.two_nodes()
  loads_LDE = trace.step(1)[2]
  se_LS = packing.hierarchical_placement(
      trace.step(0).sum(axis=(0, 2)), topo).astype(np.int64)
  x_LS, _ = split.balanced_flows(se_LS, loads_LDE.sum(1), topo)
  share_LDS, _, _ = split.split_tokens(loads_LDE, se_LS, x_LS, topo)
  steps = share_LDS.astype(np.float64) * placement_lib.SHARE_GRID
  np.testing.assert_array_equal(steps, np.rint(steps))
  rng = np.random.default_rng(0)
  for l in range(se_LS.shape[0]):
    for e in np.flatnonzero(np.bincount(se_LS[l]) >= 2):
      slots = np.flatnonzero(se_LS[l] == e)
      for d in range(topo.num_devices):
        sh = share_LDS[l, d, slots]
        # In slot order and in a random one, every float32 running sum is
        # the exact (float64) sum of the same shares: no add rounds.
        for order in (np.arange(len(sh)), rng.permutation(len(sh))):
          run32 = np.float32(0.0)
          for k, j in enumerate(order):
            run32 = np.float32(run32 + sh[j])
            assert run32 == sh[order[:k + 1]].astype(np.float64).sum()
        assert run32 == 1.0


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


def test_uniform_flows_leave_a_devices_second_copy_idle():
  """A slot repeating an expert its device already holds (a packing's
  filler) gets no share and does not count as a replica: expert 0 on
  slot 0 (device 0) and slots 2 and 3 (device 1 twice) is split over two."""
  se = np.array([[0, 1, 0, 0]])  # Two devices of two slots.
  w = np.array([[6.0, 4.0]])
  np.testing.assert_allclose(split.uniform_flows(se, w, 2),
                             [[3.0, 4.0, 3.0, 0.0]])
  np.testing.assert_allclose(split.uniform_flows(se, w),
                             [[2.0, 4.0, 2.0, 2.0]])


def _remote_rows(loads_LDE, se_LS, x_LS, topo):
  """Rows each device receives from other nodes once `split_tokens` fills
  the flows (local first), counted from the exact cells: [L, D]."""
  share, _, _ = split.split_tokens(loads_LDE, se_LS, x_LS, topo)
  cells = placement_lib.cell_counts(loads_LDE,
                                    placement_lib.Placement(se_LS, share))
  node = topo.node_of_device()
  return (cells * (node[:, None] != node[None, :])).sum(axis=1)


def test_node_aware_flows_serve_each_node_from_its_own_replicas():
  """Two nodes of one device, both experts on both devices; node 0 routes
  100 tokens to expert 0, node 1 100 to expert 1. The even split keeps
  both devices at 100 rows but each takes 50 from the other node; the
  node-aware split (by hand) gives each expert to its own node's replica:
  still 100 rows each, none across."""
  topo = Topology(2, 1, 2)
  se_LS = np.array([[0, 1, 1, 0]])  # d0: e0, e1; d1: e1, e0.
  loads_LDE = np.array([[[100.0, 0.0], [0.0, 100.0]]])
  even = split.uniform_flows(se_LS, loads_LDE.sum(axis=1))
  np.testing.assert_allclose(_remote_rows(loads_LDE, se_LS, even, topo),
                             [[50, 50]])
  # Under the cap (1.1 x 100) each sweep moves part of the way: the
  # default two sweeps already cut the rows across nodes, and the sweeps
  # converge to the split by hand.
  x_LS, kept_L = split.node_aware_flows(se_LS, even, loads_LDE, topo,
                                        remote_weight=5.0, slack=0.1)
  assert not kept_L[0]
  assert _remote_rows(loads_LDE, se_LS, x_LS, topo).max() < 50
  x_LS, _ = split.node_aware_flows(se_LS, even, loads_LDE, topo,
                                   remote_weight=5.0, slack=0.1, sweeps=30)
  np.testing.assert_allclose(x_LS, [[100, 0, 100, 0]], atol=0.01)
  np.testing.assert_allclose(_remote_rows(loads_LDE, se_LS, x_LS, topo),
                             [[0, 0]])


def test_node_aware_flows_stay_under_the_compute_cap():
  """Node 0 routes 150 tokens to expert 0, node 1 50 to expert 1: all on
  their own nodes would load device 0 with 150 rows, past the cap of
  1.1 x 100. By hand the best under the cap: device 0 takes 110 of expert
  0 (its own node's), device 1 the other 40 (from node 0) and expert 1's
  50: 40 rows across nodes instead of the balanced split's 50. At a
  remote weight of 0.5 the 10 extra rows of compute cost more than the 10
  remote rows save, and the layer keeps its flows."""
  topo = Topology(2, 1, 2)
  se_LS = np.array([[0, 1, 1, 0]])
  loads_LDE = np.array([[[150.0, 0.0], [0.0, 50.0]]])
  balanced = np.array([[100.0, 0.0, 50.0, 50.0]])
  np.testing.assert_allclose(
      _remote_rows(loads_LDE, se_LS, balanced, topo).max(), 50)
  x_LS, kept_L = split.node_aware_flows(se_LS, balanced, loads_LDE, topo,
                                        remote_weight=5.0, slack=0.1,
                                        sweeps=30)
  assert not kept_L[0]
  y_D = split.device_totals(x_LS, topo)[0]
  assert y_D.max() <= 110 + 1e-6
  # Each expert's tokens are all placed.
  np.testing.assert_allclose(x_LS[0, [0, 3]].sum(), 150, atol=1e-6)
  np.testing.assert_allclose(x_LS[0, [1, 2]].sum(), 50, atol=1e-6)
  np.testing.assert_allclose(
      _remote_rows(loads_LDE, se_LS, x_LS, topo).max(), 40, atol=1.0)
  same, kept_L = split.node_aware_flows(se_LS, balanced, loads_LDE, topo,
                                        remote_weight=0.5, slack=0.1)
  assert kept_L[0]
  np.testing.assert_array_equal(same, balanced)


def test_grid_shares_moves_any_shares_onto_the_grid():
  """Shares made off the grid (here random ones per expert run) come back
  as whole steps of 2^-24, each within two steps of where it was, adding
  up to exactly 1 per (layer, source, expert)."""
  rng = np.random.default_rng(5)
  se = np.stack([rng.permutation(np.arange(24) % 6) for _ in range(2)])
  raw = rng.random((2, 3, 24))
  for l in range(2):
    for e in range(6):
      raw[l, :, se[l] == e] /= raw[l, :, se[l] == e].sum(axis=0)
  got = placement_lib.grid_shares(raw.astype(np.float32), se)
  steps = got.astype(np.float64) * placement_lib.SHARE_GRID
  np.testing.assert_array_equal(steps, np.rint(steps))
  assert np.abs(got - raw).max() <= 2.0 / placement_lib.SHARE_GRID
  for l in range(2):
    for e in range(6):
      np.testing.assert_array_equal(
          got[l][:, se[l] == e].sum(axis=1, dtype=np.float64), 1.0)
