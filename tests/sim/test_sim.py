"""The cluster simulator against hand-computed cases.

Every expected number below is worked out by hand from the profile's
constants: a perfectly balanced load, a single hot expert, an all-to-all
across two nodes, one move round, hidden and exposed moves.
"""
import dataclasses
import pickle
import time

import numpy as np
import pytest

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import plan as plan_lib
from foremoe_jax.planner.topology import CostModel, Topology
from foremoe_jax.sim import cluster, costs, hardware, simulate, workload
from foremoe_jax.transfer import schedule

# A toy machine with round numbers: 1 TFLOP/s, memory fast enough that the
# roofline never binds, 2 devices per node.
HW = hardware.HardwareProfile(
    name='toy', peak_flops_per_s=1e12, matmul_efficiency=1.0, hbm_bw=1e15,
    devices_per_node=2, intra_bw=1e9, intra_latency_s=1e-6, inter_bw=1e8,
    inter_latency_s=1e-5, layer_overhead_s=0.0, transfer_overlap=1.0)
MODEL = workload.ModelShape(
    name='toy', d_model=8, moe_d_ff=16, num_experts=4, top_k=1, num_layers=1,
    num_moe_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, vocab_size=16,
    shared_d_ff=0, dense_d_ff=0, bytes_per_param=4)
ROW_S = 18 * 8 * 16 / 1e12  # fwd + bwd FLOPs of one row / FLOP/s.


def _work(num_micro=2, **kw):
  # The hand-computed tests count 3 passes and 4 all-to-alls (no remat);
  # test_remat_reruns_the_forward_by_hand prices the others.
  kw.setdefault('remat_policy', 'none')
  return workload.Workload(num_devices=2, num_microsteps=num_micro,
                           seqs_per_microbatch=1, tokens_per_seq=8,
                           redundant_slots_per_device=1, **kw)


def _method_plan(loads_MLDE, slot_expert_MLS, flows_MLS, topo, capacity=8,
                 transfer_mode='exact'):
  cost = CostModel()
  home = placement_lib.identity_placement(1, 4, topo.num_devices,
                                          topo.slots_per_device).slot_expert
  plan = plan_lib.assemble_plan(loads_MLDE, slot_expert_MLS, flows_MLS, topo,
                                cost, home)
  budget = schedule.TransferBudget(step_rounds=4, microstep_rounds=2,
                                   mode=transfer_mode)
  transfer = schedule.build_step_transfer(plan.placement.slot_expert, 4, topo,
                                          budget)
  caps = {mode: capacity for mode in simulate.MODES}
  return simulate.MethodPlan(plan, transfer, caps, caps, 0, 0.0,
                             recompute_capacity=caps)


def test_expert_flops_and_roofline():
  assert MODEL.expert_flops_per_row() == 18 * 8 * 16
  assert costs.expert_time(100, 3, MODEL, HW) == pytest.approx(100 * ROW_S)
  slow_mem = dataclasses.replace(HW, hbm_bw=1e6)
  # 3 passes read 3 slots of 3*8*16 f32 params: 13824 bytes at 1 MB/s.
  assert costs.expert_time(1, 3, MODEL, slow_mem) == pytest.approx(
      3 * 3 * 384 * 4 / 1e6)


def test_all_to_all_two_nodes_by_hand():
  # 4 devices, 2 per node, 1000 bytes to every peer: 1 intra peer at 1 GB/s
  # (1 us) in parallel with 2 inter peers at 100 MB/s (20 us), + 10 us.
  b = np.full((4, 4), 1000.0)
  assert costs.all_to_all_time(b, HW) == pytest.approx(20e-6 + 1e-5)
  # A hot receiver: device 0 gets 5000 bytes from device 3 (another node).
  b[3, 0] = 5000.0
  assert costs.all_to_all_time(b, HW) == pytest.approx(60e-6 + 1e-5)


def test_node_traffic_by_hand():
  """4 devices, 2 per node, 1 row to every device (itself included), and
  device 3 sends device 0 4 more: each device sends 2 rows to the other
  node, device 3 6; device 0 receives 6 from it, the others 2. Of the 20
  rows, the 8 to a device's own node (itself included) stay."""
  rows = np.ones((4, 4))
  rows[3, 0] += 4
  send, recv, on_node = costs.node_traffic(rows, HW)
  np.testing.assert_allclose(send, [2, 2, 2, 6])
  np.testing.assert_allclose(recv, [6, 2, 2, 2])
  assert on_node == 8.0
  # One node: nothing crosses.
  send, recv, on_node = costs.node_traffic(
      rows, dataclasses.replace(HW, devices_per_node=4))
  assert not send.any() and not recv.any() and on_node == rows.sum()


def test_inter_node_rows_follow_the_placement_by_hand():
  """Two nodes of one device, every source sends the hot expert (home:
  device 0) 30 rows. Home layout: device 1's 30 cross (it is the only
  inter-node sender, device 0 the only receiver: 2x the mean each way),
  half the rows stay. With a replica on device 1 each source keeps its
  rows on its node: nothing crosses. The total rows a device sends, the
  old floor, is 1.0x either way."""
  topo = Topology(2, 1, 3)
  hw = dataclasses.replace(HW, devices_per_node=1)
  loads, static, spread = _hot_expert_plans(topo)
  home = simulate.time_step(static, loads, MODEL, _work(), hw)
  assert home['inter_node_send_max_over_mean'] == pytest.approx(2.0)
  assert home['inter_node_recv_max_over_mean'] == pytest.approx(2.0)
  assert home['on_node_row_fraction'] == pytest.approx(0.5)
  local = simulate.time_step(spread, loads, MODEL, _work(), hw)
  assert local['inter_node_send_max_over_mean'] == 1.0
  assert local['on_node_row_fraction'] == 1.0
  assert home['sender_max_over_mean'] == local['sender_max_over_mean'] == 1.0
  assert local['all_to_all_s'] < home['all_to_all_s']
  # The padded layer's cells are all C: no traffic split to report.
  padded = simulate.time_step(static, loads, MODEL, _work(), hw, 'padded')
  assert padded['on_node_row_fraction'] is None


def test_one_round_by_hand():
  # Shift 1 on 4 devices: device 1 receives from device 0 (same node), then
  # a round of shift 2 where device 2 receives from device 0 (other node).
  recv = np.full((2, 4), -1)
  recv[0, 1] = 0
  recv[1, 2] = 0
  t = costs.rounds_time(np.array([1, 2]), recv, 1000.0, HW, 4)
  assert t == pytest.approx(1000 / 1e9 + 1e-6 + 1000 / 1e8 + 1e-5)
  # Idle rounds cost nothing.
  assert costs.rounds_time(np.array([0, 0]), recv, 1000.0, HW, 4) == 0.0


