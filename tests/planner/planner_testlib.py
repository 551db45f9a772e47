"""Small traces, machines and checks shared by the planner tests (numpy only).

A plain module (not a conftest) so tests can import its helpers by name.
"""
import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.foresight import traces
from foremoe_jax.planner.topology import CostModel, Topology


def small_trace(num_experts=32, num_devices=8, top_k=4, num_layers=3,
                num_microsteps=4, num_steps=3, seed=0, tokens_per_seq=1024,
                hot_share_range=(0.08, 0.12)):
  return traces.synthetic_trace(traces.SyntheticTraceConfig(
      num_steps=num_steps, num_microsteps=num_microsteps, num_layers=num_layers,
      num_experts=num_experts, top_k=top_k, num_devices=num_devices,
      tokens_per_seq=tokens_per_seq, hot_share_range=hot_share_range,
      seed=seed))


def one_node():
  """32 experts on 8 devices of one node, 2 redundant slots per device."""
  return small_trace(), Topology(1, 8, 32 // 8 + 2)


def two_nodes():
  """64 experts on 2 nodes x 4 devices, 2 redundant slots per device."""
  return (small_trace(num_experts=64, seed=3, hot_share_range=(0.05, 0.08)),
          Topology(2, 4, 64 // 8 + 2))


COST = CostModel()


def identity_for(trace, topo):
  _, _, num_layers, _, num_experts = trace.loads_RMLDE.shape
  return placement_lib.identity_placement(num_layers, num_experts,
                                          topo.num_devices,
                                          topo.slots_per_device)


def check_plan(plan, loads_MLDE, topo):
  """Every placement valid, splits add up, predictions match the placement."""
  num_experts = loads_MLDE.shape[-1]
  for m in range(plan.num_microsteps):
    p = plan.microstep(m)
    placement_lib.validate_placement(p, num_experts, topo.slots_per_device)
    counts_LDS = placement_lib.slot_counts(loads_MLDE[m], p)
    # Each (layer, source, expert)'s tokens land exactly once.
    per_expert = np.zeros(loads_MLDE[m].shape, np.int64)
    for l in range(per_expert.shape[0]):
      np.add.at(per_expert[l].T, p.slot_expert[l], counts_LDS[l].T)
    np.testing.assert_array_equal(per_expert, loads_MLDE[m])
    np.testing.assert_array_equal(placement_lib.device_loads(loads_MLDE[m], p),
                                  plan.loads_MLD[m])
    np.testing.assert_array_equal(counts_LDS.sum(axis=1), plan.slot_loads_MLS[m])
    np.testing.assert_array_equal(counts_LDS.max(axis=(1, 2)),
                                  plan.max_cell_ML[m])
