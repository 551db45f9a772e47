"""Hierarchical packing (planner.packing) against brute-force references."""
import numpy as np
import pytest

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import packing, split
from foremoe_jax.planner.topology import Topology

import planner_testlib as lib


def greedy_counts(w_E, num_slots, max_replicas):
  """EPLB's replica rule, one slot at a time."""
  r = np.ones(len(w_E), np.int64)
  for _ in range(num_slots - len(w_E)):
    per = np.where(r < max_replicas, w_E / r, -1.0)
    r[np.argmax(per)] += 1
  return r


def device_sets(se_LS, topo):
  return [[set(se_LS[l, d * topo.slots_per_device:(d + 1) * topo.slots_per_device])
           for d in range(topo.num_devices)] for l in range(se_LS.shape[0])]


def test_replica_counts_match_greedy():
  rng = np.random.default_rng(0)
  w_LE = rng.gamma(0.5, 100.0, size=(5, 24))
  r_LE = packing.replica_counts(w_LE, 40, 8)
  for l in range(5):
    ref = greedy_counts(w_LE[l], 40, 8)
    # Same max load per replica (ties may be broken differently).
    assert np.isclose((w_LE[l] / r_LE[l]).max(), (w_LE[l] / ref).max())
    assert r_LE[l].sum() == 40 and r_LE[l].min() >= 1 and r_LE[l].max() <= 8


@pytest.mark.parametrize('nodes,per_node,experts', [(1, 8, 32), (2, 4, 64),
                                                    (4, 2, 16)])
def test_hierarchical_placement_is_valid(nodes, per_node, experts):
  topo = Topology(nodes, per_node, experts // (nodes * per_node) + 2)
  rng = np.random.default_rng(1)
  w_LE = rng.gamma(0.7, 50.0, size=(3, experts))
  se_LS = packing.hierarchical_placement(w_LE, topo)
  assert se_LS.shape == (3, topo.num_slots)
  r_LE = packing.replica_counts(w_LE, topo.num_slots, topo.num_devices)
  for l in range(3):
    np.testing.assert_array_equal(np.bincount(se_LS[l], minlength=experts),
                                  r_LE[l])
    for d in range(topo.num_devices):
      held = se_LS[l, d * topo.slots_per_device:(d + 1) * topo.slots_per_device]
      assert len(set(held.tolist())) == topo.slots_per_device


def test_new_copies_and_overlap_brute_force():
  rng = np.random.default_rng(2)
  topo = Topology(2, 4, 5)
  make = lambda: np.stack([rng.permutation(np.concatenate(
      [np.arange(30), rng.integers(0, 30, 10)])) for _ in range(3)])
  a, b = make(), make()
  sa, sb = device_sets(a, topo), device_sets(b, topo)
  ref = np.array([[len(sa[l][d] - sb[l][d]) for d in range(8)] for l in range(3)])
  np.testing.assert_array_equal(packing.new_copies(a, b, topo), ref)
  intra, inter = packing.new_copies_by_link(a, b, topo)
  np.testing.assert_array_equal(intra + inter, ref)
  for l in range(3):
    for d in range(8):
      node = d // 4
      on_node = set().union(*sb[l][node * 4:(node + 1) * 4])
      assert inter[l, d] == len(sa[l][d] - sb[l][d] - on_node)


def test_align_to_current_keeps_balance_and_cuts_moves():
  trace, topo = lib.two_nodes()
  cur = packing.hierarchical_placement(trace.step(0).sum(axis=(0, 2)), topo)
  new = packing.hierarchical_placement(trace.step(1).sum(axis=(0, 2)), topo)
  aligned = packing.align_to_current(new, cur, topo)
  # The same multiset of device contents, and node groups stay together.
  for l in range(new.shape[0]):
    sets_new = device_sets(new, topo)[l]
    sets_al = device_sets(aligned, topo)[l]
    assert sorted(map(sorted, sets_new)) == sorted(map(sorted, sets_al))
    for nu in range(topo.num_nodes):
      group = sets_al[nu * 4:(nu + 1) * 4]
      assert any(sorted(map(sorted, group)) == sorted(map(sorted, sets_new[k * 4:(k + 1) * 4]))
                 for k in range(topo.num_nodes))
  assert (packing.new_copies(aligned, cur, topo).sum()
          <= packing.new_copies(new, cur, topo).sum())
  # Kept experts keep their slot index.
  kept = (aligned == cur)
  same_set = ~packing._incoming(packing.device_sets(aligned, topo),
                                packing.device_sets(cur, topo),
                                topo.slots_per_device).reshape(aligned.shape)
  assert (kept | ~same_set).all()


def test_home_anchored_placement_keeps_homes_and_balances():
  trace, topo = lib.one_node()
  loads_MLDE = trace.step(0)
  w_LE = loads_MLDE.sum(axis=(0, 2)).astype(np.float64)
  num_experts = w_LE.shape[1]
  se_LS = packing.home_anchored_placement(w_LE, topo)
  h = num_experts // topo.num_devices
  device_S = topo.device_of_slot()
  for l in range(se_LS.shape[0]):
    # Every expert has a copy on its home device ...
    for e in range(num_experts):
      assert (device_S[se_LS[l] == e] == e // h).any(), (l, e)
    # ... and the hot ones replicas elsewhere.
    hot = int(np.argmax(w_LE[l]))
    assert (se_LS[l] == hot).sum() >= 2
  # Spread evenly over the replicas, the step's load is better balanced
  # than static EP's.
  x_LS, y_LD = split.balanced_flows(se_LS, w_LE, topo)
  static_LD = np.stack([np.bincount(np.arange(num_experts) // h, w_LE[l],
                                    minlength=topo.num_devices)
                        for l in range(w_LE.shape[0])])
  assert (placement_lib.max_over_mean(y_LD)
          < placement_lib.max_over_mean(static_LD)).all()


@pytest.mark.parametrize('priced', (False, True))
def test_home_anchored_layers_are_packed_independently(priced):
  """The layers are packed side by side (one vectorised pass per replica
  rank): each layer's slots are those it gets packed alone, with the
  round pricing and the round cap, on two nodes."""
  trace, topo = lib.two_nodes()
  w_LE = trace.step(0).sum(axis=(0, 2)).astype(np.float64)
  w_LE[1] = w_LE[1][::-1]  # Layers with different hot experts.
  w_LE[2] = np.round(w_LE[2] / 50)  # And ties.
  cost, cap = (lib.COST, 6) if priced else (None, None)
  whole = packing.home_anchored_placement(w_LE, topo, cost, cap)
  for l in range(w_LE.shape[0]):
    alone = packing.home_anchored_placement(w_LE[l:l + 1], topo, cost, cap)
    np.testing.assert_array_equal(whole[l], alone[0])