def test_emulated_exact_exchange_is_priced_by_its_rounds_by_hand():
  """On CPU the engine runs an exact exchange as cyclic-shift rounds, as
  many per shift as its busiest pair has items, each one expert copy per
  device (the engine's measured round); elsewhere one all-to-all."""
  count = np.zeros((4, 4), int)
  count[0, 1] = 2  # Shift 1, twice ...
  count[2, 3] = 1  # ... beside it on shift 1: no extra round.
  count[3, 1] = 1  # Shift 2, once. Shift 3 idle: no round.
  assert costs.emulated_rounds(count) == 3
  cpu = dataclasses.replace(HW, emulated_exchange=True, copy_bw=1e6,
                            copy_latency_s=1e-4)
  assert costs.exchange_time(count, 1000.0, cpu) == pytest.approx(
      3 * (1000 / 1e6 + 1e-4))
  assert costs.exchange_time(count, 1000.0, HW) == pytest.approx(
      costs.all_to_all_time(count * 1000.0, HW))
  assert costs.exchange_time(np.zeros((4, 4)), 1000.0, cpu) == 0.0
  # The rounds are the engine's own: its per-shift depths (the loop bounds
  # of `_exchange_by_rounds`) of a random transition's exchanges add up to
  # the same count, layer by layer and stage by stage.
  from foremoe_jax.transfer import engine  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  count_LPDD = rng.integers(0, 3, (3, 2, 5, 5)) * (1 - np.eye(5, dtype=int))
  fields = engine._exchange_fields(count_LPDD, '')  # pylint: disable=protected-access
  for l in range(3):
    for p in range(2):
      assert fields['depth_LPK'][l, p, 1:].sum() == costs.emulated_rounds(
          count_LPDD[l, p])


def test_balanced_load_static_equals_balanced_plan():
  """Every source sends every expert 4 tokens: each device computes
  2 sources * 2 experts * 4 = 16 rows per micro-step, no one moves."""
  topo = Topology(1, 2, 3)
  loads = np.full((2, 1, 2, 4), 4, np.int64)
  home = placement_lib.identity_placement(1, 4, 2, 3)
  se = np.broadcast_to(home.slot_expert, (2, 1, 6))
  # Home slots carry each expert's 2 x 4 tokens; redundant slots none.
  flows = np.broadcast_to(np.where(np.arange(6) % 3 < 2, 8.0, 0.0), (2, 1, 6))
  mp = _method_plan(loads, se, flows, topo)
  r = simulate.time_step(mp, loads, MODEL, _work(), HW, 'exact')
  assert r['moe_compute_s'] == pytest.approx(2 * 16 * ROW_S)
  # Only local copies of the home experts into their slots (3 per device,
  # read + write), after writing the 3 empty slot buffers.
  assert r['transfer_s'] == pytest.approx(
      (3 * 2 + 3) * MODEL.bytes_per_expert / 1e15)
  assert r['transfer_hidden_s'] == 0.0
  assert r['microstep_max_over_mean'] == pytest.approx(1.0)


def test_single_hot_expert_by_hand():
  """All 2 x 30 tokens pick expert 0 (home: device 0). Static: device 0
  computes 60 rows. A replica of expert 0 on device 1 (its redundant slot)
  with half the flow: 30 rows each, half the compute, one move."""
  topo = Topology(1, 2, 3)
  loads = np.zeros((2, 1, 2, 4), np.int64)
  loads[..., 0] = 30
  home = placement_lib.identity_placement(1, 4, 2, 3).slot_expert  # [1, 6]
  flows_static = np.zeros((2, 1, 6))
  flows_static[..., 0] = 60.0
  static = _method_plan(loads, np.broadcast_to(home, (2, 1, 6)), flows_static,
                        topo)
  spread_se = home.copy()
  spread_se[0, 5] = 0  # Device 1's redundant slot holds expert 0.
  flows = np.zeros((2, 1, 6))
  flows[..., 0] = flows[..., 5] = 30.0
  spread = _method_plan(loads, np.broadcast_to(spread_se, (2, 1, 6)), flows,
                        topo)
  rs = simulate.time_step(static, loads, MODEL, _work(), HW, 'exact')
  rf = simulate.time_step(spread, loads, MODEL, _work(), HW, 'exact')
  assert rs['moe_compute_s'] == pytest.approx(2 * 60 * ROW_S)
  assert rf['moe_compute_s'] == pytest.approx(2 * 30 * ROW_S)
  # The fill copies expert 0 to device 1 over one intra-node round; the
  # flush returns its f32 gradient the same way. Nothing moves in between.
  item = MODEL.bytes_per_expert
  assert rf['fill_s'] == pytest.approx(item / 1e9 + 1e-6, rel=1e-6, abs=1e-7)
  assert rf['flush_s'] == pytest.approx(item / 1e9 + 1e-6)
  assert rs['flush_s'] == 0.0
  # The all-to-all: static, device 0 receives 30 rows of 8 f32 from device 1;
  # spread, device 1 sends 0 (its half stays home) and device 0 sends 15
  # rows... the busier direction, four times (fwd + bwd), per micro-step.
  row_bytes = 8 * 4
  assert rs['all_to_all_s'] == pytest.approx(
      2 * 4 * (30 * row_bytes / 1e9 + 1e-6))
  assert rf['all_to_all_s'] < rs['all_to_all_s']


def test_moves_hidden_or_exposed():
  """A replica placed only in micro-step 1: the move into it runs during
  micro-step 0 (its fill in the layer's forward step; its gradient's
  return, in the flush, in the last backward's), hidden when transfers
  overlap compute, exposed when not, and always exposed with the CPU's
  emulated exchange (its fills and returns run in scans of their own) and
  the rounds engine (its permutes sit in conditionals, which XLA does not
  overlap with outside compute)."""
  topo = Topology(1, 2, 3)
  loads = np.zeros((2, 1, 2, 4), np.int64)
  loads[..., 0] = 30
  home = placement_lib.identity_placement(1, 4, 2, 3).slot_expert
  se = np.broadcast_to(home, (2, 1, 6)).copy()
  se[1, 0, 5] = 0
  flows = np.zeros((2, 1, 6))
  flows[0, :, 0] = 60.0
  flows[1, :, 0] = flows[1, :, 5] = 30.0
  mp = _method_plan(loads, se, flows, topo)
  move = MODEL.bytes_per_expert / 1e9 + 1e-6
  slow = dataclasses.replace(HW, peak_flops_per_s=1e3)  # Compute >> move.
  hidden = simulate.time_step(mp, loads, MODEL, _work(), slow, 'exact')
  assert hidden['moves_s'] == pytest.approx(move)
  assert hidden['flush_s'] == pytest.approx(move)
  assert hidden['transfer_hidden_s'] == pytest.approx(2 * move)
  exposed = simulate.time_step(
      mp, loads, MODEL, _work(), dataclasses.replace(slow, transfer_overlap=0.0),
      'exact')
  assert exposed['transfer_hidden_s'] == 0.0
  assert exposed['update_s'] - hidden['update_s'] == pytest.approx(2 * move)
  # The emulated exchange: the move hides under nothing (the flush's
  # in-place return still sits in the backward: the profile's overlap).
  cpu = simulate.time_step(
      mp, loads, MODEL, _work(), dataclasses.replace(
          slow, emulated_exchange=True), 'exact')
  assert cpu['transfer_hidden_s'] == pytest.approx(move)
  assert cpu['transfer_exposed_s'] - cpu['fill_s'] == pytest.approx(move)
  rounds = simulate.time_step(
      _method_plan(loads, se, flows, topo, transfer_mode='rounds'), loads,
      MODEL, _work(), slow, 'exact')
  assert rounds['transfer_hidden_s'] == 0.0
  assert rounds['transfer_exposed_s'] - rounds['fill_s'] - rounds[
      'flush_s'] == pytest.approx(move)


