"""Placement: which expert sits in each slot, and how tokens reach the slots.

This is the contract between the host-side planner (which produces placements)
and the device-side expert-parallel layer (which consumes them). It is plain
numpy and never imports jax, so the planner stays importable without jax.

Shape letters: L layers, E experts, D expert-parallel (EP) devices, which are
both the sources and the destinations of dispatch, S slots (S = D * s, slot
``j`` lives on device ``j // s``), M micro-steps.

A placement (for one micro-step) is two arrays:

* ``slot_expert_LS`` int32 ``[L, S]``: the canonical expert held by each slot.
  Every expert has at least one slot; slots beyond E hold replicas.
* ``slot_share_LDS`` float32 ``[L, D, S]``: the fraction of source device d's
  tokens for expert ``slot_expert[l, s]`` that go to slot s. For every
  (l, d, e) the shares over the slots holding e sum to 1.

Split rule (shared bit-for-bit in spirit with the device code in
``foremoe_jax.model.slot_assignment``): source d holds n assignments to expert
e, ranked 0..n-1 in token order. The slots holding e, in slot order, have
inclusive cumulative shares c_1 <= ... <= c_r = 1 (c_0 = 0). Slot i receives
the ranks ``[round(c_{i-1} n), round(c_i n))`` with round(x) = floor(x + 0.5),
so a slot's tokens from one source are one contiguous rank range, and shares
built from exact counts (``shares_from_slot_counts``) reproduce those counts.

Shares are whole steps of 2^-24 (``SHARE_GRID``), so every c_i is exact in
float32 whatever order it is summed in: the host (slot order) and the
device (a masked sum, in its backend's order) get the same bits, c_i is
the next slot's lower bound, and c_r is 1 (``grid_shares``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


# The shares' grid: every share is a whole number of 1 / SHARE_GRID steps
# and an expert's shares from one source add up to exactly 1. Any partial
# sum is then a multiple of 2^-24 in [0, 1], which float32 holds exactly, so
# summing needs no rounding in any order. Off the grid, an expert on four or
# more slots could get bounds an ulp apart on the host and the device: a
# token the host counted in a slot then fell between two on the device and
# was lost, where a source's count differs from the one the shares were made
# for (data groups sharing one placement).
SHARE_GRID = 2**24


def grid_steps(upto, n):
  """Cumulative counts in steps of SHARE_GRID, in place: upto (float32,
  tokens a source sends the slots of an expert up to and including each)
  becomes rint(upto / max(n, 1) * 2^24), n the source's tokens for the
  expert (upto = n at its last slot: exactly 2^24). A slot's share is its
  step count less the slot before's, over 2^24; with n < 2^22 the split
  rule turns those shares back into the counts.
  """
  np.divide(upto, np.maximum(n, np.float32(1.0)), out=upto)
  upto *= np.float32(SHARE_GRID)
  np.rint(upto, out=upto)
  return upto


class Placement(NamedTuple):
  """One micro-step's placement of experts into slots. A jax pytree as-is."""

  slot_expert: np.ndarray  # int32 [L, S]
  slot_share: np.ndarray  # float32 [L, D, S]

  @property
  def num_layers(self) -> int:
    return int(self.slot_expert.shape[0])

  @property
  def num_slots(self) -> int:
    return int(self.slot_expert.shape[1])

  @property
  def num_devices(self) -> int:
    return int(self.slot_share.shape[1])

  @property
  def slots_per_device(self) -> int:
    return self.num_slots // self.num_devices


def identity_placement(num_layers: int, num_experts: int, num_devices: int,
                       slots_per_device: int) -> Placement:
  """Static EP: expert e lives on device e // (E / D); tokens use that copy.

  Device d's first E/D slots hold its home experts d*E/D, ...; its remaining
  (redundant) slots hold copies of its own home experts that receive no
  tokens, so the slot budget matches the planners' while the load, and the
  weights each device holds, are those of plain expert parallelism.
  """
  num_slots = num_devices * slots_per_device
  if num_experts % num_devices:
    raise ValueError(f'num_experts = {num_experts} is not divisible by '
                     f'num_devices = {num_devices}.')
  homes = num_experts // num_devices
  if slots_per_device < homes:
    raise ValueError(f'slots_per_device = {slots_per_device} < E / D = '
                     f'{homes}: some expert has no slot.')
  device_S = np.arange(num_slots) // slots_per_device
  local_S = np.arange(num_slots) % slots_per_device
  slot_expert_S = (device_S * homes + local_S % homes).astype(np.int32)
  share_S = (local_S < homes).astype(np.float32)
  slot_expert_LS = np.broadcast_to(slot_expert_S, (num_layers, num_slots))
  share_LDS = np.broadcast_to(share_S, (num_layers, num_devices, num_slots))
  return Placement(slot_expert_LS.copy(), share_LDS.copy())


