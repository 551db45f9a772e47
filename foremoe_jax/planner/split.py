"""Token split: how an expert's tokens spread over its replicas.

Step 4 of the hierarchical planner (docs/design.md §5.2), also used by the
baselines. Given a placement's slot_expert and a micro-step's exact loads it
produces, in two stages:

1. Flows: real-valued tokens per slot. ``FlowGraph`` / ``balanced_flows``
   level the device loads (min max load, which for splittable loads is the
   min sum of squares: water-filling one expert at a time over its replicas,
   Gauss-Seidel, vectorised per colour). ``uniform_flows`` is EPLB's even
   split.
2. ``split_tokens``: exact integer tokens per (source device, slot), each
   source sending an expert's tokens to the replicas in the flows'
   proportions (so a hot expert's capacity-bucket cells shrink evenly),
   optionally preferring replicas on the source's own node, returned as the
   Placement's slot_share (count / tokens), which reproduces those counts
   exactly under the placement's split rule, plus per-slot loads and the
   largest cell.

Shape letters: L layers, D devices, N nodes, G devices per node, E experts,
S slots, R replicas of one expert (padded), K experts of one colour
(padded), Q replicated slots (padded).
"""
from __future__ import annotations

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner.topology import Topology


def replica_table(slot_expert_LS: np.ndarray, num_experts: int):
  """Replica counts [L, E] and each expert's slots in slot order [L, E, R].

  Unused table entries are -1.
  """
  se = np.asarray(slot_expert_LS, np.int64)
  num_layers, num_slots = se.shape
  flat_LS = np.arange(num_layers)[:, None] * num_experts + se
  count_LE = np.bincount(flat_LS.ravel(), minlength=num_layers * num_experts
                         ).reshape(num_layers, num_experts)
  order_LS = np.argsort(flat_LS, axis=1, kind='stable')
  se_sorted = np.take_along_axis(se, order_LS, axis=1)
  start_LE = np.cumsum(count_LE, axis=1) - count_LE
  rank_LS = np.arange(num_slots)[None] - np.take_along_axis(start_LE, se_sorted, 1)
  table_LER = np.full((num_layers, num_experts, max(int(count_LE.max()), 1)), -1,
                      np.int64)
  table_LER[np.arange(num_layers)[:, None], se_sorted, rank_LS] = order_LS
  return count_LE, table_LER


# Height of padding bins: far above any load, so water never reaches them,
# yet finite, so sums stay exact for the real bins sorted before them.
_WALL = 1e18
_INV_K = 1.0 / np.arange(1, 4097)  # Read-only: 1/k for water levels.
_INV_K.flags.writeable = False


def second_copies(slot_expert_LS, slots_per_device: int) -> np.ndarray:
  """Slots holding an expert that an earlier slot of the same device holds
  too: bool [L, S]."""
  se = np.asarray(slot_expert_LS)
  num_layers, num_slots = se.shape
  se_LDs = se.reshape(num_layers, -1, slots_per_device)
  earlier = np.tril(np.ones((slots_per_device,) * 2, bool), k=-1)
  dup = ((se_LDs[..., :, None] == se_LDs[..., None, :]) & earlier).any(-1)
  return dup.reshape(num_layers, num_slots)


def fill_level(base_NR: np.ndarray, amount_N: np.ndarray,
               valid_NR: np.ndarray | None = None) -> np.ndarray:
  """Water level after pouring `amount` onto bins of height `base`: [N].

  The level is min over k of (amount + sum of the k lowest bases) / k: the
  candidates fall while the next base is below them and rise after.
  Invalid bins (or bases >= _WALL) take no water; with no valid bin the
  level is >= _WALL.
  """
  b_NR = base_NR if valid_NR is None else np.where(valid_NR, base_NR, _WALL)
  cum_NR = np.cumsum(np.sort(b_NR, axis=-1), axis=-1)
  cum_NR += amount_N[..., None]
  r = b_NR.shape[-1]
  cum_NR *= _INV_K[:r] if r <= len(_INV_K) else 1.0 / np.arange(1, r + 1)
  return cum_NR.min(axis=-1)


def water_fill(base_NR: np.ndarray, amount_N: np.ndarray,
               valid_NR: np.ndarray | None = None) -> np.ndarray:
  """Pours `amount` onto bins of height `base`, lowest first: x [N, R].

  This is the exact minimiser of the max (and of the sum of squares) of
  base + x over one expert's replicas, given everything else fixed.
  """
  b_NR = base_NR if valid_NR is None else np.where(valid_NR, base_NR, _WALL)
  return np.maximum(fill_level(b_NR, amount_N)[..., None] - b_NR, 0.0)