def test_padded_mode_counts_capacity_not_load():
  topo = Topology(1, 2, 3)
  loads = np.full((2, 1, 2, 4), 4, np.int64)
  home = placement_lib.identity_placement(1, 4, 2, 3).slot_expert
  flows = np.broadcast_to(np.where(np.arange(6) % 3 < 2, 8.0, 0.0), (2, 1, 6))
  mp = _method_plan(loads, np.broadcast_to(home, (2, 1, 6)), flows, topo,
                    capacity=16)
  r = simulate.time_step(mp, loads, MODEL, _work(), HW, 'padded')
  tile = 8  # default_tile(32 rows, 3 slots) clamps to its minimum.
  assert r['moe_compute_s'] == pytest.approx(2 * (2 * 16 + 3 * tile) * ROW_S)


def test_torus_hops_and_profiles():
  assert hardware.mean_torus_hops(64) == pytest.approx(3.0)
  intra, inter = hardware.TPU_V5P.a2a_bandwidth(64)
  assert intra == inter == pytest.approx(600e9 / 3.0)
  assert hardware.get_profile('h100').flops_per_s == pytest.approx(0.6 * 989e12)
  with pytest.raises(ValueError, match='unknown hardware profile'):
    hardware.get_profile('a100')
  with pytest.raises(ValueError, match='matmul_efficiency'):
    dataclasses.replace(HW, matmul_efficiency=0.0)


def test_workload_shapes():
  qwen = workload.load_model_shape('qwen3_30b_a3b')
  assert (qwen.num_experts, qwen.top_k, qwen.num_moe_layers) == (128, 8, 48)
  assert qwen.bytes_per_expert == 3 * 2048 * 768 * 2
  w = workload.Workload(256)
  assert w.ep_size(qwen) == 128 and w.slots_per_device(qwen) == 3
  mixtral = workload.load_model_shape('mixtral_8x7b')
  assert workload.Workload(64).ep_size(mixtral) == 8
  with pytest.raises(ValueError, match='do not split'):
    workload.Workload(12).ep_size(qwen)
  with pytest.raises(ValueError, match='unknown model'):
    workload.load_model_shape('llama')


def test_grid_smoke_balanced_beats_static():
  """A small grid end to end: ForeMoE predicts a faster update than static
  EP on a skewed trace of a few thousand tokens a micro-step, and every row
  carries its speedups. (At 256 tokens static's canonical layout wins: the
  slots' bookkeeping, 0.32 s of flush hooks at Mixtral's experts, outweighs
  what balance saves, and the plan keeps the experts home.)"""
  from foremoe_jax.sim import cluster  # pylint: disable=import-outside-toplevel
  rows = cluster.run_grid(
      models=('mixtral_8x7b',), device_counts=(8,), profiles=(hardware.H100,),
      modes=('exact',), work_kwargs=dict(num_microsteps=2,
                                          seqs_per_microbatch=1,
                                          tokens_per_seq=4096),
      log=lambda *a: None)
  assert {r['method'] for r in rows} == set(simulate.METHODS)
  fore = cluster.find(rows, method='foremoe')
  assert fore['speedup_update_vs_static'] > 1.1
  assert fore['update_s'] == pytest.approx(
      fore['fill_s'] + fore['flush_s'] + fore['moe_compute_s']
      + fore['all_to_all_s'] + fore['nonexpert_s'] + fore['transfer_exposed_s']
      - fore['fill_s'] - fore['flush_s'] + fore['optimizer_s']
      + fore['grad_sync_s'] + fore['flush_hook_s'] - fore['prefill_exposed_s'])
  assert fore['flush_hook_s'] > 0
  # The foresight methods run the same step-level plan for the recompute,
  # measured once: the same seconds and the same recompute.
  split_row = cluster.find(rows, method='foresight_split')
  assert fore['recompute_plan_s'] == split_row['recompute_plan_s'] > 0
  assert fore['recompute_s'] == split_row['recompute_s']


def test_planner_processes_change_the_plan_time_only():
  """With two planner processes the grid's plans, and so every predicted
  device second, are those of one thread; the planning summary reports
  plan / recompute of the largest EP group."""
  from foremoe_jax.sim import cluster  # pylint: disable=import-outside-toplevel
  kw = dict(models=('mixtral_8x7b',), device_counts=(8,),
            profiles=(hardware.H100,), modes=('exact',),
            methods=('eplb_step', 'foremoe'),
            work_kwargs=dict(num_microsteps=2, seqs_per_microbatch=1,
                             tokens_per_seq=256), log=lambda *a: None)
  one = cluster.run_grid(**kw)
  two = cluster.run_grid(planner_workers=2, **kw)
  for a, b in zip(one, two):
    assert (a['method'], b['planner_workers']) == (b['method'], 2)
    for key in ('update_s', 'recompute_s', 'microstep_max_over_mean',
                'wire_bytes_over_useful'):
      assert a[key] == b[key], key
  got = cluster.planning_summary(two)['planning_largest_ep']['mixtral_8x7b']
  fore = cluster.find(two, method='foremoe')
  assert got['ep'] == 8 and got['planner_workers'] == 2
  assert got['plan_over_recompute'] == fore['plan_s'] / fore['recompute_s']


def test_recorded_trace_is_used_and_checked():
  """A recorded trace replaces the synthetic one where it fits; a trace of
  the wrong shape is refused with the shapes named."""
  from foremoe_jax.foresight import traces  # pylint: disable=import-outside-toplevel
  from foremoe_jax.sim import cluster  # pylint: disable=import-outside-toplevel
  mixtral = workload.load_model_shape('mixtral_8x7b')
  loads = np.zeros((2, 2, mixtral.num_moe_layers, 8, 8), np.int64)
  loads[..., 3] = 100  # Every token to expert 3 (home: device 3).
  rec = traces.trace_from_step_loads(list(loads))
  rows = cluster.run_grid(
      models=('mixtral_8x7b',), device_counts=(8,), profiles=(hardware.H100,),
      methods=('static',), modes=('exact',), trace=rec,
      work_kwargs=dict(num_microsteps=2, seqs_per_microbatch=1,
                       tokens_per_seq=100), log=lambda *a: None)
  # Device 3 computes all 8 x 100 assignments of each layer and micro-step,
  # in 4 passes ('full' remat, Workload's default, re-runs the forward).
  rows_s = (8 * 100 * mixtral.expert_flops_per_row(passes=4)
            / hardware.H100.flops_per_s)
  assert rows[0]['moe_compute_s'] == pytest.approx(
      2 * mixtral.num_moe_layers * rows_s)
  with pytest.raises(ValueError, match='does not fit mixtral_8x7b'):
    cluster.check_trace(traces.trace_from_step_loads(list(loads[:, :1])),
                        mixtral, 8, 2)


def _hot_expert_plans(topo):
  """Static and one-replica plans of the single-hot-expert case."""
  loads = np.zeros((2, 1, 2, 4), np.int64)
  loads[..., 0] = 30
  home = placement_lib.identity_placement(1, 4, 2, 3).slot_expert
  flows_static = np.zeros((2, 1, 6))
  flows_static[..., 0] = 60.0
  static = _method_plan(loads, np.broadcast_to(home, (2, 1, 6)), flows_static,
                        topo)
  spread_se = home.copy()
  spread_se[0, 5] = 0
  flows = np.zeros((2, 1, 6))
  flows[..., 0] = flows[..., 5] = 30.0
  spread = _method_plan(loads, np.broadcast_to(spread_se, (2, 1, 6)), flows,
                        topo)
  return loads, static, spread


