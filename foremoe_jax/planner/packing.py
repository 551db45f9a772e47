"""Hierarchical placement from a load matrix: steps 1-3 of docs/design.md §5.2.

Given expert loads per layer (a step's totals, a moving average of past
steps, or one micro-step's foresight) this module decides

1. ``replica_counts``: how many slots each expert gets (water-filling on
   load per replica, as EPLB does),
2. node packing: which node each replica goes to (largest replica first to
   the least-loaded node with room, spreading an expert's replicas over
   nodes so that sources find a replica on their own node),
3. device packing: which device of its node it goes to (same rule, never
   two copies of one expert on a device),

and ``align_to_current`` relabels the result's nodes and devices (which are
interchangeable) to keep as many experts where they already are as possible.
The EPLB baselines use ``hierarchical_placement`` as is; the ForeMoE planner
uses it for its step-level anchor. The token split (step 4) lives in
``split``, the transfer-aware refinement (step 5) in ``foremoe``.

Shape letters: L layers, E experts, N nodes, G devices per node, D devices,
S slots, I replica items (= S).
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from foremoe_jax.planner.topology import CostModel, Topology


def replica_counts(w_LE: np.ndarray, num_slots: int,
                   max_replicas: int) -> np.ndarray:
  """Replicas per expert minimising the max load per replica: int [L, E].

  Every expert gets at least one and at most `max_replicas`; the counts sum
  to `num_slots`. Same result as EPLB's greedy (give the next slot to the
  expert with the largest load per replica), found by bisection on the
  per-replica load and a short greedy top-up.
  """
  w_LE = np.asarray(w_LE, np.float64)
  num_layers, num_experts = w_LE.shape
  max_replicas = max(max_replicas, -(-num_slots // num_experts))
  if num_slots < num_experts:
    raise ValueError(f'{num_slots} slots < {num_experts} experts.')

  def counts(tau_L):
    r = np.ceil(w_LE / np.maximum(tau_L[:, None], 1e-300))
    return np.clip(r, 1, max_replicas).astype(np.int64)

  lo = np.zeros(num_layers)
  hi = np.maximum(w_LE.max(axis=1), 1.0)
  for _ in range(60):
    mid = 0.5 * (lo + hi)
    over = counts(mid).sum(axis=1) > num_slots
    lo = np.where(over, mid, lo)
    hi = np.where(over, hi, mid)
  r_LE = counts(hi)
  # The bisection lands at most a tie-group short of num_slots.
  left_L = num_slots - r_LE.sum(axis=1)
  lk = np.arange(num_layers)
  while (left_L > 0).any():
    per = np.where(r_LE < max_replicas, w_LE / r_LE, -1.0)
    e_L = np.argmax(per, axis=1)  # Ties: the lowest expert id.
    r_LE[lk, e_L] += (left_L > 0)
    left_L -= 1
  return r_LE


def _replica_items(r_LE, w_LE):
  """Replicas as items sorted by load per replica, heaviest first."""
  num_layers, num_experts = r_LE.shape
  r_max = int(r_LE.max())
  expert_LER = np.broadcast_to(np.arange(num_experts)[None, :, None],
                               (num_layers, num_experts, r_max))
  used_LER = np.arange(r_max)[None, None] < r_LE[..., None]
  unit_LE = w_LE / r_LE
  unit_LER = np.where(used_LER, unit_LE[..., None], -np.inf)
  # Ties broken by expert id, so the result is deterministic.
  key = unit_LER.reshape(num_layers, -1)
  order = np.lexsort((expert_LER.reshape(num_layers, -1), -key), axis=1)
  num_items = int(r_LE.sum(axis=1)[0])
  order = order[:, :num_items]
  return (np.take_along_axis(expert_LER.reshape(num_layers, -1), order, 1),
          np.take_along_axis(key, order, 1))


def _greedy_pack(expert_BI, unit_BI, num_bins, capacity, num_experts,
                 max_copies):
  """Largest-first packing of items into bins of `capacity` items each.

  Batched over B independent problems. An item goes to the least-loaded bin
  with room that holds fewer than `max_copies` of its expert, preferring
  bins that hold none (spreading replicas). Returns bin per item, [B, I].
  """
  num_b, num_items = expert_BI.shape
  load_BN = np.zeros((num_b, num_bins))
  fill_BN = np.zeros((num_b, num_bins), np.int64)
  held_BNE = np.zeros((num_b, num_bins, num_experts), np.int64)
  bin_BI = np.empty((num_b, num_items), np.int64)
  bk = np.arange(num_b)
  # A bin's tier (full, at max_copies of the expert, holding one) first,
  # then its load: tiers a step wider than any load can grow (twice all the
  # items' units) keep one float key lexicographic. (Steps of 1e30 swallowed
  # the load in float64: among bins of one tier the lowest index won, not
  # the least loaded.)
  step_B1 = 2.0 * np.maximum(unit_BI, 0.0).sum(axis=1, keepdims=True) + 1.0
  for i in range(num_items):
    e_B = expert_BI[:, i]
    held_BN = held_BNE[bk, :, e_B]
    cost_BN = load_BN + step_B1 * (
        np.where(fill_BN >= capacity, 4.0, 0.0)
        + np.where(held_BN >= max_copies, 2.0, 0.0)
        + np.where(held_BN > 0, 1.0, 0.0))
    b_B = np.argmin(cost_BN, axis=1)
    bin_BI[:, i] = b_B
    load_BN[bk, b_B] += np.maximum(unit_BI[:, i], 0.0)
    fill_BN[bk, b_B] += 1
    held_BNE[bk, b_B, e_B] += 1
  return bin_BI


def hierarchical_placement(w_LE: np.ndarray, topo: Topology) -> np.ndarray:
  """slot_expert [L, S] from loads [L, E]: replica counts, nodes, devices."""
  w_LE = np.asarray(w_LE, np.float64)
  num_layers, num_experts = w_LE.shape
  topo.check_experts(num_experts)
  n_nodes, g, s = topo.num_nodes, topo.devices_per_node, topo.slots_per_device
  r_LE = replica_counts(w_LE, topo.num_slots, topo.num_devices)
  expert_LI, unit_LI = _replica_items(r_LE, w_LE)
  if n_nodes > 1:
    # A node can use at most one copy per device.
    node_LI = _greedy_pack(expert_LI, unit_LI, n_nodes, g * s, num_experts,
                           max_copies=g)
  else:
    node_LI = np.zeros_like(expert_LI)
  # Items of each node, still heaviest first: [L * N, G * s].
  order = np.argsort(node_LI, axis=1, kind='stable')
  expert_BJ = np.take_along_axis(expert_LI, order, 1).reshape(
      num_layers * n_nodes, g * s)
  unit_BJ = np.take_along_axis(unit_LI, order, 1).reshape(
      num_layers * n_nodes, g * s)
  dev_BJ = _greedy_pack(expert_BJ, unit_BJ, g, s, num_experts, max_copies=1)
  # Slots of a device in item order (heaviest first).
  order = np.argsort(dev_BJ, axis=1, kind='stable')
  se_BJ = np.take_along_axis(expert_BJ, order, 1)
  return se_BJ.reshape(num_layers, topo.num_slots).astype(np.int32)


def home_anchored_placement(w_LE: np.ndarray, topo: Topology,
                            cost: CostModel | None = None,
                            max_rounds: int | None = None,
                            node_demand_LNE: np.ndarray | None = None,
                            inter_node_weight: float = 1.0) -> np.ndarray:
  """slot_expert [L, S] that keeps every expert on its home device.

  For a transfer engine that refills slots from the canonical experts each
  step, an expert away from home costs a copy every step, while a replica
  in a redundant slot costs one copy and relieves its home. So: replica
  counts as EPLB's (step 1), each expert's first copy in its home slot
  (home layout: expert e on device e // h), and the extra copies packed
  heaviest-first onto the least loaded device with a free redundant slot
  that does not hold the expert yet, preferring the home's node.
  Redundant slots left over hold a copy of their own device's first home
  expert (a local copy: no traffic, no tokens unless the split sends some).

  The engine fills the replicas from their homes and returns their
  gradients in cyclic-shift rounds (foremoe_jax/transfer/schedule.py): a
  layer needs, per shift k, as many rounds as the busiest sender has edges
  of shift k, and each round costs one expert's transfer however many
  devices use it. With `cost`, a device's key adds the rounds its replica
  would add (fill and return, priced in tokens by `cost`), so near-equal
  devices go to a shift already in use; with `max_rounds`, a replica that
  would push the fill or the return past that many rounds is not placed
  (the engine's static budget), so the placement always fits it.

  With `node_demand_LNE` (token-assignments per layer, node and expert:
  where the tokens come from, which the foresight knows) and several
  nodes, a device's key also counts `inter_node_weight` times the rows
  its slots would take from other nodes. Sources send to a replica on
  their own node first (`split.split_tokens`), so a copy takes from its
  node's demand not yet served there and the rest of its share
  (w / replicas) crosses nodes; the inter-node link is the all-to-all's
  slow tier, and compute rows alone leave it unbalanced (a device of
  single-copy experts takes 7/8 of its rows from other nodes on 8 nodes).
  """
  w_LE = np.asarray(w_LE, np.float64)
  num_layers, num_experts = w_LE.shape
  topo.check_experts(num_experts)
  d, s = topo.num_devices, topo.slots_per_device
  if num_experts % d:
    raise ValueError(f'num_experts = {num_experts} not divisible by {d}.')
  h = num_experts // d
  if s < h:
    raise ValueError(f'{s} slots per device < {h} home experts.')
  r_LE = replica_counts(w_LE, topo.num_slots, d)
  node_of = topo.node_of_device()
  home_D = np.arange(num_experts) // h
  # The layers are independent: they run side by side, the i-th replica of
  # every layer in one vectorised pass (a Python loop over replicas, not
  # over layers x replicas: 30,000 iterations at DeepSeek-V3-like, EP 256).
  # Each layer sees exactly the arithmetic of a loop over its own replicas.
  lk = np.arange(num_layers)
  dk = np.arange(d)
  per_LE = w_LE / r_LE
  load_LD = np.stack([np.bincount(home_D, per_LE[l], minlength=d)
                      for l in range(num_layers)])
  free_LD = np.full((num_layers, d), s - h)
  held_LDE = np.zeros((num_layers, d, num_experts), bool)
  held_LDE[:, home_D, np.arange(num_experts)] = True
  se_LDs = np.repeat((dk * h)[None, :, None], s, axis=2)
  se_LDs = np.repeat(se_LDs, num_layers, axis=0)
  se_LDs[:, :, :h] = np.arange(num_experts).reshape(d, h)
  # Fill edges home -> replica and return edges replica -> home, per
  # (sender, shift), and the rounds each shift needs (its busiest sender).
  fill_LDK = np.zeros((num_layers, d, d), np.int64)
  ret_LDK = np.zeros((num_layers, d, d), np.int64)
  fill_LK = np.zeros((num_layers, d), np.int64)
  ret_LK = np.zeros((num_layers, d), np.int64)
  # Each layer's extra copies, heaviest first (stable), padded with -1.
  extras = [np.repeat(np.arange(num_experts), r_LE[l] - 1)
            for l in range(num_layers)]
  width = max((len(x) for x in extras), default=0)
  order_LI = np.full((num_layers, width), -1)
  for l, x in enumerate(extras):
    order_LI[l, :len(x)] = x[np.argsort(-per_LE[l, x], kind='stable')]
  track = (node_demand_LNE is not None and topo.num_nodes > 1
           and inter_node_weight > 0)
  if track:
    dem_LNE = np.asarray(node_demand_LNE, np.float64)
    if dem_LNE.shape != (num_layers, topo.num_nodes, num_experts):
      raise ValueError(f'node_demand_LNE is {dem_LNE.shape}, expected '
                       f'{(num_layers, topo.num_nodes, num_experts)}.')
    # Each home copy serves its own node's demand first; served_LNE is what
    # the copies placed so far take on their nodes, remote_LD the rows a
    # device's copies take from other nodes.
    node_E = node_of[home_D]
    served_LE = np.minimum(per_LE, dem_LNE[:, node_E, np.arange(num_experts)])
    served_LNE = np.zeros_like(dem_LNE)
    served_LNE[:, node_E, np.arange(num_experts)] = served_LE
    remote_LD = np.stack([np.bincount(home_D, per_LE[l] - served_LE[l],
                                      minlength=d) for l in range(num_layers)])
  for i in range(width):
    e_L = order_LI[:, i]
    act_L = e_L >= 0
    e_L = np.maximum(e_L, 0)
    ok_LD = (free_LD > 0) & ~held_LDE[lk, :, e_L] & act_L[:, None]
    home_L = home_D[e_L]
    k_LD = (dk[None, :] - home_L[:, None]) % d
    back_LD = -k_LD % d
    add_fill_LD = (fill_LDK[lk[:, None], home_L[:, None], k_LD] + 1
                   > fill_LK[lk[:, None], k_LD])
    add_ret_LD = (ret_LDK[lk[:, None], dk[None, :], back_LD] + 1
                  > ret_LK[lk[:, None], back_LD])
    if max_rounds is not None:
      ok_LD &= ((fill_LK.sum(axis=1)[:, None] + add_fill_LD <= max_rounds)
                & (ret_LK.sum(axis=1)[:, None] + add_ret_LD <= max_rounds))
    go_L = ok_LD.any(axis=1)
    if not go_L.any():
      continue
    # Least loaded; ties (and near-ties) on the home's node first.
    inter_LD = node_of[None, :] != node_of[home_L][:, None]
    per_L = per_LE[lk, e_L]
    key_LD = load_LD + np.where(inter_LD, (1e-9 * (1 + per_L))[:, None], 0.0)
    if cost is not None:
      key_LD = key_LD + (add_fill_LD * cost.move_tokens(inter_LD)
                         + add_ret_LD * cost.return_tokens(inter_LD))
    if track:
      cell_LD = (lk[:, None] * topo.num_nodes + node_of[None, :]) * num_experts
      cell_LD = cell_LD + e_L[:, None]
      local_LD = np.clip(dem_LNE.ravel()[cell_LD] - served_LNE.ravel()[cell_LD],
                         0.0, per_L[:, None])
      key_LD = key_LD + inter_node_weight * (remote_LD + per_L[:, None]
                                             - local_LD)
    dev_L = np.argmin(np.where(ok_LD, key_LD, np.inf), axis=1)
    l, e, home, dev = lk[go_L], e_L[go_L], home_L[go_L], dev_L[go_L]
    k = (dev - home) % d
    fill_LDK[l, home, k] += 1
    fill_LK[l, k] = np.maximum(fill_LK[l, k], fill_LDK[l, home, k])
    ret_LDK[l, dev, -k % d] += 1
    ret_LK[l, -k % d] = np.maximum(ret_LK[l, -k % d], ret_LDK[l, dev, -k % d])
    se_LDs[l, dev, s - free_LD[l, dev]] = e
    free_LD[l, dev] -= 1
    held_LDE[l, dev, e] = True
    load_LD[l, dev] += per_L[go_L]
    if track:
      local = local_LD[l, dev]
      served_LNE[l, node_of[dev], e] += local
      remote_LD[l, dev] += per_L[go_L] - local
  return se_LDs.reshape(num_layers, -1).astype(np.int32)


def anchored_transfer_tokens(slot_expert_LS, num_experts: int, topo: Topology,
                             cost: CostModel, mode: str = 'exact'):
  """(fill [L], return [L]): what the engine spends each step to fill a
  home-anchored layout's replicas from their homes and to send their
  gradients home, in token-assignments per layer. Fills are priced as
  weight copies, returns as gradient sends (`CostModel.move_tokens`,
  `CostModel.return_tokens`).

  ``exact`` (`transfer.schedule`'s default): one ragged all-to-all each
  way, which lasts as long as its busiest device: per device the items it
  sends, or receives, to its own node over the intra-node link and to
  other nodes over the inter-node one, the two tiers side by side (as
  `CostModel.all_to_all_s`).

  ``rounds``: cyclic-shift rounds; a shift needs as many rounds as its
  busiest sender has edges, and a round costs one expert's transfer (at
  the inter-node rate when any of its edges crosses nodes) however many
  devices use it. Never less than ``exact``: a device's edges, summed over
  the shifts, are at most the rounds those shifts take.
  """
  if mode not in ('exact', 'rounds'):
    raise ValueError(f"mode must be 'exact' or 'rounds', got {mode!r}.")
  se = np.asarray(slot_expert_LS, np.int64)
  num_layers, d = se.shape[0], topo.num_devices
  dst_LS = np.broadcast_to(topo.device_of_slot(), se.shape)
  src_LS = se // (num_experts // d)  # The expert's home device.
  node = topo.node_of_device()
  l_N, j_N = np.nonzero(src_LS != dst_LS)
  src_N, dst_N = src_LS[l_N, j_N], dst_LS[l_N, j_N]
  inter_N = node[src_N] != node[dst_N]
  out = []
  for sender_N, receiver_N, price in ((src_N, dst_N, cost.move_tokens),
                                      (dst_N, src_N, cost.return_tokens)):
    if mode == 'exact':
      t_LD = np.zeros((num_layers, d))
      for dev_N in (sender_N, receiver_N):
        count_LDT = np.bincount((l_N * d + dev_N) * 2 + inter_N,
                                minlength=num_layers * d * 2).reshape(
                                    num_layers, d, 2)
        t_LD = np.maximum(t_LD, np.maximum(count_LDT[..., 0] * price(False),
                                           count_LDT[..., 1] * price(True)))
      out.append(t_LD.max(axis=1))
      continue
    shift_N = (receiver_N - sender_N) % d
    count_LCK = np.bincount((l_N * d + sender_N) * d + shift_N,
                            minlength=num_layers * d * d).reshape(
                                num_layers, d, d)
    cross_LK = np.zeros((num_layers, d), bool)
    np.logical_or.at(cross_LK, (l_N, shift_N), inter_N)
    out.append((count_LCK.max(axis=1)
                * np.where(cross_LK, price(True), price(False))).sum(axis=1))
  return out[0], out[1]


def device_sets(slot_expert_LS, topo: Topology) -> np.ndarray:
  """slot_expert viewed per device: [L, D, s]."""
  se = np.asarray(slot_expert_LS)
  return se.reshape(se.shape[0], topo.num_devices, topo.slots_per_device)


def _incoming(new_LDs, old_LDs, s):
  """Slots whose expert is new on their device (not there before, and not a
  second copy within the device): bool [L, D, s]."""
  present = (new_LDs[..., :, None] == old_LDs[..., None, :]).any(axis=-1)
  dup = ((new_LDs[..., :, None] == new_LDs[..., None, :])
         & np.tril(np.ones((s, s), bool), k=-1)).any(axis=-1)
  return ~present & ~dup


def new_copies(slot_expert_LS, prev_LS, topo: Topology) -> np.ndarray:
  """Experts newly copied into each device (absent there before): [L, D]."""
  return _incoming(device_sets(slot_expert_LS, topo),
                   device_sets(prev_LS, topo),
                   topo.slots_per_device).sum(axis=-1)


def new_copies_by_link(slot_expert_LS, prev_LS, topo: Topology):
  """(intra, inter) [L, D]: new copies with a source replica on the same
  node before, and those that must cross nodes."""
  new_LDs = device_sets(slot_expert_LS, topo)
  old_LDs = device_sets(prev_LS, topo)
  incoming = _incoming(new_LDs, old_LDs, topo.slots_per_device)
  num_layers = new_LDs.shape[0]
  old_LNx = np.asarray(prev_LS).reshape(num_layers, topo.num_nodes, -1)
  old_LDx = old_LNx[:, topo.node_of_device()]
  on_node = (new_LDs[..., :, None] == old_LDx[:, :, None, :]).any(axis=-1)
  return ((incoming & on_node).sum(axis=-1),
          (incoming & ~on_node).sum(axis=-1))


def align_slots(slot_expert_LS, prev_LS, topo: Topology) -> np.ndarray:
  """Reorders each device's slots so kept experts keep their slot index."""
  new_LDs = device_sets(slot_expert_LS, topo)
  old_LDs = device_sets(prev_LS, topo)
  keep_LDs = (old_LDs[..., :, None] == new_LDs[..., None, :]).any(axis=-1)
  incoming = ~(new_LDs[..., :, None] == old_LDs[..., None, :]).any(axis=-1)
  n_in = incoming.sum(axis=-1)
  # Free positions and incoming experts are paired in order.
  pos_order = np.argsort(keep_LDs, axis=-1, kind='stable')
  item_order = np.argsort(~incoming, axis=-1, kind='stable')
  out = old_LDs.copy()
  vals = np.take_along_axis(new_LDs, item_order, -1)
  take = np.arange(topo.slots_per_device) < n_in[..., None]
  cur = np.take_along_axis(out, pos_order, -1)
  np.put_along_axis(out, pos_order, np.where(take, vals, cur), -1)
  # Duplicates inside a device break the pairing; keep those devices as given.
  ok = (np.sort(out, -1) == np.sort(new_LDs, -1)).all(-1)
  out = np.where(ok[..., None], out, new_LDs)
  return out.reshape(slot_expert_LS.shape).astype(np.int32)


def device_overlap(a_LS, b_LS, topo: Topology) -> np.ndarray:
  """Experts shared by device i of `a` and device j of `b`: int [L, D, D]."""
  from foremoe_jax.planner.split import replica_table  # Avoids an import cycle.
  a_LS, b_LS = np.asarray(a_LS, np.int64), np.asarray(b_LS, np.int64)
  num_layers, num_slots = a_LS.shape
  num_devices = topo.num_devices
  num_experts = int(max(a_LS.max(), b_LS.max())) + 1
  _, table_LER = replica_table(b_LS, num_experts)
  lk = np.arange(num_layers)[:, None]
  # Each slot of `a` paired with every device of `b` holding its expert.
  b_LSR = table_LER[lk, a_LS]
  dev_a_S = topo.device_of_slot()
  idx = ((lk[..., None] * num_devices + dev_a_S[None, :, None]) * num_devices
         + np.maximum(b_LSR, 0) // topo.slots_per_device)
  return np.bincount(idx[b_LSR >= 0], minlength=num_layers * num_devices ** 2
                     ).reshape(num_layers, num_devices, num_devices)


def align_to_current(slot_expert_LS, current_LS, topo: Topology) -> np.ndarray:
  """Relabels nodes, then devices within nodes, to maximise experts kept.

  Any permutation of nodes (and of devices within a node) is as balanced as
  the original, so choosing the one that overlaps the current placement most
  (a linear assignment on overlap counts) removes moves for free.
  """
  new_LDs = device_sets(slot_expert_LS, topo)
  num_layers = new_LDs.shape[0]
  n_nodes, g = topo.num_nodes, topo.devices_per_node
  overlap_LDD = device_overlap(slot_expert_LS, current_LS, topo)
  out = np.empty_like(new_LDs)
  for l in range(num_layers):
    overlap_DD = overlap_LDD[l]  # [new device, current device]
    if n_nodes > 1:
      node_NN = overlap_DD.reshape(n_nodes, g, n_nodes, g).sum(axis=(1, 3))
      _, node_to = linear_sum_assignment(-node_NN)
    else:
      node_to = np.zeros(1, np.int64)
    for nu in range(n_nodes):
      src = np.arange(nu * g, (nu + 1) * g)
      dst = np.arange(node_to[nu] * g, (node_to[nu] + 1) * g)
      _, col = linear_sum_assignment(-overlap_DD[np.ix_(src, dst)])
      out[l, dst[col]] = new_LDs[l, src]
  return align_slots(out.reshape(num_layers, -1), current_LS, topo)


def shed_placement(w_LE: np.ndarray, prev_LS, topo: Topology,
                   degree: int | None = None, grid: int = 8,
                   passes: int = 3) -> np.ndarray:
  """slot_expert [L, S] of one micro-step that keeps every expert home and
  fills the redundant slots so the busiest device sheds the most.

  For a target level T, hot devices (home load above T) shed their excess
  through replicas of their own experts on devices below T, one replica per
  redundant slot: the hottest device first, the expert share that covers
  its excess best (the smallest one that covers it, else the largest) to
  the receiver whose room fits it best (the least room that takes it all,
  else the most room), a receiver that held the expert before first. T is
  the lowest level at which every excess finds room, searched per layer
  (`grid` levels at once, `passes` times: the bracket shrinks `grid`-fold
  each pass). Best fit matters: a receiver takes one replica per slot, so
  spending a roomy device on a small share wastes it.

  Redundant slots left without a replica keep what `prev_LS` held there
  (no copy, and no gradient to send home), and kept replicas keep their
  slot. New replicas take the free slots in slot order.

  degree: the transfer engine's bound between micro-steps
  (`ForeMoEConfig.microstep_degree`): each device then takes at most this
  many new copies, each home sends at most this many (every new copy is
  charged to its expert's home, which always holds it) and gets at most
  this many gradients of evicted replicas back. The transition from
  `prev_LS` then fits the budget when the schedule sources each copy from
  its home; it may pick another holder, so the planner fits each
  transition afterwards (`transfer.schedule.fit_layers`, reverting the
  least useful new slots) before it splits and costs it (None: no
  bound).
  """
  w_LE = np.asarray(w_LE, np.float64)
  prev_LS = np.asarray(prev_LS, np.int64)
  num_layers, num_experts = w_LE.shape
  d, s = topo.num_devices, topo.slots_per_device
  h = num_experts // d
  r = s - h
  if r < 1 or num_experts % d:
    return prev_LS.astype(np.int32)
  y_LD = w_LE.reshape(num_layers, d, h).sum(axis=2)
  prev_LDr = prev_LS.reshape(num_layers, d, s)[:, :, h:]
  node_D = topo.node_of_device() if topo.num_nodes > 1 else None
  lo_L = y_LD.mean(axis=1)
  hi_L = y_LD.max(axis=1)
  steps = np.arange(1, grid + 1) / grid
  for _ in range(passes):
    t_LB = lo_L[:, None] + (hi_L - lo_L)[:, None] * steps[None]
    ok_LB, _, _ = _shed(w_LE, y_LD, prev_LDr, t_LB, r, degree, node_D)
    first_B = np.argmax(ok_LB, axis=1)  # The top level always fits.
    new_hi = t_LB[np.arange(num_layers), first_B]
    lo_L = np.where(first_B > 0, t_LB[np.arange(num_layers),
                                      np.maximum(first_B - 1, 0)], lo_L)
    hi_L = new_hi
  _, rep_e_LK, rep_q_LK = _shed(w_LE, y_LD, prev_LDr, hi_L[:, None], r,
                                degree, node_D)
  out_LDs = prev_LS.reshape(num_layers, d, s).copy()
  out_LDs[:, :, :h] = np.arange(num_experts).reshape(d, h)
  rep_e_LK, rep_q_LK = rep_e_LK[:, 0], rep_q_LK[:, 0]
  for l in range(num_layers):
    taken = {}
    for e, q in zip(rep_e_LK[l], rep_q_LK[l]):
      if e >= 0:
        taken.setdefault(int(q), []).append(int(e))
    for q, experts in taken.items():
      slots = out_LDs[l, q, h:]
      held = slots.tolist()
      want = set(experts)
      new = [e for e in experts if e not in held]
      free = [j for j, e in enumerate(held) if e not in want][:len(new)]
      slots[free] = new[:len(free)]
  return out_LDs.reshape(num_layers, -1).astype(np.int32)


def _shed(w_LE, y_LD, prev_LDr, t_LB, r, degree=None, node_D=None):
  """`shed_placement`'s greedy at levels t [L, B]: (fits [L, B], replica
  experts [L, B, K], their receivers [L, B, K]; -1 where unused).

  Each (layer, level) is a row, run side by side; a row leaves the loop
  once it reaches its level or cannot, so late rounds touch few rows."""
  num_layers, d = y_LD.shape
  h = w_LE.shape[1] // d
  num_levels = t_LB.shape[1]
  n_rows = num_layers * num_levels
  layer_N = np.repeat(np.arange(num_layers), num_levels)
  cap = np.iinfo(np.int64).max // 4 if degree is None else int(degree)
  eps_N = 1e-6 * np.maximum(y_LD.mean(axis=1), 1.0)[layer_N]
  ex_ND = y_LD[layer_N] - t_LB.reshape(-1)[:, None]
  part_NDh = w_LE.reshape(num_layers, d, h)[layer_N].astype(np.float64)
  free_ND = np.full((n_rows, d), r)
  # Budget counters: new copies into, sends from and returns to a device.
  copies_ND = np.zeros((n_rows, d), np.int64)
  sends_ND = np.zeros_like(copies_ND)
  returns_ND = np.zeros_like(copies_ND)
  # The slot a new copy would evict next on each receiver (slot order),
  # and whose home gets that replica's gradient (-1: none, or itself).
  evict_home_LDr = np.where(prev_LDr // h != np.arange(d)[None, :, None],
                            prev_LDr // h, -1)
  next_ND = np.zeros((n_rows, d), np.int64)
  reused_NDr = np.zeros((n_rows, d, r), bool)
  dead_N = np.zeros(n_rows, bool)
  rep_e = np.full((n_rows, d * r), -1)
  rep_q = np.full((n_rows, d * r), -1)
  dk = np.arange(d)
  live = np.arange(n_rows)
  for k in range(d * r):
    ex = ex_ND[live]
    hot = np.argmax(ex, axis=1)
    a = np.arange(len(live))
    need = ex[a, hot]
    eps = eps_N[live]
    act = (need > eps) & ~dead_N[live]
    if not act.all():
      live, ex, hot, need, eps = (x[act] for x in (live, ex, hot, need, eps))
      a = np.arange(len(live))
    if not len(live):
      break
    lay = layer_N[live]
    p_h = part_NDh[live, hot]
    covers = p_h >= need[:, None]
    i = np.where(covers.any(axis=1),
                 np.argmin(np.where(covers, p_h, np.inf), axis=1),
                 np.argmax(p_h, axis=1))
    share = np.minimum(p_h[a, i], need)
    e = hot * h + i
    room = -ex
    free = free_ND[live]
    had_Dr = (prev_LDr[lay] == e[:, None, None]) & ~reused_NDr[live]
    had = had_Dr.any(axis=2)
    # A new copy: the receiver takes one more, the home sends one more,
    # and the replica it evicts sends its gradient home.
    nxt = np.minimum(next_ND[live], r - 1)
    ev_home = evict_home_LDr[lay[:, None], dk[None, :], nxt]
    ev_ret = np.where(ev_home >= 0, np.take_along_axis(
        returns_ND[live], np.maximum(ev_home, 0), axis=1), 0)
    new_ok = ((copies_ND[live] < cap) & (sends_ND[live, hot] < cap)[:, None]
              & ((ev_home < 0) | (ev_ret < cap)))
    has_room = room > eps[:, None]
    cand = (free > 0) & has_room & (had | new_ok)
    fits = cand & (room >= share[:, None])
    any_fit = fits.any(axis=1)
    pool = np.where(any_fit[:, None], fits, cand)
    if node_D is not None:
      # A copy within the home's node is the cheap one.
      near = pool & (node_D[None, :] == node_D[hot][:, None])
      pool = np.where(near.any(axis=1, keepdims=True), near, pool)
    pool = np.where((pool & had).any(axis=1, keepdims=True), pool & had, pool)
    q = np.where(any_fit, np.argmin(np.where(pool, room, np.inf), axis=1),
                 np.argmax(np.where(pool, room, -np.inf), axis=1))
    # Every device still above the level needs a replica of its own, each
    # in a free slot (on a device with room now or after it sheds): a
    # level with fewer free slots than devices to relieve is out of reach.
    short = (ex > eps[:, None]).sum(axis=1) > free.sum(axis=1)
    none = ~cand.any(axis=1) | short
    dead_N[live[none]] = True
    go = ~none
    n, a, q, hot, i, e = live[go], a[go], q[go], hot[go], i[go], e[go]
    # The receiver fills up to T with as much of the expert as there is:
    # shedding past the excess leaves room on the hot device, which a
    # hotter one's replica can then take (a chain the excess alone misses).
    took = np.minimum(p_h[a, i], room[a, q])
    part_NDh[n, hot, i] -= took
    ex_ND[n, hot] -= took
    ex_ND[n, q] += took
    free_ND[n, q] -= 1
    reuse = had[a, q]
    j = np.argmax(had_Dr[a, q], axis=1)
    reused_NDr[n[reuse], q[reuse], j[reuse]] = True
    fresh = ~reuse
    nn, qn = n[fresh], q[fresh]
    copies_ND[nn, qn] += 1
    sends_ND[nn, hot[fresh]] += 1
    eh = ev_home[a[fresh], qn]
    np.add.at(returns_ND, (nn[eh >= 0], eh[eh >= 0]), 1)
    next_ND[nn, qn] += 1
    rep_e[n, k] = e
    rep_q[n, k] = q
    live = n
  ok_N = ~dead_N & (ex_ND.max(axis=1) <= eps_N)
  shape = (num_layers, num_levels)
  return (ok_N.reshape(shape), rep_e.reshape(*shape, -1),
          rep_q.reshape(*shape, -1))