def stack_placements(placements) -> Placement:
  """Stacks M placements into one with a leading micro-step axis."""
  placements = list(placements)
  return Placement(np.stack([p.slot_expert for p in placements]),
                   np.stack([p.slot_share for p in placements]))


def validate_placement(p: Placement, num_experts: int,
                       slots_per_device: int | None = None,
                       atol: float = 1e-4) -> None:
  """Raises ValueError naming the first broken rule of a placement."""
  se, share = np.asarray(p.slot_expert), np.asarray(p.slot_share)
  if se.ndim != 2 or share.ndim != 3:
    raise ValueError(f'slot_expert must be [L, S] and slot_share [L, D, S]; '
                     f'got {se.shape} and {share.shape}.')
  num_layers, num_slots = se.shape
  if share.shape[0] != num_layers or share.shape[2] != num_slots:
    raise ValueError(f'slot_share shape {share.shape} does not match '
                     f'slot_expert shape {se.shape}.')
  num_devices = share.shape[1]
  if num_slots % num_devices:
    raise ValueError(f'S = {num_slots} slots do not split evenly over '
                     f'D = {num_devices} devices.')
  if slots_per_device is not None and num_slots != num_devices * slots_per_device:
    raise ValueError(f'S = {num_slots} != D * slots_per_device = '
                     f'{num_devices * slots_per_device}.')
  if se.min() < 0 or se.max() >= num_experts:
    raise ValueError(f'slot_expert holds ids outside [0, {num_experts}).')
  for l in range(num_layers):
    held = np.bincount(se[l], minlength=num_experts)
    if (held == 0).any():
      missing = np.flatnonzero(held == 0)[:5].tolist()
      raise ValueError(f'layer {l}: experts {missing} have no slot.')
  if not np.isfinite(share).all() or share.min() < 0:
    raise ValueError('slot_share must be finite and non-negative.')
  sums_LDE = expert_share_sums(p, num_experts)
  bad = np.abs(sums_LDE - 1.0) > atol
  if bad.any():
    l, d, e = np.argwhere(bad)[0]
    raise ValueError(f'shares of expert {e} from source {d} in layer {l} sum '
                     f'to {sums_LDE[l, d, e]:.6f}, not 1.')


def expert_share_sums(p: Placement, num_experts: int) -> np.ndarray:
  """Sum of shares over each expert's slots, per (layer, source): [L, D, E]."""
  se, share = np.asarray(p.slot_expert), np.asarray(p.slot_share)
  num_layers, num_devices, _ = share.shape
  out = np.zeros((num_layers, num_devices, num_experts), np.float64)
  for l in range(num_layers):
    np.add.at(out[l].T, se[l], share[l].T)
  return out


def cumulative_shares(p: Placement) -> tuple[np.ndarray, np.ndarray]:
  """(lo, hi) cumulative share bounds per slot, float32 [L, D, S] each.

  lo[l, d, s] is the sum of shares of the slots before s holding the same
  expert; hi = lo + share. The device sums them under a same-expert mask
  (float32 adds: `slot_assignment.slot_ranges`); here the few slots of
  each expert are summed in slot order instead (O(S) per source, not
  O(S^2): at 256 devices the masked product dominated planning). The two
  agree bit for bit for shares on SHARE_GRID, all the planner makes (no
  sum rounds); off it, exactly when an expert has at most 3 slots (at most
  two nonzero terms, added in either order) and to an ulp otherwise.
  """
  se = np.asarray(p.slot_expert)
  share = np.asarray(p.slot_share, np.float32)
  num_layers, num_slots = se.shape
  # Slots grouped by expert, ascending slot index within a group.
  order_LS = np.argsort(se, axis=1, kind='stable')
  se_sorted = np.take_along_axis(se, order_LS, axis=1)
  first_LS = np.ones(se.shape, bool)
  first_LS[:, 1:] = se_sorted[:, 1:] != se_sorted[:, :-1]
  pos = np.arange(num_slots)
  rank_LS = pos - np.maximum.accumulate(np.where(first_LS, pos, 0), axis=1)
  sh = np.take_along_axis(share, order_LS[:, None, :], axis=2)
  lo_sorted = np.zeros_like(sh)
  for r in range(1, int(rank_LS.max(initial=0)) + 1):
    l_N, s_N = np.nonzero(rank_LS == r)
    lo_sorted[l_N, :, s_N] = lo_sorted[l_N, :, s_N - 1] + sh[l_N, :, s_N - 1]
  lo = np.empty_like(lo_sorted)
  np.put_along_axis(lo, order_LS[:, None, :], lo_sorted, axis=2)
  return lo, (lo + share).astype(np.float32)


