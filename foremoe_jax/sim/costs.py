"""Seconds for each piece of an RL step's update, from counts and a profile.

Pure functions of numpy counts (token loads, dispatch cells, move rounds)
and a `HardwareProfile`; `simulate` adds them up per micro-step. Each
function states what it models; the module's assumptions, in one place:

* Expert compute runs on every EP device at once; a micro-step's MoE time
  is the slowest device's (the straggler). Two dispatch models:
  ``padded`` is the EP layer as built (foremoe_jax/model/expert_parallel):
  every (source, destination) cell is padded to the step's capacity
  bucket C, so every device computes D * C rows plus a partial tile per
  slot, and balance pays off through a smaller bucket; ``ragged`` is an
  exact-count dispatch (DeepEP-style kernels), where a device computes its
  own load and balance pays off directly (on CPU, `tiled_gemm`, each
  slot's rows rounded up to whole tiles, as the tile loop runs them).
* A device's expert GEMMs cannot beat reading their weights once per pass
  (a roofline on HBM); rows times FLOPs per row over the achievable rate
  otherwise.
* An update layer runs four token all-to-alls (dispatch and combine
  forward, their transposes backward), the recompute two. A device's
  all-to-all time is its busier direction: bytes to its own node over the
  intra-node rate and bytes to other nodes over the inter-node rate, the
  two tiers in parallel, plus one latency of the slowest tier used.
* Expert moves follow the transfer schedule's mode. ``exact``: one
  ragged all-to-all per layer and transition carrying exactly the experts
  that move, timed like a token all-to-all (each device's busier direction
  over its links); on CPU the engine emulates it by cyclic-shift rounds,
  as many per shift as its busiest pair has items, each priced as one
  expert copy at the engine's measured round (`emulated_rounds`).
  ``rounds``: a cyclic-shift permute in which every device
  sends at most one expert; a round takes the bytes of one expert over the
  slowest link any of its pairs uses, plus that link's latency, and the
  rounds of a layer run one after another.
* Moves into micro-step m + 1 run while micro-step m computes (the engine
  double-buffers); with ``exact`` mode's exchanges on GPU/TPU each layer's
  fill runs in its step of m's forward and each layer's returns in its
  step of m's backward, and hides under `transfer_overlap` of that step's
  compute (`simulate.layer_windows`); the rest is exposed. Nothing hides
  the CPU emulation's (in scans of their own) nor ``rounds`` mode's (each
  round's permute sits in a conditional, `simulate.move_overlap`). The
  first fill runs under the recompute's forward where the step prefills
  (`simulate.prefill_exposed`), else it is exposed; the last flush runs
  inside the last micro-step's backward, layer by layer
  (`simulate.flush_exposed`).
"""
from __future__ import annotations

import numpy as np

from foremoe_jax.sim.hardware import (HardwareProfile, link_bandwidth,
                                      link_latency)
from foremoe_jax.sim.workload import ModelShape
from foremoe_jax.transfer import schedule


def expert_time(rows, slots_per_device: int, model: ModelShape,
                hw: HardwareProfile, passes: int = 3):
  """Seconds for a device to run `rows` token-assignments through its
  slots (array-friendly): compute or weight reads, whichever is longer."""
  compute = np.asarray(rows, np.float64) * model.expert_flops_per_row(
      passes) / hw.flops_per_s
  reads = passes * slots_per_device * model.bytes_per_expert / hw.hbm_bw
  return np.maximum(compute, reads)


def padded_rows(num_devices: int, capacity: int, slots_per_device: int,
                tile: int) -> int:
  """Rows a device computes in the padded EP layer: D cells of C rows,
  plus up to one partial tile per slot."""
  return num_devices * capacity + slots_per_device * tile


def _node_masks(num_devices: int, hw: HardwareProfile):
  node = np.arange(num_devices) // hw.node_size(num_devices)
  same = node[:, None] == node[None, :]
  off_diag = ~np.eye(num_devices, dtype=bool)
  return same & off_diag, ~same


def all_to_all_time(bytes_SD, hw: HardwareProfile):
  """One all-to-all in which source s sends bytes_SD[s, d] to device d
  (the diagonal stays local): the slowest device's busier direction."""
  b = np.asarray(bytes_SD, np.float64)
  num_devices = b.shape[-1]
  if num_devices == 1:
    return 0.0
  intra, inter = _node_masks(num_devices, hw)
  bw_intra, bw_inter = hw.a2a_bandwidth(num_devices)
  t = 0.0
  for x in (b, b.T):  # Sends per row, then receives per row.
    t_intra = (x * intra).sum(axis=1) / bw_intra
    t_inter = (x * inter).sum(axis=1) / bw_inter
    t = max(t, float(np.maximum(t_intra, t_inter).max()))
  latency = hw.inter_latency_s if inter.any() else hw.intra_latency_s
  return t + latency


