"""A simple greedy balanced placement: the baseline before any foresight planner.

Water-fills replicas onto the hottest experts (load per replica), packs the
replica slots onto devices largest-first, and splits every source's tokens
evenly across an expert's replicas. No transfer awareness, no node level:
a yardstick for the expert-parallel layer's benchmark and tests.
"""
from __future__ import annotations

import heapq

import numpy as np

from foremoe_jax import placement as placement_lib


def greedy_placement(counts_LDE: np.ndarray, slots_per_device: int
                     ) -> placement_lib.Placement:
  counts_LDE = np.asarray(counts_LDE)
  num_layers, num_devices, num_experts = counts_LDE.shape
  num_slots = num_devices * slots_per_device
  slot_expert = np.zeros((num_layers, num_slots), np.int32)
  for l in range(num_layers):
    load_E = counts_LDE[l].sum(axis=0).astype(np.float64)
    replicas_E = np.ones(num_experts, np.int64)
    heap = [(-load_E[e], e) for e in range(num_experts)]
    heapq.heapify(heap)
    for _ in range(num_slots - num_experts):  # Water-filling on load/replicas.
      _, e = heapq.heappop(heap)
      replicas_E[e] += 1
      heapq.heappush(heap, (-load_E[e] / replicas_E[e], e))
    experts = np.repeat(np.arange(num_experts), replicas_E)
    slot_load = load_E[experts] / replicas_E[experts]
    dev_load = np.zeros(num_devices)
    free = np.full(num_devices, slots_per_device)
    filled = np.zeros(num_devices, np.int64)
    for i in np.argsort(-slot_load, kind='stable'):  # Largest first.
      d = int(np.argmin(np.where(free > 0, dev_load, np.inf)))
      slot_expert[l, d * slots_per_device + filled[d]] = experts[i]
      filled[d] += 1
      free[d] -= 1
      dev_load[d] += slot_load[i]
  replicas_LS = np.stack([np.bincount(se, minlength=num_experts)[se]
                          for se in slot_expert])
  share = np.broadcast_to((1.0 / replicas_LS)[:, None, :],
                          (num_layers, num_devices, num_slots))
  return placement_lib.Placement(slot_expert, share.astype(np.float32).copy())
