"""ForeMoE planner: valid, exact, deterministic, transfer-aware, and no worse
than the static and EPLB-step baselines on a fixed trace."""
import dataclasses

import numpy as np
import pytest

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import baselines, evaluate, foremoe, split
from foremoe_jax.planner.topology import CostModel, Topology

import planner_testlib as lib


def plan_all_steps(trace, topo, cost, config=foremoe.ForeMoEConfig()):
  plans, current = [], lib.identity_for(trace, topo)
  for r in range(trace.num_steps):
    plans.append(foremoe.plan_step(trace.step(r), topo, cost, current, config))
    current = plans[-1].last()
  return plans


@pytest.mark.parametrize('machine', ['one_node', 'two_nodes'])
def test_plans_are_valid_and_predictions_exact(machine):
  trace, topo = getattr(lib, machine)()
  for r, plan in enumerate(plan_all_steps(trace, topo, lib.COST)):
    lib.check_plan(plan, trace.step(r), topo)
    assert plan.bytes_moved_M.shape == (trace.step(r).shape[0],)
    np.testing.assert_allclose(
        plan.bytes_moved_M,
        plan.moves_MLD.sum(axis=(1, 2)) * lib.COST.bytes_per_expert)


def test_same_input_same_output():
  trace, topo = lib.two_nodes()
  a = foremoe.plan_step(trace.step(1), topo, lib.COST,
                        lib.identity_for(trace, topo))
  b = foremoe.plan_step(trace.step(1).copy(), topo, lib.COST,
                        lib.identity_for(trace, topo))
  for x, y in zip(a, b):
    if isinstance(x, placement_lib.Placement):
      np.testing.assert_array_equal(x.slot_expert, y.slot_expert)
      np.testing.assert_array_equal(x.slot_share, y.slot_share)
    else:
      np.testing.assert_array_equal(x, y)


def test_no_worse_than_static_or_eplb_step_on_any_microstep():
  trace = lib.small_trace(num_experts=64, top_k=8, num_layers=4, num_steps=4,
                          num_microsteps=6, tokens_per_seq=4096,
                          hot_share_range=(0.04, 0.06))
  topo = evaluate.BenchConfig('t', 64, 8).topology()
  runs = evaluate.run_methods(trace, topo, lib.COST,
                              methods=('static', 'eplb_step', 'foremoe'))
  for r in range(1, trace.num_steps):  # Step 0 is the warm-up.
    mm = {k: placement_lib.max_over_mean(v[0][r].loads_MLD)
          for k, v in runs.items()}
    best_baseline = np.minimum(mm['static'], mm['eplb_step'])
    assert (mm['foremoe'] <= best_baseline * 1.01).all(), (
        r, mm['foremoe'].max(), best_baseline.min())


def test_expensive_copies_are_not_made():
  trace, topo = lib.one_node()
  slow = CostModel(intra_node_bw=1e3, inter_node_bw=1e3)
  config = foremoe.ForeMoEConfig(step_anchor=False)
  current = lib.identity_for(trace, topo)
  plan = foremoe.plan_step(trace.step(1), topo, slow, current, config)
  assert plan.moves_MLD.sum() == 0
  np.testing.assert_array_equal(
      plan.placement.slot_expert,
      np.broadcast_to(current.slot_expert, plan.placement.slot_expert.shape))
  # Free copies do get made, and they pay off.
  free = CostModel(bytes_per_expert=0.0)
  moved = foremoe.plan_step(trace.step(1), topo, free, current, config)
  assert moved.moves_MLD.sum() > 0
  assert (placement_lib.max_over_mean(moved.loads_MLD).mean()
          < placement_lib.max_over_mean(plan.loads_MLD).mean())


def test_copies_fit_the_overlap_window_and_cap():
  trace, topo = lib.one_node()
  cost = CostModel(bytes_per_expert=0.0)
  current = lib.identity_for(trace, topo)
  config = foremoe.ForeMoEConfig(step_anchor=False, max_moves_per_device=1)
  plan = foremoe.plan_step(trace.step(1), topo, cost, current, config)
  assert plan.moves_MLD.max() <= 1
  # With no overlap window nothing can hide, so nothing is copied.
  no_window = dataclasses.replace(lib.COST, overlap=0.0)
  plan = foremoe.plan_step(trace.step(1), topo, no_window, current,
                           foremoe.ForeMoEConfig(step_anchor=False))
  assert plan.moves_MLD.sum() == 0