def uniform_flows(slot_expert_LS: np.ndarray, w_LE: np.ndarray,
                  slots_per_device: int | None = None) -> np.ndarray:
  """EPLB's split: each replica gets an equal part of its expert's load.

  With slots_per_device, a slot holding an expert an earlier slot of its
  device holds (`second_copies`: a packing's filler, where a replica found
  no device) gets none and is not counted: a device computes an expert
  once, and the copy is not the replica EPLB meant to place.
  """
  se = np.asarray(slot_expert_LS)
  keep_LS = (np.ones(se.shape, bool) if slots_per_device is None
             else ~second_copies(se, slots_per_device))
  count_LE = np.zeros((se.shape[0], w_LE.shape[1]), np.float64)
  np.add.at(count_LE, (np.arange(se.shape[0])[:, None], se), keep_LS)
  return np.where(keep_LS,
                  np.take_along_axis(np.asarray(w_LE, np.float64), se, 1)
                  / np.maximum(np.take_along_axis(count_LE, se, 1), 1.0),
                  0.0)


def device_totals(x_LS: np.ndarray, topo: Topology) -> np.ndarray:
  """Per-device sums of per-slot values: [L, D]."""
  return x_LS.reshape(x_LS.shape[0], topo.num_devices, -1).sum(axis=2)