def round_half_up(x):
  return np.floor(x + np.float32(0.5))


def slot_counts(counts_LDE: np.ndarray, p: Placement) -> np.ndarray:
  """Tokens each slot receives from each source under the split rule: [L, D, S]."""
  counts_LDE = np.asarray(counts_LDE)
  se = np.asarray(p.slot_expert)
  lo, hi = cumulative_shares(p)
  n_LDS = np.take_along_axis(
      counts_LDE, np.broadcast_to(se[:, None, :], lo.shape), axis=2
  ).astype(np.float32)
  start = round_half_up(lo * n_LDS)
  stop = round_half_up(hi * n_LDS)
  return (stop - start).astype(np.int64)


def device_loads(counts_LDE: np.ndarray, p: Placement) -> np.ndarray:
  """Tokens each destination device computes, per layer: [L, D]."""
  sc_LDS = slot_counts(counts_LDE, p)
  num_layers, num_devices, num_slots = sc_LDS.shape
  per_slot_LS = sc_LDS.sum(axis=1)
  return per_slot_LS.reshape(num_layers, num_devices, num_slots // num_devices
                             ).sum(axis=2)


def max_over_mean(loads: np.ndarray, axis=-1) -> np.ndarray:
  """Straggler factor max/mean over devices (DeepSeek's MaxVio + 1)."""
  loads = np.asarray(loads, np.float64)
  mean = loads.mean(axis=axis)
  return np.where(mean > 0, loads.max(axis=axis) / np.maximum(mean, 1e-12), 1.0)


def shares_from_slot_counts(slot_counts_LDS: np.ndarray,
                            slot_expert_LS: np.ndarray) -> np.ndarray:
  """Shares that reproduce integer per-(source, slot) token counts exactly.

  Where a source sends an expert no tokens, its share goes to the expert's
  first slot so that shares still sum to 1.
  """
  sc = np.asarray(slot_counts_LDS, np.float64)
  se = np.asarray(slot_expert_LS)
  num_layers, num_devices, num_slots = sc.shape
  num_experts = int(se.max()) + 1
  totals_LDE = np.zeros((num_layers, num_devices, num_experts))
  for l in range(num_layers):
    np.add.at(totals_LDE[l].T, se[l], sc[l].T)
  tot_LDS = np.take_along_axis(
      totals_LDE, np.broadcast_to(se[:, None, :], sc.shape), axis=2)
  # Counts up to and including each slot, in slot order among its expert's.
  order_LS = np.argsort(se, axis=1, kind='stable')
  se_sorted = np.take_along_axis(se, order_LS, axis=1)
  first_sorted = np.ones(se.shape, bool)
  first_sorted[:, 1:] = se_sorted[:, 1:] != se_sorted[:, :-1]
  start_LS = np.maximum.accumulate(
      np.where(first_sorted, np.arange(num_slots), 0), axis=1)
  sc_sorted = np.take_along_axis(sc, order_LS[:, None, :], axis=2)
  cum = np.cumsum(sc_sorted, axis=2)
  upto_sorted = cum - np.take_along_axis(
      cum - sc_sorted, np.broadcast_to(start_LS[:, None, :], sc.shape), axis=2)
  upto = np.empty(sc.shape, np.float32)
  np.put_along_axis(upto, order_LS[:, None, :], upto_sorted, axis=2)
  steps = grid_steps(upto, tot_LDS.astype(np.float32))
  prev = np.zeros_like(steps)
  prev_sorted = np.zeros_like(steps)
  prev_sorted[:, :, 1:] = np.where(
      first_sorted[:, None, 1:], 0.0,
      np.take_along_axis(steps, order_LS[:, None, :], axis=2)[:, :, :-1])
  np.put_along_axis(prev, order_LS[:, None, :], prev_sorted, axis=2)
  share = (steps - prev) * np.float32(1.0 / SHARE_GRID)
  # First slot of each expert per layer takes the whole share when idle.
  first_LS = np.zeros_like(se, dtype=bool)
  np.put_along_axis(first_LS, order_LS, first_sorted, axis=1)
  share = np.where((tot_LDS == 0) & first_LS[:, None, :], 1.0, share)
  return share.astype(np.float32)


