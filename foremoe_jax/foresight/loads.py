"""Exact per-micro-step expert loads from the routing record (the foresight).

Sits between rollout and planner: the sampler records every token's top-k
expert ids (`routes_LBTK`); once the samples are composed into micro-batches,
this module counts, for every micro-step, layer, source EP device and expert,
how many token-assignments will be dispatched. The planner places experts
from these counts (`loads_MLDE`), and `placement.device_loads` scores a
placement against them. Plain numpy, no jax.

Shape letters: L MoE layers, B samples, T tokens per sample, K top-k,
M micro-steps, G data groups (d_data), D expert-parallel (EP) source devices
(d_ep), E experts.

Device layout of a micro-batch (fixed; the model's expert-parallel layer
follows it): micro-batch m holds samples `microbatches[m]`, in that order. Its
tokens [B_m, T] are flattened row-major to i in [0, B_m * T) and split into
N = d_data * d_ep equal contiguous shards, shard = i // (B_m * T // N), on a
mesh ('data', 'expert') laid out data-major, so the shard's data group is
shard // d_ep and its EP device shard % d_ep.

Each data group runs its own dispatch (an all-to-all over its 'expert' row,
with its own split of each source's tokens over an expert's replicas), so the
dispatch cells, and the capacity bucket picked from them, are per data
group: `microstep_group_loads` keeps the groups apart (loads_MGLDE). Every
data row holds the same placement, so the planner balances the sum over the
groups (`microstep_loads`, loads_MLDE); a bucket picked from that sum would
be about d_data times too large.
Padding tokens (valid_BT False) are not dispatched and count for nothing.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def source_shards(num_rows: int, num_tokens: int, d_data: int,
                  d_ep: int) -> np.ndarray:
  """Device shard g * d_ep + d of each token of a [num_rows, num_tokens]
  micro-batch: data group g, EP source device d."""
  num_shards = d_data * d_ep
  size = num_rows * num_tokens
  if size % num_shards:
    raise ValueError(
        f'a micro-batch of {num_rows} samples x {num_tokens} tokens = {size} '
        f'tokens does not split over d_data * d_ep = {num_shards} devices; '
        f'pick a micro-batch size with B_m * T divisible by {num_shards}.')
  shard_I = np.arange(size) // (size // num_shards)
  return shard_I.reshape(num_rows, num_tokens)


def source_devices(num_rows: int, num_tokens: int, d_data: int,
                   d_ep: int) -> np.ndarray:
  """EP source device of each token of a [num_rows, num_tokens] micro-batch."""
  return source_shards(num_rows, num_tokens, d_data, d_ep) % d_ep


def _check_record(routes_LBTK, valid_BT):
  routes_LBTK = np.asarray(routes_LBTK)
  if routes_LBTK.ndim != 4:
    raise ValueError(f'routes must be [L, B, T, K]; got {routes_LBTK.shape}.')
  _, num_samples, num_tokens, _ = routes_LBTK.shape
  if valid_BT is None:
    valid_BT = np.ones((num_samples, num_tokens), bool)
  valid_BT = np.asarray(valid_BT, bool)
  if valid_BT.shape != (num_samples, num_tokens):
    raise ValueError(f'valid_BT shape {valid_BT.shape} does not match routes '
                     f'[L, B, T, K] = {routes_LBTK.shape}.')
  return routes_LBTK, valid_BT


def _count_LDE(routes_LBTK, valid_BT, src_BT, num_experts, num_devices):
  """Counts (layer, source, expert) triples of valid assignments."""
  num_layers, _, _, top_k = routes_LBTK.shape
  ids_LBTK = routes_LBTK.astype(np.int64)
  keep_LBTK = np.broadcast_to(valid_BT[None, :, :, None], ids_LBTK.shape)
  ids_V = ids_LBTK[keep_LBTK]
  if ids_V.size and (ids_V.min() < 0 or ids_V.max() >= num_experts):
    raise ValueError(f'valid tokens route to expert ids outside '
                     f'[0, {num_experts}): min {ids_V.min()}, '
                     f'max {ids_V.max()}.')
  layer_LBTK = np.broadcast_to(
      np.arange(num_layers)[:, None, None, None], ids_LBTK.shape)
  src_LBTK = np.broadcast_to(src_BT[None, :, :, None], ids_LBTK.shape)
  flat_V = ((layer_LBTK[keep_LBTK] * num_devices + src_LBTK[keep_LBTK])
            * num_experts + ids_V)
  counts = np.bincount(flat_V, minlength=num_layers * num_devices * num_experts)
  return counts.astype(np.int64).reshape(num_layers, num_devices, num_experts)


def microstep_group_loads(routes_LBTK: np.ndarray,
                          valid_BT: np.ndarray | None,
                          microbatches: Sequence[np.ndarray], num_experts: int,
                          d_data: int, d_ep: int) -> np.ndarray:
  """int64 loads_MGLDE: assignments each (data group, EP source device)
  sends each expert.

  What one data group's dispatch sees: its cells (and so the capacity
  bucket) come from these, one group at a time. `microbatches[m]` lists the
  sample indices of micro-step m in device order (see the module
  docstring); valid_BT None means every token is valid.
  """
  routes_LBTK, valid_BT = _check_record(routes_LBTK, valid_BT)
  num_layers, num_samples, num_tokens, _ = routes_LBTK.shape
  loads_MGLDE = np.zeros((len(microbatches), d_data, num_layers, d_ep,
                          num_experts), np.int64)
  for m, idx in enumerate(microbatches):
    idx = np.asarray(idx, np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= num_samples):
      raise ValueError(f'micro-batch {m} holds sample ids outside '
                       f'[0, {num_samples}).')
    # Shards are data-major, so counting per shard and splitting the shard
    # axis into (G, D) keeps the groups apart.
    shard_BT = source_shards(idx.size, num_tokens, d_data, d_ep)
    counts_LNE = _count_LDE(routes_LBTK[:, idx], valid_BT[idx], shard_BT,
                            num_experts, d_data * d_ep)
    loads_MGLDE[m] = counts_LNE.reshape(num_layers, d_data, d_ep,
                                        num_experts).transpose(1, 0, 2, 3)
  return loads_MGLDE


def microstep_loads(routes_LBTK: np.ndarray, valid_BT: np.ndarray | None,
                    microbatches: Sequence[np.ndarray], num_experts: int,
                    d_data: int, d_ep: int) -> np.ndarray:
  """int64 loads_MLDE: assignments each EP source device sends each expert,
  summed over the data groups (the planner's view; see the module docstring).
  """
  return microstep_group_loads(routes_LBTK, valid_BT, microbatches,
                               num_experts, d_data, d_ep).sum(axis=1)


def step_loads(routes_LBTK: np.ndarray, valid_BT: np.ndarray | None,
               microbatches: Sequence[np.ndarray], num_experts: int,
               d_data: int, d_ep: int) -> np.ndarray:
  """int64 [L, D, E]: the step's loads, summed over its micro-steps.

  This is the step-level view that history-based balancers see.
  """
  return microstep_loads(routes_LBTK, valid_BT, microbatches, num_experts,
                         d_data, d_ep).sum(axis=0)


def sample_expert_counts(routes_LBTK: np.ndarray, valid_BT: np.ndarray | None,
                         num_experts: int) -> np.ndarray:
  """int64 counts_BLE: assignments of each sample to each expert, per layer.

  Device-independent; micro-batch composition balances these.
  """
  routes_LBTK, valid_BT = _check_record(routes_LBTK, valid_BT)
  num_layers, num_samples, num_tokens, _ = routes_LBTK.shape
  # Treat each sample as its own "device" to reuse the one counting routine.
  sample_BT = np.broadcast_to(np.arange(num_samples)[:, None],
                              (num_samples, num_tokens))
  counts_LBE = _count_LDE(routes_LBTK, valid_BT, sample_BT, num_experts,
                          num_samples)
  return counts_LBE.transpose(1, 0, 2)


def loads_from_sample_counts(counts_BLE: np.ndarray,
                             microbatches: Sequence[np.ndarray], d_data: int,
                             d_ep: int) -> np.ndarray:
  """int64 loads_MGLDE from per-sample counts [B, L, E] (the sampler counts
  them on device): the foresight without the routing record on the host.

  Each device holds whole sequences of every micro-batch (the RL step's
  layout), so a shard is b / (d_data * d_ep) consecutive samples of the
  micro-batch and its load is the sum of their counts. Equal to
  `microstep_group_loads` of the routes whenever that layout holds.
  """
  counts_BLE = np.asarray(counts_BLE, np.int64)
  mb_Mb = np.stack([np.asarray(m, np.int64).reshape(-1)
                    for m in microbatches])
  num_micro, per_mb = mb_Mb.shape
  num_shards = d_data * d_ep
  if per_mb % num_shards:
    raise ValueError(
        f'micro-batches of {per_mb} samples do not split into whole '
        f'sequences over d_data * d_ep = {num_shards} devices.')
  _, num_layers, num_experts = counts_BLE.shape
  x = counts_BLE[mb_Mb].reshape(num_micro, d_data, d_ep,
                                per_mb // num_shards, num_layers, num_experts)
  return x.sum(axis=3).transpose(0, 1, 3, 2, 4)