def test_recompute_runs_the_passes_on_its_placement_by_hand():
  """One forward pass per recompute pass, each on the recompute's
  placement (filled first): the home layout computes the hot expert's 60
  rows a micro-step, the step-level replica 30 (plus its fill); no pass,
  no recompute, and the plan (submitted once the step-level plan is made,
  as the trainer does) is then waited for in full."""
  topo = Topology(1, 2, 3)
  loads, static, spread = _hot_expert_plans(topo)
  fwd_row_s = 6 * 8 * 16 / 1e12  # A row's forward FLOPs at 1 TFLOP/s.
  spread.recompute_plan, spread.recompute_transfer = spread.plan, spread.transfer
  spread.plan_s, spread.recompute_plan_s = 1.0, 0.25
  one = simulate.time_step(spread, loads, MODEL, _work(), HW)
  two = simulate.time_step(spread, loads, MODEL,
                           _work(recompute_forward_passes=2), HW)
  none = simulate.time_step(spread, loads, MODEL,
                            _work(recompute_forward_passes=0), HW)
  home = simulate.time_step(static, loads, MODEL, _work(), HW)
  assert two['recompute_s'] == pytest.approx(2 * one['recompute_s'])
  assert none['recompute_s'] == 0.0 and none['plan_wait_s'] == 1.0
  # Per micro-step the busiest device computes 60 rows (home) or 30; the
  # forward's two exchanges carry 30 rows from device 1 (home) or 15 from
  # device 0 (the replica's half), 8 f32 wide, plus a latency each.
  fill = one['recompute_fill_s']
  assert fill > 0 and home['recompute_fill_s'] == 0.0
  a2a = lambda rows: 2 * (rows * 32 / 1e9 + 1e-6)
  assert (home['recompute_s'] - (one['recompute_s'] - fill)) == pytest.approx(
      2 * ((60 - 30) * fwd_row_s + a2a(30) - a2a(15)), rel=1e-6)
  assert one['step_s'] == pytest.approx(
      0.25 + one['recompute_s'] + one['plan_wait_s'] + one['update_s'])


def test_static_on_the_canonical_layout_by_hand():
  """Static EP as the trainer runs it (`CanonicalLayout`): the same compute
  and exchanges as the home placement in slots, but for transfer only the
  home experts' cast into their compute copies, and per micro-step their
  f32 gradient sums; one copy of them in memory, no slot gradients,
  exchange buffers or schedule."""
  topo = Topology(1, 2, 3)
  loads, static, _ = _hot_expert_plans(topo)
  slots = simulate.time_step(static, loads, MODEL, _work(), HW)
  static.canonical = True
  canon = simulate.time_step(static, loads, MODEL, _work(), HW)
  ppe = 3 * 8 * 16
  # 2 home experts, 1 layer, read + write of 4-byte weights at 1e15 B/s.
  assert canon['fill_s'] == pytest.approx(2 * 2 * ppe * 4 / 1e15)
  assert canon['flush_s'] == canon['moves_s'] == 0.0
  assert canon['flush_hook_s'] == pytest.approx(2 * 2 * 3 * ppe * 4 / 1e15)
  for k in ('moe_compute_s', 'all_to_all_s', 'optimizer_s', 'grad_sync_s'):
    assert canon[k] == slots[k]
  assert canon['update_s'] == pytest.approx(
      slots['update_s'] - slots['transfer_exposed_s'] - slots['flush_hook_s']
      + canon['fill_s'] + canon['flush_hook_s'])
  mem = canon['memory']
  assert mem['slot_weights'] == 2 * ppe * 4 and mem['slot_grads'] == 0
  assert mem['exchange_buffers'] == mem['transfer_schedule'] == 0
  assert mem['microstep_grads'] == (MODEL.nonexpert_params() + 2 * ppe) * 4


def test_emulated_exchange_moves_the_per_cell_bound():
  """On CPU every pair moves tokens * min(top_k, s) rows whatever the
  placement: the same all-to-all time for a hot expert and for none."""
  topo = Topology(1, 2, 3)
  loads, static, spread = _hot_expert_plans(topo)
  emu = dataclasses.replace(HW, emulated_exchange=True,
                            devices_per_node=0)
  a = simulate.time_step(static, loads, MODEL, _work(), emu)['all_to_all_s']
  b = simulate.time_step(spread, loads, MODEL, _work(), emu)['all_to_all_s']
  # 8 tokens x 1 row each per cell, 8 f32 wide, to 1 peer; 4 exchanges a
  # micro-step, 2 micro-steps.
  assert a == b == pytest.approx(2 * 4 * (8 * 8 * 4 / 1e9 + 1e-6))


def test_memory_model_by_hand():
  """Every component of the toy update's per-device memory."""
  from foremoe_jax.sim import memory  # pylint: disable=import-outside-toplevel
  work = _work()
  mem = memory.update_memory(MODEL, work, ep=2, slots_per_device=3,
                             capacity_rows=16)
  ppe = 3 * 8 * 16
  assert mem.expert_state == 1 * 2 * ppe * 12  # 2 experts here, 12 B each.
  # The step's sums and a micro-step's returned gradients, f32.
  assert mem.expert_grads == 2 * 2 * ppe * 4
  assert mem.slot_weights == 2 * 3 * ppe * 4 and mem.slot_grads == 3 * ppe * 4
  # One micro-step's fresh f32 gradients: the non-expert ones and the slots'.
  assert mem.microstep_grads == (MODEL.nonexpert_params() + 3 * ppe) * 4
  assert mem.nonexpert_state == MODEL.nonexpert_params() * 12
  assert mem.saved_activations == 8 * 8 * 4  # One layer, 8 tokens x 8 f32.
  # The larger of the attention scores (3 x 1 seq x 1 head x 8 x 8 f32)
  # and the expert buffers, plus the layer's inputs and outputs.
  moe = 2 * 16 * 8 * 4 + 3 * 16 * 16 * 4 + 4 * 8 * 1 * 8 * 4
  assert mem.layer_transient == max(3 * 64 * 4, moe) + 4 * 8 * 8 * 4
  assert mem.logp_transient == 2 * 8 * 16 * 4
  # The flush's f32 send and receive buffers of R = ep = 2 experts, a
  # micro-step move's returns' beside them (R = 2, min(s, R) = 2), and its
  # fill's of 2 (f32 toy weights).
  moves = (2 + 2) * ppe * 4 + 2 * 2 * ppe * 4
  assert mem.exchange_buffers == 2 * 2 * ppe * 4 + moves
  # Per layer: fill and flush (R = 2), 2 micro-steps (R = 2): each
  # 4 x R int32 indices, 8 x D int32 count rows and depths, 3 slots x 9 B.
  per = 4 * 2 * 4 + 8 * 2 * 4 + 9 * 3
  assert mem.transfer_schedule == 1 * (2 + work.num_microsteps) * per
  assert mem.total == pytest.approx(sum(
      v for k, v in mem.as_dict().items() if k != 'total'))
  # R = 8: one collective whose sends are at most s = 3 (the slots).
  star = memory.update_memory(MODEL, work, ep=2, slots_per_device=3,
                              capacity_rows=16, step_rounds=8)
  assert star.exchange_buffers == (3 + 8) * ppe * 4 + moves
  # R = 64: a reduction tree of ceil(log2(65)) = 7 stages, one live at a
  # time, sending at most s = 3 and receiving at most s + h = 5 (7 x 8
  # < 3 + 64).
  tree = memory.update_memory(MODEL, work, ep=2, slots_per_device=3,
                              capacity_rows=16, step_rounds=64)
  assert tree.exchange_buffers == (3 + 5) * ppe * 4 + moves
  # The tree forced at R = 8 (4 stages): one stage's buffers.
  forced = memory.update_memory(MODEL, work, ep=2, slots_per_device=3,
                                capacity_rows=16, step_rounds=8, flush='tree')
  assert forced.exchange_buffers == tree.exchange_buffers
  # The first fill is the broadcast tree (7 stages sending at most
  # s + h = 5, receiving at most s = 3), its returns one collective.
  fill = 4 * (7 * (5 + 3) + (3 + 64)) + 4 * 4 * 2 * 8 + 9 * 3
  flush = 4 * (64 + 3 + 7 * (3 + 5)) + 4 * 4 * 2 * 8 + 9 * 3
  assert tree.transfer_schedule == fill + flush + work.num_microsteps * per
  sharded = memory.update_memory(MODEL, work, ep=2, slots_per_device=3,
                                 capacity_rows=16, fsdp_shards=2)
  assert sharded.nonexpert_state == mem.nonexpert_state / 2