def test_baselines_are_valid():
  trace, topo = lib.two_nodes()
  current = lib.identity_for(trace, topo)
  loads = trace.step(1)
  static = baselines.plan_static(loads, topo, lib.COST, current)
  lib.check_plan(static, loads, topo)
  np.testing.assert_array_equal(static.placement.slot_expert[0],
                                current.slot_expert)
  assert static.moves_MLD.sum() == 0
  history = baselines.update_history(None, trace.step(0), 0.5)
  step = baselines.plan_eplb_step(loads, topo, lib.COST, current, history)
  lib.check_plan(step, loads, topo)
  # One placement for the whole step: moves only before micro-step 0.
  assert (step.placement.slot_expert == step.placement.slot_expert[0]).all()
  assert step.moves_MLD[1:].sum() == 0
  micro = baselines.plan_eplb_microstep(loads, topo, lib.COST, current)
  lib.check_plan(micro, loads, topo)


def test_hot_device_copies_to_a_near_device_when_far_ones_cost_too_much():
  """Two nodes of four devices. Device 0 is hot (300 tokens), its node's
  other devices hold 200, the other node's 190: the coldest devices are all
  across nodes, where a copy (priced with its gradient's return) costs more
  than the 55 tokens it saves, while on device 0's node it saves 50 for 10.
  By hand: one copy of expert 0 to a node-0 device, straggler 300 -> 250;
  none crosses nodes."""
  topo = Topology(2, 4, 3)
  w_LE = np.full((1, 16), 100.0)
  w_LE[0, 0] = 200.0
  w_LE[0, 8:] = 95.0
  # Moves cost 5 tokens on the node, 40 across (1 us per token).
  cost = CostModel(token_time_s=1e-6, bytes_per_expert=1e3,
                   intra_node_bw=2e8, inter_node_bw=2.5e7)
  assert cost.move_tokens(False) == pytest.approx(5.0)
  assert cost.move_tokens(True) == pytest.approx(40.0)
  home_LS = placement_lib.identity_placement(1, 16, 8, 3).slot_expert
  graph = split.FlowGraph(home_LS, w_LE, topo)
  new, _, y_LD = foremoe.refine_microstep(
      graph, w_LE, topo, cost, foremoe.ForeMoEConfig(max_rounds=1))
  se_DS = new.slot_expert_LS[0].reshape(8, 3)
  holders = np.flatnonzero((se_DS == 0).any(axis=1))
  assert holders[0] == 0 and len(holders) == 2 and holders[1] < 4
  np.testing.assert_allclose(y_LD.max(), 250.0)
  # Each node's devices hold only their own node's experts.
  assert (se_DS[4:] >= 8).all()


def test_node_split_cuts_rows_across_nodes_and_never_costs_more():
  """Where the all-to-alls are priced, the node-aware split changes only
  how tokens spread over replicas: the same placements, valid exact counts,
  fewer rows crossing nodes over the step, and per layer exact compute +
  all-to-all seconds (recomputed here from the cells) no higher than the
  plan without it, lower on some layer."""
  trace, topo = lib.two_nodes()
  cost = dataclasses.replace(lib.COST, row_bytes=4096.0)
  home = lib.identity_for(trace, topo)
  loads = trace.step(1)
  cfg = foremoe.ForeMoEConfig(home_anchor=True, microstep_degree=2,
                              anchor_rounds=8, node_split_slack=0.1)
  with_split = foremoe.plan_step(loads, topo, cost, home, cfg)
  without = foremoe.plan_step(loads, topo, cost, home, dataclasses.replace(
      cfg, node_split_slack=None))
  lib.check_plan(with_split, loads, topo)
  np.testing.assert_array_equal(with_split.placement.slot_expert,
                                without.placement.slot_expert)
  node = topo.node_of_device()
  across = node[:, None] != node[None, :]

  def seconds_and_across(plan):
    total_L, rows = 0.0, 0.0
    for m in range(plan.num_microsteps):
      cells_LSD = placement_lib.cell_counts(loads[m], plan.microstep(m))
      rows += (cells_LSD * across).sum()
      total_L = total_L + cost.token_time_s * cells_LSD.sum(axis=1).max(
          axis=1) + cost.all_to_all_s(cells_LSD, node)
    return total_L, rows

  ours_L, ours_rows = seconds_and_across(with_split)
  theirs_L, theirs_rows = seconds_and_across(without)
  assert (ours_L <= theirs_L * (1 + 1e-9)).all()
  assert (ours_L < theirs_L * (1 - 1e-3)).any()
  assert ours_rows < theirs_rows