def node_traffic(rows_SD, hw: HardwareProfile):
  """Where one all-to-all's rows go (rows_SD[s, d]: source s to device d):
  (rows each device sends to other nodes [D], rows each device receives
  from other nodes [D], rows that stay inside their node). The inter-node
  link is the slow tier, so these, not the rows a device computes or
  sends in all, set `all_to_all_time` once several nodes take part."""
  x = np.asarray(rows_SD, np.float64)
  _, inter = _node_masks(x.shape[-1], hw)
  inter_x = x * inter
  return inter_x.sum(axis=1), inter_x.sum(axis=0), float(x.sum() - inter_x.sum())


def padded_cells(num_devices: int, capacity: int) -> np.ndarray:
  """Rows per (source, destination) cell in the padded layer: all C."""
  return np.full((num_devices, num_devices), float(capacity))


def rounds_time(shift_R, recv_RD, item_bytes: float, hw: HardwareProfile,
                num_devices: int) -> float:
  """Seconds of one layer's rounds of one transition (idle rounds free).

  shift_R: int [R] cyclic shift per round (0 idle); recv_RD: int [R, D]
  the receiver's slot (>= 0 when it receives).
  """
  node = np.arange(num_devices) // hw.node_size(num_devices)
  total = 0.0
  for shift, recv_D in zip(np.asarray(shift_R), np.asarray(recv_RD)):
    if shift == 0:
      continue
    dst = np.flatnonzero(recv_D >= 0)
    if not len(dst):
      continue
    src = (dst - shift) % num_devices
    inter = bool((node[src] != node[dst]).any())
    total += item_bytes / link_bandwidth(hw, inter) + link_latency(hw, inter)
  return total


def exchange_time(count_DD, item_bytes: float, hw: HardwareProfile) -> float:
  """One ragged all-to-all of whole experts (``exact`` mode): source c
  sends count_DD[c, d] items to d; free when nothing moves. With the
  emulated exchange (CPU) the engine runs it as cyclic-shift rounds
  instead, each one point-to-point copy of one expert per device
  (`emulated_rounds`), priced at the engine's own measured round."""
  count = np.asarray(count_DD, np.float64)
  if not count.any():
    return 0.0
  if hw.emulated_exchange:
    return emulated_rounds(count) * (
        item_bytes / link_bandwidth(hw, False) + link_latency(hw, False))
  return all_to_all_time(count * item_bytes, hw)


def emulated_rounds(count_DD) -> int:
  """Rounds of the CPU emulation of one exact exchange
  (`transfer.engine._exchange_by_rounds`): shift k (device c to c + k)
  takes as many rounds as its busiest pair has items; idle shifts none."""
  return int(schedule.shift_depths(count_DD)[1:].sum())


def transition_time(t, layer_index, model: ModelShape, hw: HardwareProfile,
                    num_devices: int, grad_bytes_per_param: int,
                    fills: bool = True, returns: bool = True) -> float:
  """Fills and (or, by `fills` / `returns`, only one of them) gradient
  returns of one layer of one schedule Transition (its arrays indexed by
  `layer_index`, a tuple), all devices at once."""
  grad_bytes = model.params_per_expert * grad_bytes_per_param
  if hasattr(t, 'count_LPDD'):  # An ExactTransition: exchanges in stages.
    fill_s = sum(exchange_time(c_DD, model.bytes_per_expert, hw)
                 for c_DD in t.count_LPDD[layer_index])
    grad_s = sum(exchange_time(c_DD, grad_bytes, hw)
                 for c_DD in t.ret_count_LPDD[layer_index])
  else:
    fill_s = rounds_time(t.shift_LR[layer_index], t.recv_LRD[layer_index],
                         model.bytes_per_expert, hw, num_devices)
    grad_s = rounds_time(t.ret_shift_LR[layer_index],
                         t.ret_recv_LRD[layer_index], grad_bytes, hw,
                         num_devices)
  return fill_s * fills + grad_s * returns


def local_copy_time(num_copies_D, model: ModelShape, hw: HardwareProfile):
  """A device copying whole experts inside its own memory (read + write)."""
  return float(np.max(num_copies_D)) * 2 * model.bytes_per_expert / hw.hbm_bw


def optimizer_time(params_per_device: float, hw: HardwareProfile,
                   bytes_per_param: float = 32.0) -> float:
  """AdamW on f32 master weights: read param, grad, two moments; write
  param and moments (~32 bytes per parameter), memory bound."""
  return params_per_device * bytes_per_param / hw.hbm_bw


def allreduce_time(num_bytes: float, num_devices: int,
                   hw: HardwareProfile, stride: int = 1) -> float:
  """Ring all-reduce of `num_bytes` over `num_devices` (2 (n-1)/n of the
  bytes cross the slowest tier the ring uses). stride: the devices' spacing
  in the cluster's order, e.g. the EP size for the expert gradients'
  reduction over data groups (the mesh is data-major: device d's peers are
  d + ep, d + 2 ep, ...); the ring leaves a node when its span does."""
  if num_devices <= 1:
    return 0.0
  span = num_devices * stride
  multi_node = hw.node_size(span) < span
  bw, lat = ((hw.inter_bw, hw.inter_latency_s) if multi_node
             else (hw.a2a_bandwidth(num_devices)[0], hw.intra_latency_s))
  return (2.0 * (num_devices - 1) / num_devices * num_bytes / bw
          + 2 * (num_devices - 1) * lat)