def _timed_static_runs(truth, hots, topo, cost, work):
  """Static-layout runs timed by the profile `truth`, one per hot-expert
  load in `hots` (synthetic routes of rising skew), as the validation's
  refit takes them."""
  from foremoe_jax.sim import validate  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  runs = []
  for hot in hots:
    loads = rng.integers(0, 10, (2, 1, 2, 4)).astype(np.int64)
    loads[:, :, :, 0] += hot
    cap = int(loads.sum(axis=2).max()) * 2
    mp = validate._static_plan(loads, cap, topo, cost)  # pylint: disable=protected-access
    t = simulate.time_step(mp, loads, MODEL, work, truth)
    runs.append(dict(loads_MLDE=loads, capacity=cap, update_s=t['update_s'],
                     recompute_s=t['recompute_s']))
  return runs


def test_validation_refit_recovers_the_constants_it_was_timed_with():
  """`validate.refit_compute` on static-layout runs timed by a known
  profile (synthetic routes of rising skew) gives back that profile's GEMM
  rate, its per-layer overhead and, from the recomputes, the different
  rate and overhead of a forward-only pass; the exchange and copy constants
  are the ones it was handed."""
  from foremoe_jax.sim import validate  # pylint: disable=g-import-not-at-top
  topo, cost = Topology(1, 2, 3), CostModel()
  work = _work(num_micro=2, recompute_forward_passes=1, fsdp_all=False)
  truth = dataclasses.replace(HW, peak_flops_per_s=3e9, layer_overhead_s=2e-3,
                              forward_flops_per_s=1.5e9,
                              forward_layer_overhead_s=5e-4)
  given = dataclasses.replace(HW, peak_flops_per_s=1e12, layer_overhead_s=0.0)
  runs = _timed_static_runs(truth, (10, 40, 70, 100), topo, cost, work)
  fit = validate.refit_compute(given, runs, topo, cost, MODEL, work)
  assert fit.flops_per_s == pytest.approx(3e9, rel=1e-6)
  assert fit.layer_overhead_s == pytest.approx(2e-3, rel=1e-6)
  assert fit.forward_flops_per_s == pytest.approx(1.5e9, rel=1e-6)
  assert fit.forward_layer_overhead_s == pytest.approx(5e-4, rel=1e-6)
  # Without timed recomputes the forward pass keeps the update's constants.
  bare = validate.refit_compute(given, [dict(r, recompute_s=None)
                                        for r in runs],
                                topo, cost, MODEL, work)
  assert bare.forward_flops_per_s is None
  assert bare.forward_layer_overhead_s is None
  assert bare.forward_profile() == bare
  # Untiled, a forward pass has no tiles to price.
  assert fit.forward_tile_overhead_s is None and bare.forward_tile_overhead_s is None


def test_validation_refit_never_takes_a_negative_fixed_cost():
  """Recomputes that grow faster than their FLOPs (the largest run 30%
  slow: noise, or a cost the model lacks) pull the free least-squares
  intercept below 0. The refit then takes the least squares through 0: no
  per-layer overhead, and the rate satisfies that fit's normal equation,
  sum over runs of (measured - predicted) x FLOP seconds = 0. Clamping
  only the intercept would keep the slope fitted beside the negative one,
  which fails that equation (checked: by 15% of sum x^2)."""
  from foremoe_jax.sim import validate  # pylint: disable=g-import-not-at-top
  topo, cost = Topology(1, 2, 3), CostModel()
  work = _work(num_micro=2, recompute_forward_passes=1, fsdp_all=False)
  truth = dataclasses.replace(HW, peak_flops_per_s=3e9, layer_overhead_s=2e-3,
                              forward_flops_per_s=1.5e9,
                              forward_layer_overhead_s=0.0)
  given = dataclasses.replace(HW, peak_flops_per_s=1e12, layer_overhead_s=0.0)
  runs = _timed_static_runs(truth, (10, 40, 70, 100), topo, cost, work)
  runs[-1] = dict(runs[-1], recompute_s=1.3 * runs[-1]['recompute_s'])
  fit = validate.refit_compute(given, runs, topo, cost, MODEL, work)
  assert fit.forward_layer_overhead_s == 0.0
  # The free fit's intercept is indeed negative here (numpy, by hand).
  pred = lambda prof, r: simulate.time_step(
      validate._static_plan(r['loads_MLDE'], r['capacity'], topo, cost),  # pylint: disable=protected-access
      r['loads_MLDE'], MODEL, work, prof)['recompute_s']
  inf = dataclasses.replace(fit, forward_flops_per_s=1e30)
  x = np.array([pred(fit, r) - pred(inf, r) for r in runs])  # FLOP seconds.
  y = np.array([r['recompute_s'] - pred(inf, r) for r in runs])
  free = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)[0]
  assert free[1] < 0
  assert abs(np.sum((y - x) * x)) < 1e-6 * np.sum(x * x)
  assert fit.forward_flops_per_s < 1.5e9  # The slow run still counts.


