"""Transfer schedule: the copies and shift rounds that move expert weights
between placements, and the rounds that return their gradients.

Sits between the planner (a StepPlan: one placement per micro-step) and the
device engine, which holds s slot buffers per device and layer and moves
weights in *rounds*: one ``ppermute`` per round whose permutation is a cyclic
shift by k (device d sends to (d + k) % D), so in a round every device sends
at most one item and receives at most one. The number of rounds is a static
budget (shapes must not change); the shift of each round is data.

Sources. Within an RL step every copy of an expert holds the same weights,
so a slot is filled locally when its device already has the expert (its
canonical expert, or a slot of the previous placement), else over a round
from the home's canonical copy or any device holding it before; the same
node is preferred over another, and among equals the source whose edge fits
a round already needed. Every send and local copy reads the buffers as they
were *before* the transition, never a slot written in it, so copies and
rounds may run in any order. An evicted slot's accumulated gradient goes
back to its expert's home (summed into the canonical gradient).

Two modes carry the remote copies (`TransferBudget.mode`):

* ``exact`` (the default): one ragged all-to-all per layer and transition
  with expert-sized chunks, so only the experts that move cross the wire.
  Device c sends its items packed by destination, and receiver d lays the
  sources out one after another, as the exact-count token dispatch does
  (foremoe_jax/model/dispatch_exact.py). A layer's "rounds" are then its
  degree: the most experts one device sends, or receives, in the
  transition. By Koenig's theorem that many matchings carry the edges;
  the collective runs them as one. The budget R bounds the degree. A
  device's buffers are sized by its role: a fill receives at most s
  experts (its slots) and sends at most R; a return sends at most s
  gradients (only slots hold replicas) and receives at most R.
  The flush returns every replica at once, so a hot expert's home would
  receive up to R float32 gradients in one collective (R = D by default:
  about 90 GB a device at DeepSeek-V3 width on 256 devices). Where R is
  large against s + h it runs as a binomial reduction tree instead
  (`flush_form`): per expert, its home and the devices holding replicas
  (ordered by node, the home's first) pass partial sums in ceil(log2(R +
  1)) stages, one ragged all-to-all each, in which a device sends at most
  s gradients and receives at most s + h. Every replica still crosses
  the wire once, and a hot home receives one gradient per stage instead
  of all of them at once. The step's first fill, from empty buffers, is
  the same problem reversed (a hot home would send R experts in one
  collective) and takes the same form: a binomial broadcast tree
  (`fill_form`, `_tree_fills`) in which a device sends at most s + h
  experts and receives at most s per stage.
* ``rounds``: cyclic-shift rounds, one ppermute each (the first engine,
  kept for comparison). An edge c -> d has shift k = (d - c) % D; a round
  holds edges of one shift, at most one per sender (hence per receiver),
  so a layer needs sum over k of max over c of (edges c -> c + k) rounds.
  Every device sends in every round it takes part in, so the wire carries
  D experts per round however few are useful.

The rounds a layer needs in ``rounds`` mode are never fewer than its degree
(each sender's edges, summed over shifts, are at most the sum of each
shift's busiest sender; likewise for receivers), so a plan that fits the
rounds budget fits the exact one.

Shape letters: M micro-steps, L layers, S slots (S = D * s, slot j on device
j // s), D devices, E experts (expert e's home is device e // h, h = E / D),
R rounds, K shifts (K = D; shift 0 is an idle round), B rows (one layer of
one transition each; batched), N fills or edges, P stages of a return (1
but for a flush's reduction tree). In ``exact`` mode R is a send or
receive buffer's width (`exchange_widths`) and [..., D, R] lists a
device's sends or receives in collective order.

A device's local list is [its slots 0..s-1, its canonical (home) experts
s..s+h-1]: fills' sources and local copies index it, and so do the
targets that returned gradients are added into (a slot only inside a
flush's reduction tree).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import plan as plan_lib
from foremoe_jax.planner import split
from foremoe_jax.planner.topology import CostModel, Topology


class BudgetExceeded(ValueError):
  """A transition needs more rounds than its static budget."""


MODES = ('exact', 'rounds')
# How an ``exact`` flush returns the replicas' gradients (`flush_form`),
# and the step's first fill from empty buffers sends them (`fill_form`):
# 'auto' picks by the buffers, 'tree' the reduction (broadcast) tree
# wherever the budget allows more than one stage (least memory), 'direct'
# one collective (fewest collectives).
FLUSH_FORMS = ('auto', 'tree', 'direct')


class TransferBudget(NamedTuple):
  """Static bounds of the transfer buffers. In ``exact`` mode a "round" is
  one expert each way per device (the degree bound); in ``rounds`` mode one
  cyclic-shift ppermute."""

  step_rounds: int  # Rounds for the fill (T_0) and the flush.
  microstep_rounds: int  # Rounds for each transition between micro-steps.
  mode: str = 'exact'
  flush: str = 'auto'  # The exact flush's and first fill's form
  #                     (FLUSH_FORMS).


def check_mode(mode: str) -> str:
  if mode not in MODES:
    raise ValueError(f'transfer mode must be one of {MODES}, got {mode!r}.')
  return mode


class Transition(NamedTuple):
  """One transition of all layers, as the arrays the device reads.

  A device's local source list is [previous slots 0..s-1, canonical home
  experts s..s+h-1]; sends and local copies index it.
  """

  local_src_LS: np.ndarray  # int32: local source copied into the slot; -1 none
  shift_LR: np.ndarray  # int32: fill round's shift 1..D-1; 0 idle
  send_LRD: np.ndarray  # int32: local source device d sends; 0 if nothing
  recv_LRD: np.ndarray  # int32: local slot the receiver writes; -1 discard
  evict_LS: np.ndarray  # bool: slot's gradient is returned, then zeroed
  ret_local_LS: np.ndarray  # int32: local index (s + home index) added
  #                           into on the slot's own device when it is the
  #                           home; -1 otherwise
  ret_shift_LR: np.ndarray  # int32: return round's shift; 0 idle
  ret_send_LRD: np.ndarray  # int32: local slot whose gradient d sends
  ret_recv_LRD: np.ndarray  # int32: local index (s + home index) added
  #                           into; -1 discard
  remote_fills_L: np.ndarray  # int64: fills that cross devices
  local_fills_L: np.ndarray  # int64
  rounds_used_L: np.ndarray  # int64: fill rounds used (<= R)
  ret_rounds_used_L: np.ndarray  # int64: return rounds used (<= R)


class ExactTransition(NamedTuple):
  """One transition of all layers in ``exact`` mode: the fills as ragged
  all-to-alls in P stages (P = 1 but for a first fill's broadcast tree),
  and the gradient returns likewise (P = 1 but for a flush's reduction
  tree).

  In fill stage p, device c's sends, in order, are send_LPDR[l, p, c, :n]
  (local sources, as in Transition), n = count_LPDD[l, p, c].sum(),
  grouped by destination in ascending order; device d writes its q-th
  received expert into local slot recv_LPDR[l, p, d, q], the sources laid
  out in ascending order. A stage's sources are the buffers as the stages
  before it left them. With one stage, the local copies run first and
  every source is read as it was before the transition; in a broadcast
  tree they run after the stages (a second copy of an expert on one
  device is copied from the first). The returns run the same way: stage
  p's sends read the slots' gradients with everything added into them
  before it.
  """

  local_src_LS: np.ndarray  # int32: local source copied into the slot; -1 none
  send_LPDR: np.ndarray  # int32: local source of the r-th item sent in
  #                        stage p; 0 none
  count_LPDD: np.ndarray  # int32 [L, P, src, dst]: experts src sends dst
  recv_LPDR: np.ndarray  # int32: local slot the r-th item received in
  #                        stage p fills; -1 none
  evict_LS: np.ndarray  # bool: slot's gradient is returned, then zeroed
  ret_local_LS: np.ndarray  # int32: local index the slot's gradient is
  #                           added into on its own device, before any
  #                           stage (s + home index when the device is its
  #                           home; in a flush tree, a duplicate copy's
  #                           first slot); -1 otherwise
  ret_send_LPDR: np.ndarray  # int32: local slot of the r-th gradient sent
  #                            in stage p (its sum so far)
  ret_count_LPDD: np.ndarray  # int32 [L, P, src, dst]: gradients src sends
  #                             dst in stage p
  ret_recv_LPDR: np.ndarray  # int32: local index the r-th gradient received
  #                            in stage p is added into; -1 none
  remote_fills_L: np.ndarray  # int64: fills that cross devices
  local_fills_L: np.ndarray  # int64
  rounds_used_L: np.ndarray  # int64: fill degree as one collective (<= R)
  ret_rounds_used_L: np.ndarray  # int64: return degree as one collective
  #                                (<= R: what the budget bounds)


class StepTransfer(NamedTuple):
  """Every transition of one RL step."""

  fill: Transition  # T_0, from empty buffers (or from the slots the
  #                   recompute filled: `build_step_transfer(start_LS=)`);
  #                   R = step_rounds
  steps: Transition  # [M, ...]: entry m moves P_m -> P_{m+1}; the last is a
  #                    no-op. R = microstep_rounds
  flush: Transition  # returns every slot's gradient; R = step_rounds
  budget: TransferBudget | None = None  # what it was built under

  def remote_fills_M(self) -> np.ndarray:
    """Remote fills before micro-step m (m = 0: the fill), all layers: [M]."""
    return np.concatenate([[self.fill.remote_fills_L.sum()],
                           self.steps.remote_fills_L[:-1].sum(axis=1)])


def _homes(num_experts: int, topo: Topology) -> int:
  if num_experts % topo.num_devices:
    raise ValueError(f'num_experts = {num_experts} is not divisible by '
                     f'num_devices = {topo.num_devices}.')
  return num_experts // topo.num_devices


def _fill_edges(prev_BS, next_BS, num_experts, topo: Topology,
                mode: str = 'exact'):
  """Source of every slot to fill: (local_src_BS, edges b, src, src index,
  dst, dst local slot [N]). -1 in prev / next means empty / nothing."""
  num_devices, s = topo.num_devices, topo.slots_per_device
  h = _homes(num_experts, topo)
  num_rows, num_slots = next_BS.shape
  if num_slots != topo.num_slots:
    raise ValueError(f'{num_slots} slots per layer, topology has '
                     f'{topo.num_slots}.')
  fill_BS = (next_BS >= 0) & (next_BS != prev_BS)
  b_F, j_F = np.nonzero(fill_BS)
  e_F, d_F = next_BS[b_F, j_F], j_F // s
  local_F = np.where(e_F // h == d_F, s + e_F % h, -1)
  has_prev = bool((prev_BS >= 0).any())
  if has_prev:
    here_Fs = prev_BS.reshape(num_rows, num_devices, s)[b_F, d_F] == (
        e_F[:, None])
    local_F = np.where(local_F < 0, np.where(here_Fs.any(1), here_Fs.argmax(1),
                                             -1), local_F)
  local_BS = np.full(next_BS.shape, -1, np.int64)
  local_BS[b_F, j_F] = local_F
  remote = local_F < 0
  b_N, e_N, d_N, j_N = b_F[remote], e_F[remote], d_F[remote], j_F[remote]
  num = len(b_N)
  if not has_prev or not num:  # The home's canonical copy is the only source.
    return local_BS, (b_N, e_N // h, s + e_N % h, d_N, j_N % s)
  # Candidate sources per device: previous slot index + 1 (0: none), then
  # the home's canonical copy.
  rows = np.unique(b_N)
  row_of_B = np.zeros(num_rows, np.int64)
  row_of_B[rows] = np.arange(len(rows))
  held_BED = np.zeros((len(rows), num_experts + 1, num_devices), np.int16)
  held_BED[np.arange(len(rows))[:, None], prev_BS[rows],
           topo.device_of_slot()] = np.arange(num_slots) % s + 1
  idx_ND = held_BED[row_of_B[b_N], e_N]
  idx_ND[np.arange(num), e_N // h] = s + e_N % h + 1
  cand_ND = idx_ND > 0
  if topo.num_nodes > 1:
    node_D = topo.node_of_device()
    near_ND = node_D == node_D[d_N][:, None]
    cand_ND &= near_ND | ~(cand_ND & near_ND).any(1, keepdims=True)
  # Candidates as short lists (devices, -1 padded): few per fill.
  n_C, c_C = np.nonzero(cand_ND)
  count_N = cand_ND.sum(1)
  cand_NC = np.full((num, int(count_N.max())), -1, np.int64)
  cand_NC[n_C, np.arange(len(n_C)) - np.repeat(np.cumsum(count_N) - count_N,
                                               count_N)] = c_C
  src_N = cand_NC[:, 0]
  if (count_N > 1).any():
    choose = _share_rounds if mode == 'rounds' else _spread_sends
    src_N = choose(b_N, d_N, cand_NC, count_N > 1, num_devices)
  return local_BS, (b_N, src_N, idx_ND[np.arange(num), src_N] - 1, d_N, j_N % s)


def _share_rounds(b_N, d_N, cand_NC, flex_N, num_devices):
  """Greedy sources for fills with several candidates, after the forced
  ones: a source whose edge fits a round the row already needs (same shift,
  sender free there) costs nothing. Rows advance together, one fill each."""
  src_N = cand_NC[:, 0].copy()
  rows = np.unique(b_N[flex_N])
  row_of_B = np.full(int(b_N.max()) + 1, -1)
  row_of_B[rows] = np.arange(len(rows))
  f_N = row_of_B[b_N]
  # edges_FDK[f, c, k]: edges sender c has with shift k; depth_FK: their max.
  edges_FDK = np.zeros((len(rows), num_devices, num_devices), np.int64)
  fixed = ~flex_N & (f_N >= 0)
  np.add.at(edges_FDK, (f_N[fixed], src_N[fixed],
                        (d_N[fixed] - src_N[fixed]) % num_devices), 1)
  depth_FK = edges_FDK.max(axis=1)
  flex = np.flatnonzero(flex_N)  # Sorted by row (np.nonzero order).
  first = np.r_[True, b_N[flex][1:] != b_N[flex][:-1]]
  rank = np.arange(len(flex)) - np.maximum.accumulate(
      np.where(first, np.arange(len(flex)), 0))
  # Wave t takes every row's t-th fill: one contiguous run after sorting.
  flex = flex[np.argsort(rank, kind='stable')]
  ends = np.cumsum(np.bincount(rank))
  for start, end in zip(np.r_[0, ends[:-1]], ends):
    n = flex[start:end]
    f, c_nC = f_N[n][:, None], cand_NC[n]
    k_nC = (d_N[n][:, None] - c_nC) % num_devices
    fits = (c_nC >= 0) & (edges_FDK[f, c_nC, k_nC] < depth_FK[f, k_nC])
    pick = fits.argmax(1)  # Column 0 (a candidate) when none fits.
    at = np.arange(len(n))
    c, k, f = c_nC[at, pick], k_nC[at, pick], f[:, 0]
    edges_FDK[f, c, k] += 1
    depth_FK[f, k] = np.maximum(depth_FK[f, k], edges_FDK[f, c, k])
    src_N[n] = c
  return src_N


def _spread_sends(b_N, d_N, cand_NC, flex_N, num_devices):
  """Sources for fills with several candidates (``exact`` mode), after the
  forced ones, so the busiest sender, the degree that sizes the
  collective, is as low as any choice of candidates makes it: greedily
  the candidate that sends fewest so far in the row (rows advance
  together, one fill each, as `_share_rounds`), then, in a row whose
  busiest sender sends more than its busiest receiver receives,
  `_unload_busiest` (exact: a planner that found one assignment within a
  degree can count on the schedule to meet it)."""
  src_N = cand_NC[:, 0].copy()
  rows = np.unique(b_N[flex_N])
  row_of_B = np.full(int(b_N.max()) + 1, -1)
  row_of_B[rows] = np.arange(len(rows))
  f_N = row_of_B[b_N]
  sends_FD = np.zeros((len(rows), num_devices), np.int64)
  fixed = ~flex_N & (f_N >= 0)
  np.add.at(sends_FD, (f_N[fixed], src_N[fixed]), 1)
  forced_FD = sends_FD.copy()
  flex = np.flatnonzero(flex_N)
  first = np.r_[True, b_N[flex][1:] != b_N[flex][:-1]]
  rank = np.arange(len(flex)) - np.maximum.accumulate(
      np.where(first, np.arange(len(flex)), 0))
  flex = flex[np.argsort(rank, kind='stable')]
  ends = np.cumsum(np.bincount(rank))
  for start, end in zip(np.r_[0, ends[:-1]], ends):
    n = flex[start:end]
    f, c_nC = f_N[n], cand_NC[n]
    load_nC = np.where(c_nC >= 0, sends_FD[f[:, None], np.maximum(c_nC, 0)],
                       np.iinfo(np.int64).max)
    c = c_nC[np.arange(len(n)), load_nC.argmin(1)]  # Ties: the first.
    sends_FD[f, c] += 1
    src_N[n] = c
  # Rows the greedy may leave above the least busiest sender: it sends
  # more than the busiest receiver receives (else the degree does not
  # depend on it), more than its forced sends alone make it, and a
  # busiest sender has a fill with a choice.
  recv_FD = np.zeros_like(sends_FD)
  np.add.at(recv_FD, (f_N[f_N >= 0], d_N[f_N >= 0]), 1)
  top_F = sends_FD.max(1)
  by_row = np.flatnonzero(flex_N)  # Sorted by row, as b_N is.
  f_flex = f_N[by_row]
  at_top_F = np.zeros(len(rows), bool)
  at_top_F[f_flex[sends_FD[f_flex, src_N[by_row]] == top_F[f_flex]]] = True
  bounds = np.searchsorted(f_flex, np.arange(len(rows) + 1))
  for f in np.flatnonzero((top_F > recv_FD.max(1))
                          & (top_F > forced_FD.max(1)) & at_top_F):
    n = by_row[bounds[f]:bounds[f + 1]]
    src_N[n] = _unload_busiest(src_N[n], cand_NC[n], sends_FD[f])
  return src_N


def _unload_busiest(src_n, cand_nC, sends_D):
  """The sources of one row's flexible fills (n, candidates [n, C], -1
  padded) re-chosen so the most any device sends (sends_D: all of the
  row's sends, forced ones included) is the least possible.

  Repeatedly finds a path from a busiest sender to one sending at least 2
  fewer, each step a fill moving from its sender to another of its
  candidates, and shifts the fills along it. None left means the devices
  reachable from the busiest ones, whose fills can only be sent from
  among them, all send max or max - 1: no choice does better (the
  semi-matching optimality condition)."""
  src_n, sends_D = src_n.copy(), sends_D.copy()
  while True:
    top = sends_D.max()
    # Breadth-first over devices from the busiest: via[c] = the fill that
    # moved into c's sends (-1 for a root, -2 unvisited).
    via = np.full(len(sends_D), -2, np.int64)
    frontier = np.flatnonzero(sends_D == top)
    via[frontier] = -1
    end = -1
    while len(frontier) and end < 0:
      n = np.flatnonzero(np.isin(src_n, frontier))
      c_n, to_n = np.nonzero(cand_nC[n] >= 0)
      fill, to = n[c_n], cand_nC[n[c_n], to_n]
      new = via[to] == -2
      fill, to = fill[new], to[new]
      to, first = np.unique(to, return_index=True)
      via[to] = fill[first]
      low = to[sends_D[to] <= top - 2]
      if len(low):
        end = int(low[0])
      frontier = to
    if end < 0:
      return src_n
    c = end
    while via[c] >= 0:  # Walk back to the root, moving each fill on.
      fill = via[c]
      prev = src_n[fill]
      src_n[fill] = c
      sends_D[c] += 1
      sends_D[prev] -= 1
      c = prev


def _return_edges(prev_BS, next_BS, num_experts, topo: Topology):
  """Evicted slots, local returns, and edges (b, src, slot, home, local
  index s + home index): every replica straight to its home."""
  s, h = topo.slots_per_device, _homes(num_experts, topo)
  dev_S = topo.device_of_slot()
  evict_BS = (prev_BS >= 0) & (prev_BS != next_BS)
  e_BS = np.maximum(prev_BS, 0)
  at_home_BS = e_BS // h == dev_S
  ret_local_BS = np.where(evict_BS & at_home_BS, s + e_BS % h, -1)
  b_N, j_N = np.nonzero(evict_BS & ~at_home_BS)
  e_N = prev_BS[b_N, j_N]
  return evict_BS, ret_local_BS, (b_N, j_N // s, j_N % s, e_N // h,
                                  s + e_N % h)


def flush_form(num_rounds: int, num_experts: int, topo: Topology,
               form: str = 'auto') -> tuple[int, int, int]:
  """(stages, send width, receive width) of a flush's gradient returns in
  ``exact`` mode under a degree budget of `num_rounds`.

  Two forms. One collective straight home: a device sends at most
  min(s, R) and a home receives up to R. Or the binomial reduction tree
  (`_tree_returns`): each expert has at most R + 1 copies (the budget
  bounds its home's receives), so ceil(log2(R + 1)) stages, in each of
  which a device sends at most s gradients and receives at most one per
  slot and one per home expert, s + h. The flush sits in every
  micro-step's backward, switched off but still gathering its send
  buffers and zeroing its receive buffers, stage by stage; the tree is
  taken ('auto') when those buffers, summed over its stages, are fewer
  than the one collective's, so it never costs more there, and its live
  buffers (one stage's) are then smaller too. (At R = D = 256, s = 3,
  h = 1: 9 stages of 3 + 4 experts, 63 in all, against 3 + 256.) 'tree'
  takes it wherever R allows more than one stage, for a device whose
  memory is tighter than its time; 'direct' never."""
  if form not in FLUSH_FORMS:
    raise ValueError(f'flush form must be one of {FLUSH_FORMS}, got '
                     f'{form!r}.')
  s, h = topo.slots_per_device, _homes(num_experts, topo)
  star = (1, min(s, num_rounds), num_rounds)
  stages = int(np.ceil(np.log2(num_rounds + 1)))
  tree = (stages, s, s + h)
  if form == 'tree' and stages > 1:
    return tree
  if form == 'auto' and stages * (2 * s + h) < sum(star[1:]):
    return tree
  return star


def fill_form(num_rounds: int, num_experts: int, topo: Topology,
              form: str = 'auto') -> tuple[int, int, int]:
  """(stages, send width, receive width) of a first fill (from empty
  buffers) in ``exact`` mode: the flush's problem reversed, by the same
  rule (`flush_form`). One collective: a hot home sends up to R experts,
  a device receives at most min(s, R). The binomial broadcast tree
  (`_tree_fills`): ceil(log2(R + 1)) stages in which a device sends at
  most one expert per item it holds, s + h, and receives at most s."""
  stages, send_w, recv_w = flush_form(num_rounds, num_experts, topo, form)
  return stages, recv_w, send_w


def exchange_widths(num_rounds: int, topo: Topology) -> dict:
  """The buffers of one ``exact`` transition's fills and single-stage
  returns under a degree budget R: a device receives at most its s slots'
  fills and sends at most its s slots' gradients."""
  s = topo.slots_per_device
  return dict(send=num_rounds, recv=min(s, num_rounds),
              ret_send=min(s, num_rounds), ret_recv=num_rounds)


def _tree_nodes(local_BS, b_N, dev_N, slot_N, home_N, e_N, num_experts,
                topo: Topology):
  """The nodes of every (row, expert) tree, one per device away from the
  home: (local list [B, S], and b, device, slot, home, expert, node i
  (1..n) [N], sorted by tree then node). Nodes are ordered by node of
  the cluster, the home's own first, so most edges stay inside a node. A
  second copy on a device is no node: local_BS names the first copy's
  slot for it (the flush adds it there first, the fill copies it from
  there last)."""
  s = topo.slots_per_device
  node_D = topo.node_of_device()
  far_N = node_D[dev_N] != node_D[home_N]
  order = np.lexsort((slot_N, dev_N, node_D[dev_N], far_N, e_N, b_N))
  b_N, dev_N, slot_N, home_N, e_N = (x[order] for x in (b_N, dev_N, slot_N,
                                                         home_N, e_N))
  key_N = (b_N * num_experts + e_N) * topo.num_devices + dev_N
  rank_N = _rank_in_runs(key_N)
  dup = rank_N > 0
  local_BS = local_BS.copy()
  local_BS[b_N[dup], dev_N[dup] * s + slot_N[dup]] = slot_N[
      np.flatnonzero(dup) - rank_N[dup]]
  b_N, dev_N, slot_N, home_N, e_N = (x[~dup] for x in (b_N, dev_N, slot_N,
                                                        home_N, e_N))
  i_N = _rank_in_runs(b_N * num_experts + e_N) + 1
  return local_BS, b_N, dev_N, slot_N, home_N, e_N, i_N


def _tree_returns(ret_local_BS, edges, num_experts, topo: Topology):
  """The flush's returns (`_return_edges`: local returns, and one edge
  straight home per copy away from home) rearranged as reduction trees:
  (local returns, edges (b, src, slot, dst, dst local index), stage of
  each edge [N]).

  Per row and expert, the copies on devices other than its home are the
  nodes 1..n of a binomial tree rooted at the home (node 0; `_tree_nodes`):
  node i adds its sum into node i - lowbit(i) in stage log2(lowbit(i)),
  after every child (i + 2^q, q < that stage) has added into it. A second
  copy on the same device joins the first locally before the tree runs,
  so no device sends to itself.
  """
  s, h = topo.slots_per_device, _homes(num_experts, topo)
  b_N, dev_N, slot_N, home_N, idx_N = (np.asarray(x) for x in edges)
  ret_local_BS, b_N, dev_N, slot_N, home_N, e_N, i_N = _tree_nodes(
      ret_local_BS, b_N, dev_N, slot_N, home_N, home_N * h + idx_N - s,
      num_experts, topo)
  low_N = i_N & -i_N
  to_home = i_N == low_N
  p = np.maximum(np.arange(len(i_N)) - low_N, 0)  # Node i - low's edge.
  dst_N = np.where(to_home, home_N, dev_N[p])
  dst_idx_N = np.where(to_home, s + e_N % h, slot_N[p])
  stage_N = np.log2(low_N).astype(np.int64)
  return ret_local_BS, (b_N, dev_N, slot_N, dst_N, dst_idx_N), stage_N


def _tree_fills(local_BS, edges, num_experts, topo: Topology):
  """A first fill's edges (`_fill_edges` from empty buffers: every remote
  slot straight from its expert's home) rearranged as broadcast trees:
  (local copies [B, S], edges (b, src, src local index, dst, dst slot),
  stage of each edge [N]).

  The reduction tree of `_tree_returns` run backwards, on the same nodes
  (`_tree_nodes`): node i receives from node i - lowbit(i) in stage
  P - 1 - log2(lowbit(i)), P = ceil(log2(n + 1)): its parent has the
  expert by then (the parent's lowbit is larger, or it is the home) and
  sends it on from the slot it filled. A second slot of the same expert
  on one device is copied from the first after the stages."""
  s, h = topo.slots_per_device, _homes(num_experts, topo)
  b_N, home_N, idx_N, dev_N, slot_N = (np.asarray(x) for x in edges)
  local_BS, b_N, dev_N, slot_N, home_N, e_N, i_N = _tree_nodes(
      local_BS, b_N, dev_N, slot_N, home_N, home_N * h + idx_N - s,
      num_experts, topo)
  run_N = b_N * num_experts + e_N
  n_N = np.zeros(len(i_N), np.int64)
  if len(i_N):  # Nodes per tree, on each of its edges.
    last = np.r_[run_N[1:] != run_N[:-1], True]
    n_N = np.repeat(i_N[last], np.diff(np.r_[0, np.flatnonzero(last) + 1]))
  low_N = i_N & -i_N
  from_home = i_N == low_N
  p = np.maximum(np.arange(len(i_N)) - low_N, 0)  # Node i - low's edge.
  src_N = np.where(from_home, home_N, dev_N[p])
  src_idx_N = np.where(from_home, s + e_N % h, slot_N[p])
  depth_N = np.ceil(np.log2(n_N + 1)).astype(np.int64)
  stage_N = depth_N - 1 - np.log2(np.maximum(low_N, 1)).astype(np.int64)
  return local_BS, (b_N, src_N, src_idx_N, dev_N, slot_N), stage_N


def _pack_rounds(b_N, src_N, dst_N, num_rows, num_devices):
  """Round of each edge in its row, and rounds per (row, shift): [B, K].

  A sender's edges of shift k take successive rounds of shift k's block;
  a row's blocks follow one another in shift order.
  """
  k_N = (dst_N - src_N) % num_devices
  key_N = (b_N * num_devices + k_N) * num_devices + src_N
  order = np.argsort(key_N, kind='stable')
  pos = np.arange(len(key_N))
  first = np.r_[True, key_N[order][1:] != key_N[order][:-1]]
  rank_N = np.empty_like(pos)
  rank_N[order] = pos - np.maximum.accumulate(np.where(first, pos, 0))
  depth_BK = np.zeros(num_rows * num_devices, np.int64)
  np.maximum.at(depth_BK, b_N * num_devices + k_N, rank_N + 1)
  depth_BK = depth_BK.reshape(num_rows, num_devices)
  offset_BK = np.cumsum(depth_BK, axis=1) - depth_BK
  return offset_BK[b_N, k_N] + rank_N, depth_BK


def _degree(b_N, src_N, dst_N, num_rows, num_devices):
  """The most items one device sends or receives, per row: [B, 1] (the
  ``exact`` mode's rounds, shaped like `_pack_rounds`' depth)."""
  count = lambda x: np.bincount(b_N * num_devices + x,
                                minlength=num_rows * num_devices).reshape(
                                    num_rows, num_devices)
  return np.maximum(count(src_N).max(axis=1, initial=0),
                    count(dst_N).max(axis=1, initial=0))[:, None]


def _rank_in_runs(key_N):
  """Position of each entry within its run of equal (sorted) keys."""
  pos = np.arange(len(key_N))
  first = np.r_[True, key_N[1:] != key_N[:-1]] if len(key_N) else pos > 0
  return pos - np.maximum.accumulate(np.where(first, pos, 0))


def _exact_arrays(edges, num_rows, num_devices, send_width, recv_width):
  """send [B, D, Rs] (0 none), count [B, D, D], recv [B, D, Rr] (-1 none):
  the collective's order, sender-major then destination."""
  order = np.lexsort((edges[3], edges[1], edges[0]))
  b, src, src_idx, dst, dst_idx = (np.asarray(x)[order] for x in edges)
  d = num_devices
  count_BDD = np.bincount((b * d + src) * d + dst,
                          minlength=num_rows * d * d).reshape(num_rows, d, d)
  send_pos = _rank_in_runs(b * d + src)
  # A receiver lays its sources out in ascending order, each source's items
  # in its send order: an item's place is its rank among the row's items
  # to that receiver, sorted stably by source (ranked over the N edges, not
  # by a cumulative sum over the [B, D, D] counts).
  by_dst = np.lexsort((src, dst, b))  # Stable: a source keeps its order.
  recv_pos = np.empty(len(b), np.int64)
  recv_pos[by_dst] = _rank_in_runs((b * d + dst)[by_dst])
  send_BDR = np.zeros((num_rows, d, send_width), np.int32)
  recv_BDR = np.full((num_rows, d, recv_width), -1, np.int32)
  send_BDR[b, src, send_pos] = src_idx
  recv_BDR[b, dst, recv_pos] = dst_idx
  return send_BDR, count_BDD.astype(np.int32), recv_BDR


class _Moves(NamedTuple):
  """A transition of B rows before it becomes device arrays. Edges are
  tuples of [N] arrays (row, sender, sender's item, receiver, receiver's
  index), each with its round and the rounds per (row, shift)."""

  local_BS: np.ndarray
  fill: tuple
  fill_round_N: np.ndarray
  fill_depth_BK: np.ndarray
  evict_BS: np.ndarray
  ret_local_BS: np.ndarray
  ret: tuple
  ret_round_N: np.ndarray
  ret_depth_BK: np.ndarray


def _moves(prev_BS, next_BS, num_experts, topo, mode='exact') -> _Moves:
  """In ``exact`` mode the round fields are None and the depths [B, 1] hold
  the degree."""
  num_rows, d = len(next_BS), topo.num_devices
  local_BS, fill = _fill_edges(prev_BS, next_BS, num_experts, topo, mode)
  evict_BS, ret_local_BS, ret = _return_edges(prev_BS, next_BS, num_experts,
                                              topo)
  if check_mode(mode) == 'rounds':
    pack = lambda e: _pack_rounds(e[0], e[1], e[3], num_rows, d)
  else:
    pack = lambda e: (None, _degree(e[0], e[1], e[3], num_rows, d))
  return _Moves(local_BS, fill, *pack(fill), evict_BS, ret_local_BS, ret,
                *pack(ret))


def _rounds(prev_BS, next_BS, num_experts, topo, mode='exact'):
  """max(fill rounds, return rounds) per row: [B]."""
  mv = _moves(prev_BS, next_BS, num_experts, topo, mode)
  return np.maximum(mv.fill_depth_BK.sum(1), mv.ret_depth_BK.sum(1))


def _round_arrays(edges, round_N, depth_BK, num_rounds):
  """shift [B, R], send [B, R, D] (0 idle), recv [B, R, D] (-1 discard)."""
  b, src, src_idx, dst, dst_idx = edges
  num_rows, num_devices = depth_BK.shape
  shift_BR = np.zeros((num_rows, num_rounds), np.int32)
  rb, rk = np.nonzero(depth_BK)
  reps = depth_BK[rb, rk]
  start = np.cumsum(depth_BK, axis=1)[rb, rk] - reps
  within = np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
  shift_BR[np.repeat(rb, reps), np.repeat(start, reps) + within] = (
      np.repeat(rk, reps))
  send_BRD = np.zeros((num_rows, num_rounds, num_devices), np.int32)
  recv_BRD = np.full((num_rows, num_rounds, num_devices), -1, np.int32)
  send_BRD[b, round_N, src] = src_idx
  recv_BRD[b, round_N, dst] = dst_idx
  return shift_BR, send_BRD, recv_BRD


def _staged(mv: _Moves, empty_BS, num_experts, topo, num_rounds,
            form: str = 'auto', returns: bool = False):
  """``exact`` fills (or returns) as P stages: (local copies (returns)
  [B, S], send [B, P, D, Rs], count [B, P, D, D], recv [B, P, D, Rr]).
  empty_BS: the side that must be all empty for a tree, the previous
  placement of a fill (a first fill: the broadcast tree, `fill_form`) or
  the next one of a return (a flush: the reduction tree, `flush_form`),
  taken where the budget calls for it; anything else is one collective,
  straight from (to) the sources (homes)."""
  if returns:
    form_of, tree, local_BS, edges = (flush_form, _tree_returns,
                                      mv.ret_local_BS, mv.ret)
  else:
    form_of, tree, local_BS, edges = (fill_form, _tree_fills, mv.local_BS,
                                      mv.fill)
  stages, send_w, recv_w = form_of(num_rounds, num_experts, topo, form)
  if stages > 1 and (empty_BS < 0).all():
    local_BS, edges, stage_N = tree(local_BS, edges, num_experts, topo)
  else:
    w = exchange_widths(num_rounds, topo)
    pre = 'ret_' if returns else ''
    stages, send_w, recv_w = 1, w[pre + 'send'], w[pre + 'recv']
    stage_N = np.zeros(len(edges[0]), np.int64)
  parts = [_exact_arrays(tuple(np.asarray(x)[stage_N == p] for x in edges),
                         len(empty_BS), topo.num_devices, send_w, recv_w)
           for p in range(stages)]
  return (local_BS.astype(np.int32),) + tuple(
      np.stack([part[i] for part in parts], axis=1) for i in range(3))


def _schedule(prev_BS, next_BS, num_experts, topo, num_rounds, where,
              mode='exact', flush='auto'):
  """The (Exact)Transition of B rows; `where(b)` names row b in errors;
  flush: the form of a flush and of a fill from empty buffers
  (`flush_form`, `fill_form`)."""
  for name, x in (('from', prev_BS), ('to', next_BS)):
    # An id out of range would index another expert's rows (or fail deep
    # in the scheduler with an unrelated shape error).
    bad = np.argwhere((np.asarray(x) < -1) | (np.asarray(x) >= num_experts))
    if len(bad):
      b, j = bad[0]
      raise ValueError(f'{where(b)}: the placement moved {name} holds '
                       f'expert {np.asarray(x)[b, j]} in slot {j}; ids are '
                       f'0..{num_experts - 1} (-1: empty).')
  mv = _moves(prev_BS, next_BS, num_experts, topo, mode)
  fill_B, ret_B = mv.fill_depth_BK.sum(1), mv.ret_depth_BK.sum(1)
  over = np.flatnonzero(np.maximum(fill_B, ret_B) > num_rounds)
  if len(over):
    b = over[0]
    raise BudgetExceeded(
        f'{where(b)} needs {fill_B[b]} fill and {ret_B[b]} return rounds; '
        f'the budget is {num_rounds} ({len(over)} layer(s) over).')
  counts = (np.bincount(mv.fill[0], minlength=len(next_BS)).astype(np.int64),
            (mv.local_BS >= 0).sum(1).astype(np.int64), fill_B, ret_B)
  if mode == 'exact':
    fill_local, *fills = _staged(mv, prev_BS, num_experts, topo,
                                 num_rounds, flush)
    ret_local, *ret = _staged(mv, next_BS, num_experts, topo, num_rounds,
                              flush, returns=True)
    # As sent: in a broadcast tree a second copy on one device is local.
    counts = (fills[1].sum(axis=(1, 2, 3)).astype(np.int64),
              (fill_local >= 0).sum(1).astype(np.int64)) + counts[2:]
    return ExactTransition(fill_local, *fills, mv.evict_BS, ret_local, *ret,
                           *counts)
  return Transition(
      mv.local_BS.astype(np.int32),
      *_round_arrays(mv.fill, mv.fill_round_N, mv.fill_depth_BK, num_rounds),
      mv.evict_BS, mv.ret_local_BS.astype(np.int32),
      *_round_arrays(mv.ret, mv.ret_round_N, mv.ret_depth_BK, num_rounds),
      *counts)


def _rows(x_LS, like):
  """A placement as rows, -1 (empty / nothing) for None."""
  if x_LS is None:
    return np.full(np.shape(like), -1, np.int64)
  return np.asarray(x_LS, np.int64)


def transition(prev_LS, next_LS, num_experts: int, topo: Topology,
               num_rounds: int, mode: str = 'exact', flush: str = 'auto'):
  """prev_LS None: fill from empty buffers; next_LS None: flush (both in
  the form `flush`: `fill_form`, `flush_form`). A Transition (``rounds``)
  or an ExactTransition (``exact``)."""
  ref = next_LS if next_LS is not None else prev_LS
  return _schedule(_rows(prev_LS, ref), _rows(next_LS, ref), num_experts,
                   topo, num_rounds, lambda b: f'layer {b}', mode, flush)


def rounds_needed(prev_LS, next_LS, num_experts: int, topo: Topology,
                  mode: str = 'exact') -> np.ndarray:
  """max(fill rounds, return rounds) per layer: int [L] (``exact``: the
  degree)."""
  ref = next_LS if next_LS is not None else prev_LS
  return _rounds(_rows(prev_LS, ref), _rows(next_LS, ref), num_experts, topo,
                 mode)


def remote_returns(t) -> int:
  """Gradients a transition sends to another device (all layers)."""
  if isinstance(t, ExactTransition):
    return int(t.ret_count_LPDD.sum())
  return int((t.ret_recv_LRD >= 0).sum())


def wire_items(t, num_devices: int, emulated: bool = False) -> tuple:
  """(items on the wire, useful items) of a transition, fills and returns
  together, all layers (an item is one expert's weights or gradient).

  ``rounds``: every device sends in every round used. ``exact``: the
  ragged all-to-all carries exactly the remote items; `emulated` counts
  the CPU emulation instead (engine 'emulated': per shift k, as many
  rounds as its busiest pair (c, c + k) has items, every device sending
  in each).
  """
  if isinstance(t, ExactTransition):
    useful = int(t.count_LPDD.sum() + t.ret_count_LPDD.sum())
    if not emulated:
      return useful, useful
    d = np.arange(num_devices)
    wire = 0
    for count in (t.count_LPDD, t.ret_count_LPDD):
      c = count.reshape(-1, num_devices, num_devices)
      depth_BK = c[:, d[:, None], (d[:, None] + d[None, :]) % num_devices
                   ].max(axis=1)
      wire += int(depth_BK[:, 1:].sum()) * num_devices
    return wire, useful
  useful = int((t.recv_LRD >= 0).sum() + (t.ret_recv_LRD >= 0).sum())
  wire = int(((t.shift_LR != 0).sum() + (t.ret_shift_LR != 0).sum())
             * num_devices)
  return wire, useful


def shift_depths(count_DD) -> np.ndarray:
  """The CPU emulation's rounds of exact exchanges (`engine.
  _exchange_by_rounds`): for counts [..., src, dst], per cyclic shift k
  (device c to c + k) the items of its busiest pair, [..., K = D]; shift
  k then takes that many rounds (shift 0, the diagonal, none are sent)."""
  c = np.asarray(count_DD)
  num_devices = c.shape[-1]
  d_D = np.arange(num_devices)
  dst_DK = (d_D[:, None] + d_D[None, :]) % num_devices
  return np.take_along_axis(c, np.broadcast_to(dst_DK, c.shape),
                            axis=-1).max(axis=-2)


def step_wire_over_useful(st: StepTransfer, num_devices: int,
                          emulated: bool = False, extra=()) -> float:
  """Items on the wire over useful items for a whole step (fill, moves,
  flush, and the `extra` transitions, e.g. the recompute's prefill of the
  update's slots); 1.0 when nothing moves."""
  parts = [wire_items(t, num_devices, emulated)
           for t in (st.fill, st.steps, st.flush) + tuple(extra)]
  useful = sum(p[1] for p in parts)
  return sum(p[0] for p in parts) / useful if useful else 1.0


# A transition's return fields (both modes' names) with nothing returned.
_NO_RETURNS = (('evict_LS', False), ('ret_local_LS', -1), ('ret_send_LPDR', 0),
               ('ret_count_LPDD', 0), ('ret_recv_LPDR', -1), ('ret_shift_LR', 0),
               ('ret_send_LRD', 0), ('ret_recv_LRD', -1),
               ('ret_rounds_used_L', 0))


def without_returns(t):
  """The Transition's fills only: no slot evicts a gradient. A fill into
  slot buffers that hold weights but no gradient yet (the update's first
  transition from slots the recompute filled) has nothing to send home."""
  return t._replace(**{k: np.full_like(getattr(t, k), v)
                       for k, v in _NO_RETURNS if k in t._fields})


def build_step_transfer(slot_expert_MLS, num_experts: int, topo: Topology,
                        budget: TransferBudget, start_LS=None
                        ) -> StepTransfer:
  """All transitions of one RL step; BudgetExceeded if one does not fit.

  start_LS: the placement the slot buffers already hold when the update
  starts (the recompute's step-level placement, whose slots the recompute
  filled with the policy's weights: `rl.step.recompute_logps(prefill=)`);
  the fill then moves only the slots micro-step 0 changes. None: the fill
  starts from empty buffers.
  """
  se = np.asarray(slot_expert_MLS, np.int64)
  num_micro, num_layers, num_slots = se.shape
  nxt = np.concatenate([se[1:], se[-1:]])  # The last transition is a no-op.
  mode = check_mode(budget.mode)
  steps = _schedule(se.reshape(-1, num_slots), nxt.reshape(-1, num_slots),
                    num_experts, topo, budget.microstep_rounds,
                    lambda b: f'transition into micro-step '
                    f'{b // num_layers + 1}, layer {b % num_layers}', mode)
  steps = type(steps)(*(x.reshape((num_micro, num_layers) + x.shape[1:])
                        for x in steps))
  fill = _schedule(_rows(start_LS, se[0]), se[0], num_experts, topo,
                   budget.step_rounds, lambda b: f'fill (T_0), layer {b}',
                   mode, budget.flush)
  if start_LS is not None:
    fill = without_returns(fill)
  flush = _schedule(se[-1], _rows(None, se[-1]), num_experts, topo,
                    budget.step_rounds, lambda b: f'flush, layer {b}', mode,
                    budget.flush)
  return StepTransfer(fill, steps, flush, budget)


def fit_layers(prev_LS, next_LS, ref_LS, num_rounds, num_experts, topo,
                mode='exact', flush_rounds=None):
  """Each layer of next_LS with changed slots reverted to ref_LS until it
  fits: those whose revert alone needs fewest rounds first, 1, 2, 4, ...
  of them. Reverting all of them gives ref_LS, which always fits.
  flush_rounds: the placement must also flush within this many rounds
  (None: not checked); ref_LS must then flush within it too."""
  num_layers, num_slots = next_LS.shape
  l_N, j_N = np.nonzero(next_LS != ref_LS)
  at = np.arange(len(l_N))
  single_NS = next_LS[l_N]
  single_NS[at, j_N] = ref_LS[l_N, j_N]
  need_N = _rounds(prev_LS[l_N], single_NS, num_experts, topo, mode)
  order = np.lexsort((need_N, l_N))
  l_N, j_N = l_N[order], j_N[order]
  count_L = np.bincount(l_N, minlength=num_layers)
  rank_N = at - np.repeat(np.cumsum(count_L) - count_L, count_L)
  # Trial p of a layer reverts its first n_p slots in that order; n_p
  # doubles (1, 2, 4, ..., all), so a layer costs log2(S) trials, not S.
  n_LP = np.minimum(2 ** np.arange(int(np.log2(max(count_L.max(), 1))) + 2),
                    count_L[:, None])
  width = n_LP.shape[1]
  revert_LPS = np.zeros((num_layers, width, num_slots), bool)
  revert_LPS[l_N[:, None], np.arange(width), j_N[:, None]] = (
      rank_N[:, None] < n_LP[l_N])
  trial_LPS = np.where(revert_LPS, ref_LS[:, None], next_LS[:, None])
  trial_BS = trial_LPS.reshape(-1, num_slots)
  rows = np.arange(len(trial_BS))[:, None]
  held_BE = np.bincount((rows * num_experts + trial_BS).ravel(),
                        minlength=len(trial_BS) * num_experts)
  ok_B = ((held_BE.reshape(-1, num_experts).min(axis=1) > 0)
          & (_rounds(np.repeat(prev_LS, width, axis=0), trial_BS,
                     num_experts, topo, mode) <= num_rounds))
  if flush_rounds is not None:
    ok_B &= _rounds(trial_BS, _rows(None, trial_BS), num_experts, topo,
                    mode) <= flush_rounds
  ok_LP = ok_B.reshape(num_layers, width)
  return trial_LPS[np.arange(num_layers), ok_LP.argmax(axis=1)]


def fit_plan_to_budget(plan: plan_lib.StepPlan, loads_MLDE, topo: Topology,
                       cost: CostModel, budget: TransferBudget,
                       start_LS=None) -> tuple[plan_lib.StepPlan, int]:
  """A plan whose transitions all fit the budget, and the number of
  (micro-step, layer, slot) entries changed to get there.

  start_LS: what the slots hold before the fill, as for
  `build_step_transfer` (None: empty buffers). The fill is checked from
  there, since that is the fill that will run: from a prefilled placement
  it may need more rounds than from empty buffers (a fill takes a
  same-node source where one exists, so one device holding several of
  micro-step 0's experts sends them all).

  Greedy over micro-steps: an over-budget layer's changed slots go back to
  the reference (for the fill, start_LS, else the home layout; after it,
  the fitted previous micro-step), the most useful first (`fit_layers`). A layer whose flush
  does not fit keeps, from the last micro-step whose placement can flush,
  that placement to the end of the step (home all step only when none
  can). The input plan itself is returned when everything fits.
  """
  se = np.asarray(plan.placement.slot_expert, np.int64)
  num_micro, num_layers, _ = se.shape
  num_experts = np.shape(loads_MLDE)[-1]
  home_LS = placement_lib.identity_placement(
      num_layers, num_experts, topo.num_devices,
      topo.slots_per_device).slot_expert.astype(np.int64)
  empty_LS = _rows(None, home_LS)
  # Where the fill starts, and what its over-budget slots revert to (a
  # fill from start_LS to itself moves nothing, so reverting all fits).
  first_LS = empty_LS if start_LS is None else _rows(start_LS, home_LS)
  first_ref_LS = home_LS if start_LS is None else first_LS

  mode = check_mode(budget.mode)

  def fits(prev_BS, next_BS, num_rounds):
    return _rounds(prev_BS, next_BS, num_experts, topo, mode) <= num_rounds

  flat = se.reshape(-1, se.shape[-1])
  nxt = np.concatenate([se[1:], se[-1:]]).reshape(flat.shape)
  if (fits(first_LS, se[0], budget.step_rounds).all()
      and fits(flat, nxt, budget.microstep_rounds).all()
      and fits(se[-1], empty_LS, budget.step_rounds).all()):
    return plan, 0
  out = se.copy()
  for m in range(num_micro):
    prev_LS = first_LS if m == 0 else out[m - 1]
    ref_LS = first_ref_LS if m == 0 else out[m - 1]
    num_rounds = budget.step_rounds if m == 0 else budget.microstep_rounds
    bad = np.flatnonzero(~fits(prev_LS, out[m], num_rounds))
    if len(bad):
      out[m, bad] = fit_layers(prev_LS[bad], out[m, bad], ref_LS[bad],
                                num_rounds, num_experts, topo, mode)
  # The flush returns every replica. A layer whose flush does not fit holds
  # an earlier micro-step's placement for the rest of the step (the latest
  # one whose flush fits: the moves after it are undone, the balance before
  # it kept); only a layer none of whose placements can flush stays home.
  stay_L = ~fits(out[-1], empty_LS, budget.step_rounds)
  for l in np.flatnonzero(stay_L):
    for m in range(num_micro - 2, -1, -1):
      if fits(out[m, l][None], empty_LS[l][None], budget.step_rounds)[0]:
        out[m + 1:, l] = out[m, l]
        stay_L[l] = False
        break
  out[:, stay_L] = home_LS[stay_L]
  changed_ML = (out != se).any(axis=-1)
  flows_MLS = plan.slot_loads_MLS.astype(np.float64)
  w_MLE = np.asarray(loads_MLDE).sum(axis=2).astype(np.float64)
  for m in np.flatnonzero(changed_ML.any(axis=1)):
    ls = np.flatnonzero(changed_ML[m])
    flows_MLS[m, ls] = split.balanced_flows(out[m, ls], w_MLE[m, ls], topo)[0]
  fitted = plan_lib.assemble_plan(loads_MLDE, out, flows_MLS, topo, cost,
                                  current_LS=home_LS)
  # Fitting only undoes moves: which candidate each layer took still holds.
  return (fitted._replace(fell_back=plan.fell_back,
                          from_split_L=plan.from_split_L,
                          fell_back_L=plan.fell_back_L),
          int((out != se).sum()))