class FlowGraph:
  """A placement's replica structure, prepared for repeated balancing.

  Holds each expert's replica slots and one micro-step's expert loads. For
  Gauss-Seidel sweeps the replicated experts are coloured so that experts of
  one colour share no device: their water-fills are independent, so a sweep
  runs one vectorised update per colour instead of one per expert. The
  colouring depends only on the placement and is reused (``with_loads``)
  while the placement stays.
  """

  def __init__(self, slot_expert_LS, w_LE, topo: Topology):
    # A copy: callers keep editing their placement after building a graph.
    se = np.array(slot_expert_LS, np.int64)
    self.topo = topo
    self.slot_expert_LS = se
    self.w_LE = np.asarray(w_LE, np.float64)
    self.num_layers, self.num_slots = se.shape
    num_experts = self.w_LE.shape[1]
    self.count_LE, table_LER = replica_table(se, num_experts)
    valid_LER = table_LER >= 0
    # A second copy on the same device adds nothing; it gets no flow.
    dup_LS = second_copies(se, topo.slots_per_device)
    if dup_LS.any():
      lk = np.arange(self.num_layers)[:, None, None]
      valid_LER &= ~dup_LS[lk, np.maximum(table_LER, 0)]
    self.valid_LER = valid_LER
    self.table_LER = table_LER
    self._colour_LE = None  # Colour per expert (-1: single); on demand.
    self._tables = None  # Per colour (fx, fy, (layer, expert), ok); on demand.
    self._amounts = None  # Per colour, the loads to pour [L, K].

  def with_loads(self, w_LE) -> 'FlowGraph':
    """The same placement with another micro-step's loads."""
    other = object.__new__(FlowGraph)
    other.__dict__.update(self.__dict__)
    other.w_LE = np.asarray(w_LE, np.float64)
    other._amounts = None
    return other

  def _colour(self, layers):
    """Colour of each replicated expert of the given layers, -1 for the
    rest: [len(layers), E].

    Greedy colouring, vectorised over layers. Each colour is a maximal set
    of experts with pairwise distinct devices, grown in a few passes: an
    expert joins when all its devices are still free in this colour and it
    outranks (heaviest first) every other candidate on them.
    """
    topo, s = self.topo, self.topo.slots_per_device
    se, w_LE = self.slot_expert_LS[layers], self.w_LE[layers]
    num_layers, num_experts = w_LE.shape
    lk = np.arange(num_layers)[:, None]
    slot_ok_LS = ~second_copies(se, s)
    left_LE = self.valid_LER[layers].sum(axis=2) >= 2
    rank_LE = np.argsort(np.argsort(-w_LE, axis=1, kind='stable'), axis=1)
    prio_LE = num_experts - rank_LE
    colour_LE = np.full((num_layers, num_experts), -1, np.int64)
    flat_LS = (lk * num_experts + se).ravel()

    def per_expert_any(flag_LS):
      return np.bincount(flat_LS, weights=flag_LS.ravel(),
                         minlength=num_layers * num_experts
                         ).reshape(num_layers, num_experts) > 0

    c = 0
    while left_LE.any():
      used_LD = np.zeros((num_layers, topo.num_devices), bool)
      cand_LE = left_LE.copy()
      while cand_LE.any():
        p_LS = np.where(slot_ok_LS, np.where(cand_LE, prio_LE, 0)[lk, se], 0)
        top_LD = p_LS.reshape(num_layers, topo.num_devices, s).max(axis=2)
        lose_LS = slot_ok_LS & (p_LS < np.repeat(top_LD, s, 1))
        pick_LE = cand_LE & ~per_expert_any(lose_LS)
        colour_LE[pick_LE] = c
        left_LE &= ~pick_LE
        picked_LS = slot_ok_LS & pick_LE[lk, se]
        used_LD |= picked_LS.reshape(num_layers, topo.num_devices, s).any(2)
        # Candidates touching a device this colour now uses drop out.
        blocked_LS = slot_ok_LS & np.repeat(used_LD, s, 1)
        cand_LE &= ~pick_LE & ~per_expert_any(blocked_LS)
      c += 1
    return colour_LE

  def colour_like(self, other: 'FlowGraph', changed_L) -> None:
    """Takes `other`'s colours for the layers whose placement is unchanged
    (colouring is the costly part of a graph) and colours the others."""
    if other._colour_LE is None:
      return
    colour_LE = other._colour_LE.copy()
    changed = np.flatnonzero(changed_L)
    if len(changed):
      colour_LE[changed] = self._colour(changed)
    self._colour_LE = colour_LE

  def _colour_tables(self):
    """Per colour: flat indices of its replicas into x [L, S+1] and y
    [L, D+1] (the extra column absorbs padding), trimmed to the colour's
    size and widest expert, and the (layer, expert) each row pours."""
    if self._colour_LE is None:
      self._colour_LE = self._colour(np.arange(self.num_layers))
    colour_LE = self._colour_LE
    topo = self.topo
    num_layers, num_slots = self.num_layers, self.num_slots
    num_experts = colour_LE.shape[1]
    num_colours = int(colour_LE.max()) + 1
    if num_colours == 0:
      return []
    lk = np.arange(num_layers)[:, None]
    # Experts sorted by colour: colour c's experts are a run of the row.
    key_LE = np.where(colour_LE >= 0, colour_LE, num_colours)
    order_LE = np.argsort(key_LE * num_experts + np.arange(num_experts), axis=1)
    col_sorted = key_LE[lk, order_LE]
    valid_LER = self.valid_LER[lk, order_LE]
    # Valid replicas first, so trimming drops only padding.
    rorder = np.argsort(~valid_LER, axis=2, kind='stable')
    valid_LER = np.take_along_axis(valid_LER, rorder, 2)
    slot_LER = np.take_along_axis(self.table_LER[lk, order_LE], rorder, 2)
    slot_LER = np.where(valid_LER, slot_LER, num_slots)
    dev_LER = np.where(valid_LER, slot_LER // topo.slots_per_device,
                       topo.num_devices)
    fx_LER = lk[..., None] * (num_slots + 1) + slot_LER
    fy_LER = lk[..., None] * (topo.num_devices + 1) + dev_LER
    width_LE = valid_LER.sum(axis=2)
    count_LC = np.stack([(colour_LE == c).sum(axis=1)
                         for c in range(num_colours)], axis=1)
    start_LC = np.cumsum(count_LC, axis=1) - count_LC
    tables = []
    for c in range(num_colours):
      k = max(int(count_LC[:, c].max()), 1)
      pos_LK = np.minimum(start_LC[:, c:c + 1] + np.arange(k), num_experts - 1)
      ok_LK = col_sorted[lk, pos_LK] == c
      r = max(int(np.where(ok_LK, width_LE[lk, pos_LK], 0).max()), 1)
      spare_x = lk[..., None] * (num_slots + 1) + num_slots
      spare_y = lk[..., None] * (topo.num_devices + 1) + topo.num_devices
      fx = np.where(ok_LK[..., None], fx_LER[lk, pos_LK, :r], spare_x)
      fy = np.where(ok_LK[..., None], fy_LER[lk, pos_LK, :r], spare_y)
      e_LK = order_LE[lk, pos_LK]
      tables.append((fx, fy, (np.broadcast_to(lk, e_LK.shape), e_LK), ok_LK))
    return tables

  def initial_flows(self, frac_LS=None):
    """Flows from fractions of each expert's load (default: even split)."""
    w_LE = self.w_LE
    li = np.arange(self.num_layers)[:, None, None]
    n_valid_LE = np.maximum(self.valid_LER.sum(axis=2), 1)
    if frac_LS is None:
      f_LER = self.valid_LER / n_valid_LE[..., None]
    else:
      f_LER = np.where(self.valid_LER,
                       frac_LS[li, np.maximum(self.table_LER, 0)], 0.0)
      tot_LE = f_LER.sum(axis=2)
      f_LER = np.where(tot_LE[..., None] > 0,
                       f_LER / np.maximum(tot_LE, 1e-300)[..., None],
                       self.valid_LER / n_valid_LE[..., None])
    x_LS = np.zeros((self.num_layers, self.num_slots + 1))
    x_LS[li, np.where(self.valid_LER, self.table_LER, self.num_slots)] = (
        f_LER * w_LE[..., None])
    return x_LS[:, :-1]

  def _prepare(self):
    """Builds the colour tables and the loads they pour, once."""
    if self._tables is None:
      self._tables = self._colour_tables()
    if self._amounts is None:
      self._amounts = [np.where(ok_LK, self.w_LE[lk_e], 0.0)
                       for _, _, lk_e, ok_LK in self._tables]

  def sweep(self, x_LS, sweeps=1, skip_LE=None, layers=None):
    """Gauss-Seidel sweeps of per-expert water-fills; returns (x_LS, y_LD).

    Experts flagged in `skip_LE` (bool [L, E]) keep their flows: they are
    the ones whose replicas changed since this graph was built, so their
    rows here are stale (see `refill`). With `layers`, only those layers
    are swept (the others keep their flows).
    """
    self._prepare()
    tables = self._tables
    if skip_LE is not None and skip_LE.any():
      tables = []
      num_layers = self.num_layers
      spare_x = (np.arange(num_layers) * (self.num_slots + 1) + self.num_slots)
      spare_y = (np.arange(num_layers) * (self.topo.num_devices + 1)
                 + self.topo.num_devices)
      for fx, fy, lk_e, ok_LK in self._tables:
        stale_LK = skip_LE[lk_e] & ok_LK
        if stale_LK.any():
          # Stale rows pour nothing onto a walled spare device.
          fx = np.where(stale_LK[..., None], spare_x[:, None, None], fx)
          fy = np.where(stale_LK[..., None], spare_y[:, None, None], fy)
        tables.append((fx, fy, lk_e, ok_LK))
    amounts = self._amounts
    if layers is not None:
      tables = [(fx[layers], fy[layers], None, None)
                for fx, fy, _, _ in tables]
      amounts = [a[layers] for a in amounts]
    num_layers = self.num_layers
    x_LX = np.concatenate([x_LS, np.zeros((num_layers, 1))], axis=1)
    # The spare device is a wall: padding entries never take water.
    y_LY = np.concatenate([device_totals(x_LS, self.topo),
                           np.full((num_layers, 1), _WALL)], axis=1)
    x_flat, y_flat = x_LX.reshape(-1), y_LY.reshape(-1)
    for _ in range(sweeps):
      for (fx, fy, _, _), amount_LK in zip(tables, amounts):
        base_LKR = y_flat[fy] - x_flat[fx]
        new_LKR = water_fill(base_LKR, amount_LK)
        # Devices within a colour are distinct, so the writes cannot collide
        # except on the spare device, which stays a wall (nothing pours).
        x_flat[fx] = new_LKR
        base_LKR += new_LKR
        y_flat[fy] = base_LKR
    return x_LX[:, :-1], device_totals(x_LX[:, :-1], self.topo)

  def remote_sweep(self, x_LS, local_LS, cap_L, sweeps=2, iters=16):
    """Gauss-Seidel sweeps that cut each device's rows from other nodes,
    no device computing more than `cap_L`; returns x_LS.

    A replica takes the first `local_LS` of its flow from its own node's
    sources (`split_tokens` fills replicas on the source's node first), the
    rest from other nodes. For one expert, everything else fixed, its load
    is spread to minimise the highest remote intake among its devices: a
    replica takes up to its local share at no remote cost, then its device's
    remote intake rises one for one, and it never passes its device's room
    under the cap (`iters` bisection steps on the level). An expert keeps
    its flows where none of its replicas takes rows from other nodes, or
    where the cap leaves too little room in all.
    """
    self._prepare()
    topo, num_layers = self.topo, self.num_layers
    pad = lambda a, v: np.concatenate([a, np.full((num_layers, 1), v)], 1)
    x_flat = pad(x_LS, 0.0).reshape(-1)
    l_flat = pad(np.asarray(local_LS, np.float64), 0.0).reshape(-1)
    y_flat = pad(device_totals(x_LS, topo), _WALL).reshape(-1)
    r_flat = pad(device_totals(np.maximum(x_LS - local_LS, 0.0), topo),
                 0.0).reshape(-1)
    cap_L11 = np.asarray(cap_L, np.float64)[:, None, None]
    for _ in range(sweeps):
      for (fx, fy, _, ok_LK), amount_LK in zip(self._tables, self._amounts):
        x_old = x_flat[fx]
        own_r = np.maximum(x_old - l_flat[fx], 0.0)
        base_r = r_flat[fy] - own_r
        base_y = y_flat[fy] - x_old
        room = np.maximum(cap_L11 - base_y, 0.0)
        move_LK = (ok_LK & (room.sum(axis=2) >= amount_LK)
                   & (x_old > l_flat[fx] + 1e-9).any(axis=2))
        if not move_LK.any():
          continue
        lo = np.where(room > 0, base_r, np.inf).min(axis=2)
        hi = np.where(room > 0, base_r, -np.inf).max(axis=2) + amount_LK + 1
        lo = np.where(move_LK, lo, 0.0)
        hi = np.where(move_LK, hi, 1.0)
        for _ in range(iters):
          mid = 0.5 * (lo + hi)
          take = np.minimum(room, l_flat[fx] + np.maximum(
              mid[..., None] - base_r, 0.0)).sum(axis=2)
          over = take > amount_LK
          hi = np.where(over, mid, hi)
          lo = np.where(over, lo, mid)
        new = np.minimum(room, l_flat[fx] + np.maximum(hi[..., None] - base_r,
                                                       0.0))
        new *= (amount_LK / np.maximum(new.sum(axis=2), 1e-300))[..., None]
        new = np.where(move_LK[..., None], new, x_old)
        # Devices of one colour are distinct (padding writes the spare).
        x_flat[fx] = new
        y_flat[fy] = base_y + new
        r_flat[fy] = base_r + np.maximum(new - l_flat[fx], 0.0)
    return x_flat.reshape(num_layers, -1)[:, :-1]

  def refill(self, x_LS, layer_N, expert_N):
    """Water-fills the listed (layer, expert) pairs over their replicas, all
    at once against the same device loads, then recomputes the loads.

    Used after a round of moves, where only the moved experts changed;
    pairs sharing a device may overshoot a little, which later sweeps fix.
    """
    topo = self.topo
    if not len(layer_N):
      return x_LS, device_totals(x_LS, topo)
    y_LD = device_totals(x_LS, topo)
    valid_NR = self.valid_LER[layer_N, expert_N]
    # Padding points at a spare slot, so the write-back cannot collide.
    slot_NR = np.where(valid_NR, self.table_LER[layer_N, expert_N],
                       self.num_slots)
    x_LX = np.concatenate([x_LS, np.zeros((self.num_layers, 1))], axis=1)
    y_LY = np.concatenate([y_LD, np.zeros((self.num_layers, 1))], axis=1)
    dev_NR = np.minimum(slot_NR // topo.slots_per_device, topo.num_devices)
    own_NR = x_LX[layer_N[:, None], slot_NR]
    base_NR = y_LY[layer_N[:, None], dev_NR] - own_NR
    x_LX[layer_N[:, None], slot_NR] = water_fill(
        base_NR, self.w_LE[layer_N, expert_N], valid_NR)
    x_LS = x_LX[:, :-1]
    return x_LS, device_totals(x_LS, topo)


def balanced_flows(slot_expert_LS, w_LE, topo: Topology, frac_LS=None,
                   sweeps=3):
  """Per-slot flows that level device loads: (x_LS, y_LD)."""
  graph = FlowGraph(slot_expert_LS, w_LE, topo)
  return graph.sweep(graph.initial_flows(frac_LS), sweeps)


def node_demand(loads_LDE, topo: Topology) -> np.ndarray:
  """Tokens per layer, source node and expert: [L, N, E]."""
  loads_LDE = np.asarray(loads_LDE)
  num_layers, _, num_experts = loads_LDE.shape
  return loads_LDE.reshape(num_layers, topo.num_nodes, topo.devices_per_node,
                           num_experts).sum(axis=2)


def node_aware_flows(slot_expert_LS, x_LS, loads_LDE, topo: Topology,
                     remote_weight: float, slack: float = 0.1, sweeps=2):
  """Flows that take fewer rows across nodes where that pays: (x_LS, kept
  bool [L]: the layers that keep `x_LS`).

  Once all-to-alls cross nodes, a row a device receives from another node
  costs `remote_weight` rows of compute (the slow link, every pass), so
  compute balance alone leaves the all-to-all to the device whose replicas
  serve other nodes most. `FlowGraph.remote_sweep` re-spreads each
  replicated expert towards the replicas its own node's sources can fill
  (each replica's local share: its node's demand for the expert over the
  replicas there), no device above (1 + slack) x the busiest device's
  load. A layer takes the new flows only where they lower busiest compute
  + remote_weight x busiest remote intake (both counted as
  `split_tokens` will fill them, local first).
  """
  se = np.asarray(slot_expert_LS, np.int64)
  loads_LDE = np.asarray(loads_LDE, np.float64)
  num_layers, _, num_experts = loads_LDE.shape
  graph = FlowGraph(se, loads_LDE.sum(axis=1), topo)
  node_S = topo.node_of_device()[topo.device_of_slot()]
  demand_LNE = node_demand(loads_LDE, topo)
  lk = np.arange(num_layers)[:, None]
  # Replicas of each expert per node (second copies on a device take none).
  counted_LS = ~second_copies(se, topo.slots_per_device)
  per_node = np.zeros((num_layers, topo.num_nodes, num_experts))
  np.add.at(per_node, (np.broadcast_to(lk, se.shape), node_S[None], se),
            counted_LS.astype(np.float64))
  local_LS = np.where(counted_LS, demand_LNE[lk, node_S[None], se]
                      / np.maximum(per_node[lk, node_S[None], se], 1.0), 0.0)
  y_LD = device_totals(x_LS, topo)
  new_LS = graph.remote_sweep(x_LS, local_LS, y_LD.max(axis=1) * (1 + slack),
                              sweeps)

  def score(x):
    remote_LD = device_totals(np.maximum(x - local_LS, 0.0), topo)
    return (device_totals(x, topo).max(axis=1)
            + remote_weight * remote_LD.max(axis=1))

  kept_L = score(new_LS) >= score(x_LS)
  return np.where(kept_L[:, None], x_LS, new_LS), kept_L


def first_replica(slot_expert_LS) -> np.ndarray:
  """Whether each slot is the first (in slot order) holding its expert."""
  se = np.asarray(slot_expert_LS, np.int64)
  num_slots = se.shape[1]
  order_LS = np.argsort(se * num_slots + np.arange(num_slots), axis=1)
  se_sorted = np.take_along_axis(se, order_LS, 1)
  first_sorted = np.ones_like(se_sorted, bool)
  first_sorted[:, 1:] = se_sorted[:, 1:] != se_sorted[:, :-1]
  first_LS = np.empty_like(first_sorted)
  np.put_along_axis(first_LS, order_LS, first_sorted, axis=1)
  return first_LS


def slot_major(loads_LDE) -> np.ndarray:
  """Loads as float32 [..., E, D], so that gathering an expert's sources is
  a contiguous row copy (exact: counts stay far below 2**24)."""
  return np.ascontiguousarray(np.swapaxes(np.asarray(loads_LDE), -1, -2),
                              dtype=np.float32)


def split_tokens(loads_LDE, slot_expert_LS, x_LS, topo: Topology,
                 prefer_local: bool = True, loads_LED=None):
  """Exact tokens per (source, slot) following per-slot flows, as shares.

  Every source splits its tokens for an expert across the replicas in the
  flows' proportions; with `prefer_local` and several nodes, a source first
  fills replicas on its own node (up to what they take in total), and only
  the rest crosses nodes. Counts are cumulative roundings in slot order, so
  per (l, d, e) they add up to the loads exactly.

  Args:
    loads_LED: `slot_major(loads_LDE)` if the caller has it already.
  Returns:
    slot_share [L, D, S] float32: count / tokens, which the placement's split
      rule turns back into the same counts (an idle (source, expert) sends
      its share to the expert's first slot, as in
      `placement.shares_from_slot_counts`).
    slot loads [L, S] int64: tokens each slot computes.
    max cell [L] int64: the largest (source, slot) count, which sets the
      smallest capacity bucket that drops nothing.
  """
  if loads_LED is None:
    loads_LED = slot_major(loads_LDE)
  se = np.asarray(slot_expert_LS, np.int64)
  num_layers, num_experts, num_devices = loads_LED.shape
  num_slots = se.shape[1]
  lk = np.arange(num_layers)[:, None]
  flat_LS = (lk * num_experts + se).ravel()
  count_LE = np.bincount(flat_LS, minlength=num_layers * num_experts
                         ).reshape(num_layers, num_experts)
  w_LE = loads_LED.sum(axis=2, dtype=np.float64)
  # An expert's only slot takes all its tokens (share 1); only replicated
  # experts' slots, Q of them, need the per-source arithmetic.
  multi_LS = count_LE[lk, se] >= 2
  slot_loads_LS = np.where(multi_LS, 0.0, w_LE[lk, se])
  share_LDS = np.ones((num_layers, num_devices, num_slots), np.float32)
  single_cell_L = np.where(count_LE == 1, loads_LED.max(axis=2), 0).max(axis=1)
  width = int(multi_LS.sum(axis=1).max())
  if width == 0:
    return (share_LDS, np.rint(slot_loads_LS).astype(np.int64),
            single_cell_L.astype(np.int64))
  # Replicated slots sorted by (expert, slot): each expert's replicas are
  # consecutive, in the slot order the split rule uses.
  key_LS = np.where(multi_LS, se * num_slots + np.arange(num_slots),
                    num_experts * num_slots)
  q_LQ = np.argsort(key_LS, axis=1)[:, :width]
  ok_LQ = multi_LS[lk, q_LQ]
  e_LQ = se[lk, q_LQ]
  first_LQ = np.ones_like(ok_LQ)
  first_LQ[:, 1:] = (e_LQ[:, 1:] != e_LQ[:, :-1]) | ~ok_LQ[:, 1:]
  last_LQ = np.ones_like(ok_LQ)
  last_LQ[:, :-1] = first_LQ[:, 1:]
  x_LQ = np.maximum(np.asarray(x_LS, np.float64)[lk, q_LQ], 0.0)
  x_LQ = np.where(ok_LQ, x_LQ, 0.0)
  xsum_LQ = _run_sums(x_LQ, first_LQ, last_LQ)
  f_LQ = np.where(xsum_LQ > 0, x_LQ / np.maximum(xsum_LQ, 1e-300), 0.0)
  if prefer_local and topo.num_nodes > 1:
    f_LQN = _node_local_fractions(loads_LED, w_LE, q_LQ, e_LQ, ok_LQ, f_LQ,
                                  first_LQ, last_LQ, topo)
    groups = (topo.num_nodes, topo.devices_per_node)
  else:
    f_LQN = f_LQ[..., None]
    groups = (1, num_devices)
  lo_LQN, hi_LQN = _cumulative_fractions(f_LQN, first_LQ, last_LQ)
  n_LQD = loads_LED[lk, e_LQ]
  # Sources grouped by node ([L, Q, N, G]) meet their node's fractions by
  # broadcasting; with one fraction row for all sources N = 1 broadcasts.
  # Padding rows (q beyond the replicated slots) are single-replica slots
  # with lo = 0, hi = 1: count = n and share 1, which is right for them.
  n_LQNG = n_LQD.reshape(num_layers, width, *groups)
  # Any rounding works as long as the counts telescope: shares are read back
  # from the counts, not from the fractions. In place: these are the
  # planner's largest arrays.
  upto = hi_LQN.astype(np.float32)[..., None] * n_LQNG
  np.rint(upto, out=upto)
  # lo of a slot is hi of the slot before it in its expert's run, so the
  # rounded cumulative counts are reused rather than recomputed.
  count = upto.copy()
  np.subtract(count[:, 1:], upto[:, :-1], out=count[:, 1:],
              where=~first_LQ[:, 1:, None, None])
  count_LQD = count.reshape(num_layers, width, num_devices)
  q_loads_LQ = count_LQD.sum(axis=2, dtype=np.float64)
  slot_loads_LS[lk, q_LQ] = q_loads_LQ
  # Shares on the grid of placement.SHARE_GRID: the cumulative fraction
  # through each slot (upto / n) in whole steps of 2^-24, a share the step
  # from the slot before (`placement.SHARE_GRID` says why). upto is n at
  # an expert's last slot, so its shares add up to exactly 1.
  # (In place, in float32: `placement.grid_steps`, as shares_from_slot_counts
  # makes them, so both give the same shares.)
  grid = placement_lib.grid_steps(
      upto.reshape(num_layers, width, num_devices), n_LQD)
  share_LQD = grid.copy()
  np.subtract(share_LQD[:, 1:], grid[:, :-1], out=share_LQD[:, 1:],
              where=~first_LQ[:, 1:, None])
  share_LQD *= np.float32(1.0 / placement_lib.SHARE_GRID)
  # A source with no tokens for the expert gives its share to the first slot.
  share_LQD += (n_LQD == 0) & first_LQ[..., None]
  share_LDS[lk[..., None], np.arange(num_devices), q_LQ[..., None]] = share_LQD
  max_cell_L = np.maximum(single_cell_L, count_LQD.max(axis=(1, 2)))
  return (share_LDS, np.rint(slot_loads_LS).astype(np.int64),
          max_cell_L.astype(np.int64))


def split_counts(loads_LDE, slot_expert_LS, x_LS, topo: Topology,
                 prefer_local: bool = True) -> np.ndarray:
  """Exact tokens per (source, slot) of `split_tokens`: int64 [L, D, S]."""
  share_LDS, _, _ = split_tokens(loads_LDE, slot_expert_LS, x_LS, topo,
                                 prefer_local)
  se = np.asarray(slot_expert_LS, np.int64)
  n_LDS = np.take_along_axis(np.asarray(loads_LDE), np.broadcast_to(
      se[:, None, :], share_LDS.shape), axis=2)
  return np.rint(share_LDS.astype(np.float64) * n_LDS).astype(np.int64)


def _run_starts(first_LQ):
  """Index of the first slot of each slot's expert run: [L, Q]."""
  pos = np.broadcast_to(np.arange(first_LQ.shape[1]), first_LQ.shape)
  return np.maximum.accumulate(np.where(first_LQ, pos, 0), axis=1)


def _run_sums(v_LQX, first_LQ, last_LQ):
  """Sum of v over each expert's run, broadcast back to its slots."""
  del last_LQ  # The runs are fully described by their first slots.
  num_layers, width = first_LQ.shape
  run_LQ = np.arange(num_layers)[:, None] * width + _run_starts(first_LQ)
  if v_LQX.ndim == 3:
    x = v_LQX.shape[2]
    idx = (run_LQ[..., None] * x + np.arange(x)).ravel()
    sums = np.bincount(idx, weights=v_LQX.ravel(),
                       minlength=num_layers * width * x)
    return sums[idx].reshape(v_LQX.shape)
  sums = np.bincount(run_LQ.ravel(), weights=v_LQX.ravel(),
                     minlength=num_layers * width)
  return sums[run_LQ]


def _cumulative_fractions(f_LQX, first_LQ, last_LQ):
  """Cumulative fractions over each expert's run of slots: (lo, hi), shaped
  like f [L, Q, X] (X: source nodes, or 1).

  hi of an expert's last slot is exactly 1 and lo of the next slot is the
  previous hi, so rounded counts telescope to the exact total.
  """
  lk = np.arange(first_LQ.shape[0])[:, None]
  start_LQ = _run_starts(first_LQ)
  cum = np.cumsum(f_LQX, axis=1)
  before = cum[lk, start_LQ] - f_LQX[lk, start_LQ]
  last = last_LQ[..., None] if f_LQX.ndim == 3 else last_LQ
  first = first_LQ[..., None] if f_LQX.ndim == 3 else first_LQ
  hi = np.where(last, 1.0, np.minimum(cum - before, 1.0))
  lo = np.zeros_like(hi)
  lo[:, 1:] = np.where(first[:, 1:], 0.0, hi[:, :-1])
  return lo, hi


def _node_local_fractions(loads_LED, w_LE, q_LQ, e_LQ, ok_LQ, f_LQ, first_LQ,
                          last_LQ, topo: Topology):
  """Per source node, fractions of an expert's tokens to each replicated
  slot q: [L, Q, N].

  Replica totals t (= f * load) stay as the flows set them; each node's
  sources first fill the replicas on their node (min of node supply and
  node demand), the remainder goes to the replicas with demand left, in
  proportion. Column sums equal t, row sums are 1.
  """
  num_layers, _, _ = loads_LED.shape
  n_nodes, g = topo.num_nodes, topo.devices_per_node
  lk = np.arange(num_layers)[:, None]
  supply_LQN = loads_LED[lk, e_LQ].reshape(*e_LQ.shape, n_nodes, g).sum(
      axis=3, dtype=np.float64)
  t_LQ = f_LQ * w_LE[lk, e_LQ]
  node_LQ = topo.node_of_device()[q_LQ // topo.slots_per_device]
  on_node_LQN = node_LQ[..., None] == np.arange(n_nodes)
  # Node demand of an expert: its replicas' totals on that node.
  demand_LQN = _run_sums(np.where(on_node_LQN, t_LQ[..., None], 0.0),
                         first_LQ, last_LQ)
  local_LQN = np.minimum(supply_LQN, demand_LQN)
  alpha_LQN = np.where(supply_LQN > 0,
                       local_LQN / np.maximum(supply_LQN, 1e-300), 1.0)
  # How much of slot q's total its own node's sources cover.
  demand_own = np.where(on_node_LQN, demand_LQN, 0.0).sum(axis=2)
  local_own = np.where(on_node_LQN, local_LQN, 0.0).sum(axis=2)
  keep_LQ = np.where(demand_own > 0, local_own / np.maximum(demand_own, 1e-300),
                     0.0)
  resid_LQ = t_LQ * (1.0 - keep_LQ)
  resid_tot = _run_sums(resid_LQ, first_LQ, last_LQ)
  resid_frac_LQ = np.where(resid_tot > 0, resid_LQ / np.maximum(resid_tot, 1e-300),
                           0.0)
  local_part = np.where(on_node_LQN & (demand_LQN > 0),
                        alpha_LQN * t_LQ[..., None]
                        / np.maximum(demand_LQN, 1e-300), 0.0)
  f_LQN = local_part + (1.0 - alpha_LQN) * resid_frac_LQ[..., None]
  return np.where(ok_LQ[..., None], f_LQN, 0.0)
