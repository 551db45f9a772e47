"""The cluster simulator against hand-computed cases.

Every expected number below is worked out by hand from the profile's
constants: a perfectly balanced load, a single hot expert, an all-to-all
across two nodes, one move round, hidden and exposed moves.
"""
import dataclasses

import numpy as np
import pytest

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import plan as plan_lib
from foremoe_jax.planner.topology import CostModel, Topology
from foremoe_jax.sim import costs, hardware, simulate, workload
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
  return workload.Workload(num_devices=2, num_microsteps=num_micro,
                           seqs_per_microbatch=1, tokens_per_seq=8,
                           redundant_slots_per_device=1, **kw)


def _method_plan(loads_MLDE, slot_expert_MLS, flows_MLS, topo, capacity=8):
  cost = CostModel()
  home = placement_lib.identity_placement(1, 4, topo.num_devices,
                                          topo.slots_per_device).slot_expert
  plan = plan_lib.assemble_plan(loads_MLDE, slot_expert_MLS, flows_MLS, topo,
                                cost, home)
  budget = schedule.TransferBudget(step_rounds=4, microstep_rounds=2)
  transfer = schedule.build_step_transfer(plan.placement.slot_expert, 4, topo,
                                          budget)
  return simulate.MethodPlan(plan, transfer, capacity, capacity, 0, 0.0)


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
  r = simulate.time_step(mp, loads, MODEL, _work(), HW, 'ragged')
  assert r['moe_compute_s'] == pytest.approx(2 * 16 * ROW_S)
  # Only local copies of the home experts into their slots (3 per device).
  assert r['transfer_s'] == pytest.approx(3 * 2 * MODEL.bytes_per_expert / 1e15)
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
  rs = simulate.time_step(static, loads, MODEL, _work(), HW, 'ragged')
  rf = simulate.time_step(spread, loads, MODEL, _work(), HW, 'ragged')
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
  micro-step 0, hidden when transfers overlap compute, exposed when not."""
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
  hidden = simulate.time_step(mp, loads, MODEL, _work(), slow, 'ragged')
  assert hidden['transfer_hidden_s'] == pytest.approx(move)
  exposed = simulate.time_step(
      mp, loads, MODEL, _work(), dataclasses.replace(slow, transfer_overlap=0.0),
      'ragged')
  assert exposed['transfer_hidden_s'] == 0.0
  assert exposed['update_s'] - hidden['update_s'] == pytest.approx(move)


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
  """A small grid end to end: ForeMoE never predicts a slower update than
  static EP on a skewed trace, and every row carries its speedups."""
  from foremoe_jax.sim import cluster  # pylint: disable=import-outside-toplevel
  rows = cluster.run_grid(
      models=('mixtral_8x7b',), device_counts=(8,), profiles=(hardware.H100,),
      modes=('ragged',), work_kwargs=dict(num_microsteps=2,
                                          seqs_per_microbatch=1,
                                          tokens_per_seq=256),
      log=lambda *a: None)
  assert {r['method'] for r in rows} == set(simulate.METHODS)
  fore = cluster.find(rows, method='foremoe')
  assert fore['speedup_update_vs_static'] >= 1.0
  assert fore['update_s'] == pytest.approx(
      fore['fill_s'] + fore['flush_s'] + fore['moe_compute_s']
      + fore['all_to_all_s'] + fore['nonexpert_s'] + fore['transfer_exposed_s']
      - fore['fill_s'] - fore['flush_s'] + fore['optimizer_s']
      + fore['grad_sync_s'])


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
      methods=('static',), modes=('ragged',), trace=rec,
      work_kwargs=dict(num_microsteps=2, seqs_per_microbatch=1,
                       tokens_per_seq=100), log=lambda *a: None)
  # Device 3 computes all 8 x 100 assignments of each layer and micro-step.
  rows_s = 8 * 100 * mixtral.expert_flops_per_row() / hardware.H100.flops_per_s
  assert rows[0]['moe_compute_s'] == pytest.approx(
      2 * mixtral.num_moe_layers * rows_s)
  with pytest.raises(ValueError, match='does not fit mixtral_8x7b'):
    cluster.check_trace(traces.trace_from_step_loads(list(loads[:, :1])),
                        mixtral, 8, 2)
