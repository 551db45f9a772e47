"""The foresight's counting, done where the routing record lives: on device.

The sampler's routing record is [L, B, T, K] per step (48 x 256 x 4,096 x 8
at Qwen3-30B-A3B scale, over 400M ids): copying it to the host and
counting it there sat on the critical path before the recompute. Instead
each device counts the routes of its own samples (a scatter-add per
device, under `jax.shard_map`), and only the per-sample counts [B, L, E]
reach the host; the planner's loads per micro-step are sums of them
(`loads.loads_from_sample_counts`), and the record stays on device for
the RL step to replay.

Why per sample, and not the [M, G, L, D, E] loads themselves: which
samples share a micro-step is chosen on the host after the rollout
(`composition`, from the verifier's output and these counts), so the
device cannot sum by micro-step before that choice. The per-sample array
is b times the loads' size, b the samples per device per micro-step: at
the scale above, 256 samples x 48 layers x 128 experts x 4 B = 6.3 MB
per step, against 1.6 GB of int32 routing ids.

Shape letters: L MoE layers, B samples, T tokens, K top-k, E experts, b
samples on one device.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax.model.expert_parallel import DATA, EXPERT
from foremoe_jax.utils import distributed


def _count_local(routes_LbTK, valid_bT, *, num_experts: int):
  num_layers, num_rows, _, top_k = routes_LbTK.shape
  ids = routes_LbTK.astype(jnp.int32)
  keep = jnp.broadcast_to(valid_bT[None, :, :, None], ids.shape)
  row = jnp.arange(num_rows, dtype=jnp.int32)[None, :, None, None]
  layer = jnp.arange(num_layers, dtype=jnp.int32)[:, None, None, None]
  flat = jnp.where(keep, (row * num_layers + layer) * num_experts + ids,
                   num_rows * num_layers * num_experts)
  counts = jnp.zeros((num_rows * num_layers * num_experts + 1,), jnp.int32)
  counts = counts.at[flat.reshape(-1)].add(1)[:-1]
  del top_k
  return counts.reshape(num_rows, num_layers, num_experts)


def make_counter(mesh, num_experts: int):
  """jit(routes_LBTK, valid_BT) -> counts_BLE int32, each device counting
  its own rows (routes split over the mesh along B, as the sampler holds
  them). Build once per mesh (the sampler keeps it)."""
  rows = (DATA, EXPERT)
  return jax.jit(jax.shard_map(
      functools.partial(_count_local, num_experts=int(num_experts)),
      mesh=mesh, in_specs=(P(None, rows), P(rows)), out_specs=P(rows)))


def sample_counts(counter, routes_LBTK, valid_BT, mesh) -> np.ndarray:
  """int64 counts_BLE on the host: each sample's valid assignments to each
  expert, per MoE layer, counted by `counter` (`make_counter`) on the
  devices that hold the routes.

  routes_LBTK: the routing record (a device array, or numpy); valid_BT:
  bool, the positions to count. B must split over the mesh (the sampler
  pads its rows to a multiple of it).
  """
  rows = NamedSharding(mesh, P((DATA, EXPERT)))
  if isinstance(valid_BT, np.ndarray):
    valid_BT = distributed.global_array(valid_BT, rows)
  if isinstance(routes_LBTK, np.ndarray):
    routes_LBTK = distributed.global_array(
        routes_LBTK, NamedSharding(mesh, P(None, (DATA, EXPERT))))
  return np.asarray(distributed.to_host(counter(routes_LBTK, valid_BT)),
                    np.int64)