def test_validation_refit_separates_the_tiles_from_the_rows():
  """With the tiled grouped GEMM, a tile costs a fixed time besides its
  rows, and the tile grows with the bucket: the refit on runs whose
  buckets straddle tile sizes gives back the GEMM rate, the per-tile and
  the per-layer overheads it was timed with (the tile count is not a
  multiple of the rows there), and the recompute's own rate, per-tile and
  per-layer overheads on top (a forward tile costs less than an update's,
  whose backward writes the tile's weight gradients)."""
  from foremoe_jax.sim import validate  # pylint: disable=g-import-not-at-top
  from foremoe_jax.model.grouped_swiglu import default_tile  # pylint: disable=g-import-not-at-top
  topo, cost = Topology(1, 2, 3), CostModel()
  work = _work(num_micro=2, recompute_forward_passes=1, fsdp_all=False)
  tiled = dataclasses.replace(HW, tiled_gemm=True)
  truth = dataclasses.replace(tiled, peak_flops_per_s=3e9,
                              layer_overhead_s=2e-3, tile_overhead_s=4e-4,
                              forward_flops_per_s=1.5e9,
                              forward_layer_overhead_s=5e-4,
                              forward_tile_overhead_s=1e-4)
  given = dataclasses.replace(tiled, peak_flops_per_s=1e12,
                              layer_overhead_s=0.0)
  runs = _timed_static_runs(truth, (10, 40, 70, 100, 300), topo, cost, work)
  assert len({default_tile(r['capacity'], 3) for r in runs}) >= 3
  fit = validate.refit_compute(given, runs, topo, cost, MODEL, work)
  assert fit.flops_per_s == pytest.approx(3e9, rel=1e-6)
  assert fit.tile_overhead_s == pytest.approx(4e-4, rel=1e-6)
  assert fit.layer_overhead_s == pytest.approx(2e-3, rel=1e-6)
  assert fit.forward_flops_per_s == pytest.approx(1.5e9, rel=1e-6)
  assert fit.forward_layer_overhead_s == pytest.approx(5e-4, rel=1e-6)
  assert fit.forward_tile_overhead_s == pytest.approx(1e-4, rel=1e-6)
  # A forward that borrowed the update's per-tile cost would price every
  # recompute high, by the tiles' 3e-4 s each.
  plan = lambda r: validate._static_plan(r['loads_MLDE'], r['capacity'],  # pylint: disable=protected-access
                                         topo, cost)
  borrowed = dataclasses.replace(fit, forward_tile_overhead_s=None)
  for r in runs:
    assert simulate.time_step(plan(r), r['loads_MLDE'], MODEL, work,
                              borrowed)['recompute_s'] > r['recompute_s']
  # The tiles' cost is real: a profile without it misprices the update.
  t = simulate.time_step(validate._static_plan(  # pylint: disable=protected-access
      runs[0]['loads_MLDE'], runs[0]['capacity'], topo, cost),
                         runs[0]['loads_MLDE'], MODEL, work,
                         dataclasses.replace(truth, tile_overhead_s=0.0))
  assert t['update_s'] < runs[0]['update_s']


def test_sender_floor_is_the_busiest_source_by_hand():
  """Source 0 sends 30 rows and source 1 sends 10 (mean 20): the busiest
  sender holds 1.5x the mean, whatever the placement does with them."""
  topo = Topology(1, 2, 3)
  loads, static, spread = _hot_expert_plans(topo)
  loads = loads.copy()
  loads[:, :, 1, 0] = 10
  for mp in (static, spread):
    r = simulate.time_step(mp, loads, MODEL, _work(), HW)
    assert r['sender_max_over_mean'] == pytest.approx(1.5)


def _prefill_plans():
  """The one-replica plan of the hot-expert case, its recompute on the
  same placement, and the same plan with the recompute prefilling the
  update's slots (the update's fill then starts from them)."""
  topo = Topology(1, 2, 3)
  loads, _, spread = _hot_expert_plans(topo)
  spread.recompute_plan, spread.recompute_transfer = spread.plan, spread.transfer
  budget = schedule.TransferBudget(step_rounds=4, microstep_rounds=2)
  pre = dataclasses.replace(
      spread, prefilled=True, transfer=schedule.build_step_transfer(
          spread.plan.placement.slot_expert, 4, topo, budget,
          start_LS=spread.plan.placement.slot_expert[0]))
  return loads, spread, pre


def test_prefill_moves_the_fill_under_the_recompute_by_hand():
  """With the recompute prefilling the update's slots, the update's fill
  moves only what micro-step 0 changes (here nothing: same placement), and
  the whole fill runs under the recompute: hidden when the profile's
  overlap allows it, else exposed there, second for second."""
  loads, spread, pre = _prefill_plans()
  for overlap in (1.0, 0.0):
    hw = dataclasses.replace(HW, transfer_overlap=overlap)
    a = simulate.time_step(spread, loads, MODEL, _work(), hw)
    b = simulate.time_step(pre, loads, MODEL, _work(), hw)
    fill = a['fill_s']  # One remote replica (+ its local copies).
    assert fill > 0 and b['fill_s'] == 0.0
    # The prefill's chunk bookkeeping comes on top (memory work, ~0 here).
    slices = simulate.chunk_slices_s(MODEL, hw, 1, 2, 3, 2)
    assert b['prefill_s'] == pytest.approx(fill + slices)
    assert b['update_s'] == pytest.approx(a['update_s'] - fill)
    # The fill is one expert's bytes over a link: far longer than this toy
    # forward's compute, so with full overlap only the compute hides it.
    hidden = fill - b['prefill_exposed_s']
    assert (hidden > 0) == (overlap > 0)
    assert b['recompute_s'] == pytest.approx(
        a['recompute_s'] + b['prefill_exposed_s'])
    assert b['transfer_exposed_s'] == pytest.approx(
        a['transfer_exposed_s'] - fill + b['prefill_exposed_s'])
  assert b['prefill_exposed_s'] == pytest.approx(fill + slices)  # overlap 0.
  with pytest.raises(ValueError, match='prefill'):
    simulate.time_step(pre, loads, MODEL, _work(recompute_forward_passes=0),
                       HW)


def test_flush_inside_the_last_backward_by_hand():
  """The flush is issued layer by layer in the last micro-step's backward,
  each layer's in its own step of the scan over layers, whose collectives
  cannot leave it: layer l's return hides under the rest of that step
  (its non-expert backward), up to the overlap, and no more."""
  flush_L = np.array([0.5, 1.0, 1.5])
  # 3 layers, 9 s of compute of which 4.5 s non-expert: a layer's forward
  # step is 1 s, the rest of its backward step after its experts' 1 s.
  fwd_s, bwd_s = simulate.layer_windows(9.0, 4.5, 3)
  assert (fwd_s, bwd_s) == (1.0, 1.0)
  assert simulate.flush_exposed(flush_L, bwd_s, 1.0) == (3.0, 0.5)
  assert simulate.flush_exposed(flush_L, bwd_s, 0.0) == (3.0, 3.0)
  assert simulate.flush_exposed(flush_L, bwd_s, 0.5) == pytest.approx(
      (3.0, 0.0 + 0.5 + 1.0))
  assert simulate.flush_exposed(flush_L, 2.0, 1.0) == (3.0, 0.0)
  assert simulate.flush_exposed(np.zeros(3), bwd_s, 1.0) == (0.0, 0.0)
  # Switched off, it still sums each layer's slot gradients (3 slots: read
  # two, write one) and gathers its send buffer (min(s, R) = 3 items: a
  # device sends from its slots only) and zeroes its receive buffer (R = 4
  # items: R <= s + h = 5, so one collective), f32, once per micro-step.
  _, _, spread = _hot_expert_plans(Topology(1, 2, 3))
  assert spread.transfer.fill.send_LPDR.shape[-1] == 4
  assert simulate.flush_hook_time(spread.transfer.flush, MODEL, HW, 3, 2) == (
      pytest.approx(1 * (3 * 3 + 3 + 4) * MODEL.params_per_expert * 4 / 1e15))
  # On the CPU's emulated exchange this one-stage flush runs in place: it
  # reads each item as it sends it, so switched off it writes only the
  # h = 2 home experts' zero cotangent.
  cpu = dataclasses.replace(HW, emulated_exchange=True)
  assert spread.transfer.flush.ret_count_LPDD.shape[1] == 1
  assert simulate.in_place(spread.transfer.flush, cpu, returns=True)
  assert not simulate.in_place(spread.transfer.flush, HW, returns=True)
  assert simulate.flush_hook_time(spread.transfer.flush, MODEL, cpu, 3, 2) == (
      pytest.approx(1 * 2 * MODEL.params_per_expert * 4 / 1e15))
  # With the exact exchanges the moves' returns sit in the same hook, on
  # the same gradient sum: their send and receive buffers are added (one
  # stage; the CPU emulation returns them apart, in place).
  steps = spread.transfer.steps
  _, _, stages, _, send_w = steps.ret_send_LPDR.shape
  assert stages == 1
  assert simulate.flush_hook_time(spread.transfer.flush, MODEL, HW, 3, 2,
                                  moves=steps) == pytest.approx(
      1 * (3 * 3 + 3 + 4 + send_w + steps.ret_recv_LPDR.shape[-1])
      * MODEL.params_per_expert * 4 / 1e15)
  assert simulate.flush_hook_time(spread.transfer.flush, MODEL, cpu, 3, 2,
                                  moves=steps) == simulate.flush_hook_time(
                                      spread.transfer.flush, MODEL, cpu, 3, 2)