def grid_shares(slot_share_LDS: np.ndarray,
                slot_expert_LS: np.ndarray) -> np.ndarray:
  """Shares moved onto SHARE_GRID: float32 [L, D, S].

  Each slot's cumulative share (through it, among its expert's slots in
  slot order) is rounded to a whole number of 2^-24 steps, an expert's
  last slot's to exactly 1, and a slot's share is the step from the slot
  before; each share moves by at most 2^-24 (plus the last slot's
  shortfall from 1). Shares of one source for one expert must add up to
  about 1, as every placement's do.
  """
  se = np.asarray(slot_expert_LS)
  share = np.asarray(slot_share_LDS, np.float64)
  num_slots = se.shape[1]
  order_LS = np.argsort(se, axis=1, kind='stable')
  se_sorted = np.take_along_axis(se, order_LS, axis=1)
  first_LS = np.ones(se.shape, bool)
  first_LS[:, 1:] = se_sorted[:, 1:] != se_sorted[:, :-1]
  last_LS = np.ones(se.shape, bool)
  last_LS[:, :-1] = first_LS[:, 1:]
  pos = np.arange(num_slots)
  start_LS = np.maximum.accumulate(np.where(first_LS, pos, 0), axis=1)
  sh = np.take_along_axis(share, order_LS[:, None, :], axis=2)
  cum = np.cumsum(sh, axis=2)
  hi = cum - np.take_along_axis(cum - sh, np.broadcast_to(
      start_LS[:, None, :], sh.shape), axis=2)
  hi = np.where(last_LS[:, None, :], 1.0, np.clip(hi, 0.0, 1.0))
  steps = np.rint(hi * SHARE_GRID)
  before = np.zeros_like(steps)
  before[:, :, 1:] = np.where(first_LS[:, None, 1:], 0.0, steps[:, :, :-1])
  out = np.empty(sh.shape, np.float32)
  np.put_along_axis(out, order_LS[:, None, :],
                    ((steps - before) / SHARE_GRID).astype(np.float32),
                    axis=2)
  return out


def cell_counts(counts_LDE: np.ndarray, p: Placement) -> np.ndarray:
  """Tokens each source sends each destination device: [L, D_src, D_dst].

  The expert-parallel layer pads every (source, destination) cell to one
  static capacity, so the largest cell picks the capacity bucket. counts_LDE
  are one data group's loads (with data parallelism, `max_cell` takes the
  largest over the groups).
  """
  sc_LDS = slot_counts(counts_LDE, p)
  num_layers, num_devices, num_slots = sc_LDS.shape
  return sc_LDS.reshape(num_layers, num_devices, num_devices,
                        num_slots // num_devices).sum(axis=3)


def max_cell(counts_GLDE: np.ndarray, p: Placement) -> int:
  """Largest (source, destination device) cell of any data group.

  counts_GLDE: one micro-step's loads per data group ([G, L, D, E],
  `foresight.loads.microstep_group_loads`). Each data group dispatches its
  own tokens over its own 'expert' row with its own split of each source's
  count over the replicas, so cells are counted group by group; the capacity
  must hold the largest. (Cells of the loads summed over groups would be
  about G times too large, and not exactly any group's: the split rule
  rounds each group's count separately.)
  """
  counts_GLDE = np.asarray(counts_GLDE)
  if counts_GLDE.ndim != 4:
    raise ValueError(f'counts must be [G, L, D, E]; got {counts_GLDE.shape}.')
  return max(int(cell_counts(c_LDE, p).max(initial=0)) for c_LDE in counts_GLDE)


def max_received(counts_GLDE: np.ndarray, p: Placement) -> int:
  """Most rows any device receives in any data group and layer.

  What the exact-count dispatch's receive buffer must hold (its capacity R):
  a device's load (`device_loads`) within one data group, whose tokens
  alone it is sent. counts_GLDE: one micro-step's per-group loads.
  """
  counts_GLDE = np.asarray(counts_GLDE)
  if counts_GLDE.ndim != 4:
    raise ValueError(f'counts must be [G, L, D, E]; got {counts_GLDE.shape}.')
  return max(int(device_loads(c_LDE, p).max(initial=0))
             for c_LDE in counts_GLDE)


def capacity_demand(counts_GLDE: np.ndarray, p: Placement,
                    dispatch: str) -> int:
  """Rows the capacity must hold under `dispatch` ('exact': a device's
  received rows, `max_received`; 'padded': the largest cell, `max_cell`)."""
  if dispatch == 'exact':
    return max_received(counts_GLDE, p)
  if dispatch == 'padded':
    return max_cell(counts_GLDE, p)
  raise ValueError(f"dispatch must be 'exact' or 'padded', got {dispatch!r}.")