def test_node_split_keeps_foremoe_no_worse_than_foresight_split():
  """The node-aware split changes what each layer costs, so where the
  moves' plan had won, foresight_split (split the same way) is offered
  again: per layer, ForeMoE's compute and copy seconds (`step_cost_s`)
  plus its all-to-alls (from the exact cells) never exceed
  foresight_split's. On this
  trace both steps broke that without the second offer."""
  trace = lib.small_trace(num_experts=64, num_devices=8, top_k=4,
                          num_layers=3, num_microsteps=4, seed=11,
                          hot_share_range=(0.05, 0.08))
  topo = Topology(2, 4, 64 // 8 + 2)
  cost = dataclasses.replace(lib.COST, row_bytes=4096.0)
  home = lib.identity_for(trace, topo)
  cur = np.asarray(home.slot_expert)
  node = topo.node_of_device()
  cfg = foremoe.ForeMoEConfig(home_anchor=True, microstep_degree=2,
                              anchor_rounds=8, node_split_slack=0.1)
  for r in (1, 2):
    loads = trace.step(r)

    def seconds(plan):
      # The planner's own price of compute and copies (copies hidden under
      # the micro-step before), plus the all-to-alls of the exact cells.
      total = foremoe.step_cost_s(plan.loads_MLD, plan.placement.slot_expert,
                                  cur, topo, cost, cost.return_factor)
      for m in range(plan.num_microsteps):
        cells_LSD = placement_lib.cell_counts(loads[m], plan.microstep(m))
        total = total + cost.all_to_all_s(cells_LSD, node)
      return total

    ours = foremoe.plan_step(loads, topo, cost, home, cfg)
    split_only = foremoe.plan_step(loads, topo, cost, home,
                                   dataclasses.replace(cfg, max_rounds=0))
    lib.check_plan(ours, loads, topo)
    assert (seconds(ours) <= seconds(split_only) * (1 + 1e-9)).all(), r


def _bench_layer_loads(num_micro: int = 4, seed: int = 0):
  """[M, 1, 8, 16] loads of one skewed layer: the totals of
  bench_rl_step's first MoE layer over its step (experts 1, 2, 6, 15 hot,
  8 and 9 alone on their home device), split into micro-steps with 5%
  noise, every source sending alike."""
  w_E = np.array([0, 5928, 6961, 0, 0, 1834, 7844, 0, 2325, 831, 0, 0, 18,
                  0, 1268, 5445], np.float64)
  rng = np.random.default_rng(seed)
  w_ME = np.round(w_E / num_micro * (1 + 0.05 * rng.standard_normal(
      (num_micro, w_E.size))) / 8).clip(0) * 8
  return np.repeat((w_ME / 8)[:, None, None, :], 8, axis=2).astype(np.int64)


def test_refined_anchor_balances_a_layer_the_anchor_cannot():
  """The home-anchored packing places replicas by their even share of an
  expert's load, blind to the split that follows and to homes that cannot
  shed: on this layer it leaves the devices holding 8, 9, 14 and 15 at
  1.15x the mean or more in every micro-step. A few hot-to-cold copies on
  the step's totals (`anchor_refine_rounds`) bring the placement that
  foresight_split holds for the whole step (no moves between micro-steps)
  within 7% of the mean in every micro-step."""
  loads = _bench_layer_loads()
  topo = Topology(1, 8, 3)
  # The benchmark's expert (256 x 2048, float32) at configs/tiny.py's
  # CPU rates: copies cost less than a token, the packing's key is load.
  cost = CostModel.from_expert_shape(256, 2048, bytes_per_param=4,
                                     flops_per_s=1e10, intra_node_bw=1e10,
                                     inter_node_bw=1e10, overlap=0.5)
  home = placement_lib.identity_placement(1, 16, 8, 3)
  cfg = foremoe.ForeMoEConfig(home_anchor=True, microstep_degree=2,
                              anchor_rounds=8, max_rounds=0)

  def max_over_mean_M(plan):
    return np.array([placement_lib.max_over_mean(placement_lib.device_loads(
        loads[m], plan.microstep(m)))[0] for m in range(len(loads))])

  anchor = foremoe.plan_step(loads, topo, cost, home,
                             dataclasses.replace(cfg, anchor_refine_rounds=0))
  refined = foremoe.plan_step(loads, topo, cost, home, cfg)
  lib.check_plan(refined, loads, topo)
  se = np.asarray(refined.placement.slot_expert)
  assert (se == se[:1]).all()  # Held: one placement for the whole step.
  assert (max_over_mean_M(anchor) > 1.15).all(), max_over_mean_M(anchor)
  assert (max_over_mean_M(refined) < 1.07).all(), max_over_mean_M(refined)