def test_validation_cache_is_read_only_for_its_bench_skews_and_format(
    tmp_path):
  """A cache is read back for the key it was written under, and refused
  (None: measure again) for another bench, other skews or a cache written
  under an older CACHE_FORMAT, which the current code did not produce."""
  from foremoe_jax.benchmarks import rl_step  # pylint: disable=import-outside-toplevel
  from foremoe_jax.sim import validate  # pylint: disable=import-outside-toplevel
  bench = rl_step.RLStepBench(repeats=1)
  key = validate.cache_key(bench, (0.0, 0.5))
  path = str(tmp_path / 'val.pkl')
  assert validate.read_cache(path, key, log=lambda *_: None) is None
  with open(path, 'wb') as f:
    pickle.dump(dict(key=key, data={'x': 1}), f)
  lines = []
  assert validate.read_cache(path, key, log=lines.append) == {'x': 1}
  for other in (validate.cache_key(rl_step.RLStepBench(repeats=2), (0.0, 0.5)),
                validate.cache_key(bench, (0.0,)),
                {k: v for k, v in key.items() if k != 'format'},
                dict(key, format=validate.CACHE_FORMAT - 1)):
    assert validate.read_cache(path, other, log=lines.append) is None
  assert sum('measuring again' in l for l in lines) == 4


def test_validation_refuses_a_fit_bucket_it_is_judged_at():
  """The validation's calibration buckets and the methods' update and
  recompute buckets are reported apart, and a measurement where one
  calibration run took a judged bucket (update or recompute) is refused."""
  from foremoe_jax.sim import validate  # pylint: disable=import-outside-toplevel
  planned = lambda c: type('Planned', (), {'capacity': c})()
  extras = dict(planned={'static': planned(3896), 'foremoe': planned(1280)},
                recompute_capacity={'static': 3896, 'foremoe': 1600})
  runs = [dict(capacity=c) for c in (6080, 2000, 3120)]
  assert validate.held_out_buckets(runs, extras) == (
      [2000, 3120, 6080], [1280, 1600, 3896])
  for shared in (1280, 1600):  # An update's bucket, a recompute's.
    with pytest.raises(ValueError, match=f'share \\[{shared}\\]'):
      validate.held_out_buckets(runs + [dict(capacity=shared)], extras)


def test_best_of_keeps_the_first_result_and_the_least_time(monkeypatch):
  """The recompute's plan, on the step's critical path, is timed as the
  best of its runs; the plan used is the first run's."""
  clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 27.0])  # Runs of 5, 2 and 7 s.
  monkeypatch.setattr(simulate.time, 'perf_counter', lambda: next(clock))
  calls = []
  out, best = simulate._best_of(lambda: calls.append(len(calls)) or len(calls),
                                3)
  assert (out, best, calls) == (1, 2.0, [0, 1, 2])
  clock = iter([0.0, 4.0])
  assert simulate._best_of(lambda: 'x', 0) == ('x', 4.0)  # At least once.


def test_fills_from_empty_buffers_and_the_prefill_chunks_by_hand():
  """Memory work the fills do besides moving experts, at 1 MB/s: a fill
  from nothing (the recompute's, the update's unless prefilled) first
  writes the empty slot buffers, L x s experts of 1,536 B (4.6 ms); the
  prefill's M = 2 iterations each slice ceil(L / M) = 1 layer's s slots
  and h = 2 home experts out and write the slots back: 2 x (2 x 3 + 2)
  copies of 2 x 1,536 B (49.2 ms)."""
  loads, spread, pre = _prefill_plans()
  fast = dataclasses.replace(HW, transfer_overlap=0.0)
  slow = dataclasses.replace(fast, hbm_bw=1e6)
  assert simulate.empty_slots_s(MODEL, slow, 1, 3) == pytest.approx(4.608e-3)
  assert simulate.chunk_slices_s(MODEL, slow, 1, 2, 3, 2) == pytest.approx(
      49.152e-3)
  # The fill's local copies read and write an expert each at the same rate.
  copies = (spread.transfer.fill.local_src_LS[0].reshape(2, 3) >= 0).sum(
      axis=1).max()
  a_fast, a_slow = (simulate.time_step(spread, loads, MODEL, _work(), hw)
                    for hw in (fast, slow))
  extra = (3 + 2 * copies) * 1536 * (1 / 1e6 - 1 / 1e15)
  assert a_slow['fill_s'] - a_fast['fill_s'] == pytest.approx(extra)
  assert a_slow['recompute_fill_s'] - a_fast['recompute_fill_s'] == (
      pytest.approx(extra))
  # Prefilled: the update starts from the recompute's buffers (no empty
  # ones, nothing to move into the same placement); the prefill pays the
  # whole fill, empty buffers included, and the chunk slices.
  b_slow = simulate.time_step(pre, loads, MODEL, _work(), slow)
  # On the CPU's emulated exchange the one-stage prefill fills its chunks
  # in place (`simulate.in_place`): no slices, only the empty buffers.
  cpu_slow = dataclasses.replace(slow, emulated_exchange=True)
  assert simulate.in_place(pre.recompute_transfer.fill, cpu_slow)
  c_slow = simulate.time_step(pre, loads, MODEL, _work(), cpu_slow)
  assert c_slow['prefill_s'] == pytest.approx(
      b_slow['prefill_s'] - simulate.chunk_slices_s(MODEL, slow, 1, 2, 3, 2))
  assert b_slow['fill_s'] == 0.0
  assert b_slow['prefill_s'] == pytest.approx(a_slow['fill_s'] + 49.152e-3)


def test_tiled_grouped_gemm_rounds_each_slot_to_tiles_by_hand():
  """On CPU the grouped GEMM runs whole tiles per slot (8 rows at bucket
  8): the home layout's 60 rows of the hot expert cost 64, the replica
  split's 30 + 30 cost 32 on each device; on GPU rows as they arrive."""
  topo = Topology(1, 2, 3)
  loads, static, spread = _hot_expert_plans(topo)
  tiled = dataclasses.replace(HW, tiled_gemm=True)
  for mp, rows, tiles in ((static, 60, 64), (spread, 30, 32)):
    a = simulate.time_step(mp, loads, MODEL, _work(), HW)['moe_compute_s']
    b = simulate.time_step(mp, loads, MODEL, _work(), tiled)['moe_compute_s']
    assert a == pytest.approx(2 * rows * ROW_S)
    assert b == pytest.approx(2 * tiles * ROW_S)


def test_headline_reports_the_compute_anchor_ablation():
  """The headline's ablation keys are the ablation row's step over
  ForeMoE's and its rows by node, read from the rows themselves."""

  def row(method, step_s, on_node):
    return dict(model='qwen3_30b_a3b', devices=64, profile='h100',
                mode='exact', method=method, step_s=step_s,
                update_s=step_s / 2, all_to_all_s=step_s / 4,
                peak_bytes_per_device=1.0, sender_max_over_mean=1.0,
                wire_bytes_over_useful=1.0, transfer_exposed_s=0.0,
                microstep_max_over_mean=1.0,
                inter_node_send_max_over_mean=1.5,
                inter_node_recv_max_over_mean=1.25,
                on_node_row_fraction=on_node)

  rows = [row('static', 40.0, 0.1), row('eplb_step', 24.0, 0.1),
          row('foremoe', 16.0, 0.4), row('foremoe_compute_anchor', 18.0, 0.3)]
  cluster._add_speedups(rows)  # pylint: disable=protected-access
  out = cluster.headline(rows)
  assert out['speedup_64gpu_foremoe_vs_compute_anchor'] == pytest.approx(1.125)
  assert out['speedup_64gpu_foremoe_vs_eplb_step'] == pytest.approx(1.5)
  assert out['on_node_row_fraction_64gpu_compute_anchor'] == 0.3
  assert out['on_node_row_fraction_64gpu_foremoe'] == 0.4
  rows.pop()
  assert 'speedup_64gpu_foremoe_vs_compute_anchor' not in cluster.headline(rows)


def test_remat_reruns_the_forward_by_hand():
  """Every remat policy re-runs each layer's forward exchange in the
  backward (6 token all-to-alls instead of 4, as the compiled step holds);
  'full' re-runs its compute too (4 passes instead of 3)."""
  topo = Topology(1, 2, 3)
  loads = np.zeros((2, 1, 2, 4), np.int64)
  loads[..., 0] = 30
  home = placement_lib.identity_placement(1, 4, 2, 3).slot_expert
  flows = np.zeros((2, 1, 6))
  flows[..., 0] = 60.0
  mp = _method_plan(loads, np.broadcast_to(home, (2, 1, 6)), flows, topo)
  r = {p: simulate.time_step(mp, loads, MODEL, _work(remat_policy=p), HW,
                             'exact')
       for p in ('none', 'full', 'dots', 'minimal')}
  assert r['none']['moe_compute_s'] == pytest.approx(2 * 60 * ROW_S)
  assert r['full']['moe_compute_s'] == pytest.approx(2 * 60 * ROW_S * 4 / 3)
  assert r['dots']['moe_compute_s'] == r['none']['moe_compute_s']
  for p in ('full', 'dots', 'minimal'):
    assert r[p]['all_to_all_s'] == pytest.approx(
        1.5 * r['none']['all_to_all_s'])
    assert r[p]['all_to_all_s'] > 0
  assert r['full']['nonexpert_s'] == pytest.approx(
      4 / 3 * r['none']['nonexpert_s'])
  with pytest.raises(ValueError, match='remat_policy'):
    simulate.update_passes('some')


def test_expert_gradients_reduce_across_nodes_an_ep_group_apart():
  """The expert gradients' all-reduce runs over the data groups, whose
  devices sit an EP group apart: with EP filling a node, the ring crosses
  nodes, priced at the inter-node links, not the node's. By hand, 2 peers
  (n = 2: one 2 (n-1)/n = 1 times the bytes, 2 hops of latency)."""
  mb = 1e6
  intra = costs.allreduce_time(mb, 2, HW)  # Adjacent: one node of 2.
  assert intra == pytest.approx(mb / HW.intra_bw + 2 * HW.intra_latency_s)
  apart = costs.allreduce_time(mb, 2, HW, stride=2)  # Peers 2 apart.
  assert apart == pytest.approx(mb / HW.inter_bw + 2 * HW.inter_latency_s)


def test_buckets_hold_the_largest_micro_batch():
  """The capacity ladder's dropless bound comes from the tokens the
  largest micro-batch holds, not the nominal size, and a demand past the
  last bucket is refused rather than priced at a bucket that drops."""
  loads = np.zeros((2, 1, 2, 4), np.int64)
  loads[0, 0, 0, 0] = 40  # 40 tokens on device 0 (top_k 1): 5x nominal 8.
  loads[1, 0, 1, 1] = 3
  assert simulate.shape_tokens(loads, 1, 8) == 40
  assert simulate.shape_tokens(loads, 1, 64) == 64
  home = placement_lib.identity_placement(1, 4, 2, 3)
  small = {m: (8,) for m in simulate.MODES}
  with pytest.raises(ValueError, match='exceeds the largest bucket'):
    simulate._buckets(loads, home, small)
  buckets = {m: config_lib.capacity_buckets(40, 1, 2, 3, dispatch=m)
             for m in simulate.MODES}
  caps, _ = simulate._buckets(loads, home, buckets)
  assert caps['exact'] >= 40 and caps['padded'] >= 40


def test_a_late_plan_takes_the_step_level_plan_as_the_trainer_does(
    monkeypatch):
  """The update's plan runs under the trainer's deadline: a plan still
  running at it hands its layers the recompute's step-level plan, and the
  step waits no longer. A plan that takes 0.5 s under a 0.05 s deadline:
  every layer falls back and the update's placements are the step-level
  plan's; no deadline: none does. (The plan is slowed down because this
  one alone takes microseconds: at a 0 s deadline it could finish before
  the trainer looks, which made the test flaky.)"""
  from foremoe_jax.planner import guard  # pylint: disable=import-outside-toplevel
  real = guard.run_method

  def slow(*args, **kw):
    time.sleep(0.5)
    return real(*args, **kw)
  monkeypatch.setattr(guard, 'run_method', slow)
  rng = np.random.default_rng(0)
  loads = rng.integers(0, 40, (2, 3, 2, 4)).astype(np.int64)
  topo = Topology(1, 2, 3)
  budget = schedule.TransferBudget(step_rounds=2, microstep_rounds=2)
  run = lambda deadline_of: simulate.plan_methods(
      loads, None, topo, CostModel(), budget, 1, 100,
      methods=('eplb_microstep',), deadline_of=deadline_of)['eplb_microstep']
  free, late = run(None), run(lambda mp: 0.05)
  assert free.deadline_s is None and free.fell_back_layers == 0
  assert late.deadline_s == 0.05 and late.fell_back_layers == 3
  assert late.plan_s < 0.5  # It did not wait for the plan.
  assert 'deadline' in late.fallback_reason
  np.testing.assert_array_equal(late.plan.placement.slot_expert,
                                late.recompute_plan.placement.slot_expert)
  r = simulate.time_step(late, loads, MODEL, _work(), HW, 'exact')
  assert r['plan_layers_fell_back'] == 3 and r['plan_deadline_s'] == 0.05
  # The trainer's rule: recompute_frac x the recompute, at least deadline_ms.
  rec = simulate.recompute_time(late, loads, MODEL, _work(), HW)
  assert simulate.plan_deadline(late, loads, MODEL, _work(), HW, 5.0,
                                2.0) == pytest.approx(
      max(0.005, 2.0 * rec['recompute_s']))
