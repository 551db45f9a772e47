"""Which slot each token-assignment goes to: the placement's split rule on device.

Shared by both dispatch strategies (dispatch_padded.py, dispatch_exact.py),
and the jnp twin of `placement.slot_counts` (numpy, the planner's side);
tests hold the two equal.

Split rule (docs/design.md §4.2): this source device holds n assignments to
expert e, ranked 0..n-1 in token order; the slots holding e, in slot order,
get the rank ranges [round(lo n), round(hi n)) of their cumulative shares.

Everything is sorts and searches, O(A log A + S log S): no [A, E] or [A, S]
one-hot, which at real sizes (A = 8,192 tokens x top-8, S = 1,152 slots)
would be larger than the activations themselves.

Shape letters: A assignments on this device (tokens x top-k), E experts,
S slots (global).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def search_sorted(sorted_K, query_Q):
  """jnp.searchsorted(sorted_K, query_Q, side='right'), chosen by the
  platform compiled for: the binary search on CPU; elsewhere one fused
  comparison of every query with every key (O(Q K) work, fine on an
  accelerator, but no [Q, K] array): a GPU runs the binary search as an
  XLA loop of a few launches per step (experiments/gpu_launches)."""
  return jax.lax.platform_dependent(
      sorted_K, query_Q,
      cpu=lambda k, q: jnp.searchsorted(k, q, side='right'),
      default=lambda k, q: jnp.searchsorted(k, q, side='right',
                                            method='compare_all'))


class SlotAssignment(NamedTuple):
  slot_A: jax.Array  # int32: global slot of each assignment (any if not found).
  pos_A: jax.Array  # int32: position among this source's rows for that slot.
  found_A: jax.Array  # bool: valid and covered by a slot's rank range.
  count_S: jax.Array  # int32: rows this source sends each slot.
  # int32: assignments sorted by slot (token order within a slot), the
  # ones not found last: row i of a slot-major send buffer is order_A[i].
  order_A: jax.Array


def expert_ranks(e_A, valid_A, num_experts: int):
  """(rank of each assignment among this source's valid assignments to the
  same expert, in assignment order; count per expert [E]).

  A stable sort by expert keeps token order inside each expert's run, so an
  assignment's rank is its position in the run.
  """
  num_assign = e_A.shape[0]
  key_A = jnp.where(valid_A, e_A, num_experts).astype(jnp.int32)
  order_A = jnp.argsort(key_A, stable=True)
  n_E = jnp.zeros((num_experts + 1,), jnp.int32).at[key_A].add(1)[:num_experts]
  start_E = jnp.cumsum(n_E) - n_E
  sorted_e = jnp.minimum(key_A[order_A], num_experts - 1)
  rank_sorted = jnp.arange(num_assign, dtype=jnp.int32) - start_E[sorted_e]
  rank_A = jnp.zeros((num_assign,), jnp.int32).at[order_A].set(rank_sorted)
  return rank_A, n_E


def slot_ranges(n_E, slot_expert_S, share_S):
  """[start, stop) rank range each slot takes of its expert's assignments
  from this source: (start_S, stop_S), int32."""
  num_slots = slot_expert_S.shape[0]
  share_S = share_S.astype(jnp.float32)
  # lo[s]: shares of the earlier slots holding the same expert. A masked
  # sum (S^2, S ~ 10^3), not a segmented cumsum: the shares are whole steps
  # of 2^-24 (`placement.SHARE_GRID`), so no partial sum rounds and the
  # numpy side (`placement.cumulative_shares`, in slot order) gets the same
  # bits; hi is then exactly the next slot's lo, so no rank falls between
  # two slots.
  # Not a matmul: at default precision a float32 dot is one bfloat16 pass
  # on a TPU and TF32 on a GPU, which rounds the shares (tokens then fall
  # between two slots' ranges, or into both); adds of float32 are exact
  # on every backend.
  same_SS = slot_expert_S[:, None] == slot_expert_S[None, :]
  before_SS = jnp.tril(jnp.ones((num_slots, num_slots), bool), k=-1)
  lo_S = jnp.sum(jnp.where(same_SS & before_SS, share_S[None, :], 0.0),
                 axis=1)
  hi_S = lo_S + share_S
  n_S = n_E[slot_expert_S].astype(jnp.float32)
  start_S = jnp.floor(lo_S * n_S + 0.5).astype(jnp.int32)
  stop_S = jnp.floor(hi_S * n_S + 0.5).astype(jnp.int32)
  return start_S, stop_S


def own_share_row(slot_share_DS, axis_name: str = 'expert'):
  """This device's row of a placement's shares, inside a shard_map: [S].

  slot_share_DS is either every source's rows ([D, S], replicated) or this
  device's row alone ([1, S]: the RL step shards the shares over 'expert',
  so that each device receives S floats per layer and micro-step instead of
  D x S: 365 MB a device at DeepSeek-V3-like on 256 devices).
  """
  num_rows, num_ep = slot_share_DS.shape[0], jax.lax.axis_size(axis_name)
  if num_rows == 1:
    return slot_share_DS[0]
  if num_rows != num_ep:
    raise ValueError(f'shares of {num_rows} source devices on an expert axis '
                     f'of {num_ep}: pass all of them, or this device\'s row.')
  return slot_share_DS[jax.lax.axis_index(axis_name)]


def assign_slots(e_A, valid_A, slot_expert_S, share_S,
                 num_experts: int) -> SlotAssignment:
  """Slot of every assignment by the split rule, and its row in the slot.

  The slot of rank r of expert e is the first slot of e (in slot order)
  whose range stops past r: a search over the slots sorted by (expert,
  stop). Ranks in no slot's range (only possible when float32 shares leave
  a gap) are not found and are dropped, as `placement.slot_counts` counts.
  """
  num_assign = e_A.shape[0]
  num_slots = slot_expert_S.shape[0]
  slot_expert_S = slot_expert_S.astype(jnp.int32)
  rank_A, n_E = expert_ranks(e_A, valid_A, num_experts)
  start_S, stop_S = slot_ranges(n_E, slot_expert_S, share_S)
  span = num_assign + 1  # stop <= A, so (expert, stop) packs into one key.
  if num_experts * span >= 2**31:
    # The packed int32 keys would wrap and the search would pick wrong
    # slots without a word (E = 256 at about 1M tokens x top-8 a device).
    raise ValueError(
        f'{num_assign:,} assignments of {num_experts} experts on one device '
        f'overflow the int32 slot keys (experts x (assignments + 1) must be '
        f'< 2**31): use fewer tokens per device per micro-step.')
  order_S = jnp.argsort(slot_expert_S, stable=True)
  key_S = slot_expert_S[order_S] * span + stop_S[order_S]
  # A running max keeps the keys sorted even if an ulp made one expert's
  # stops non-monotone; the first slot past r is unchanged by it.
  key_S = jax.lax.cummax(key_S)
  query_A = e_A.astype(jnp.int32) * span + rank_A
  at_A = search_sorted(key_S, query_A)
  slot_A = order_S[jnp.minimum(at_A, num_slots - 1)].astype(jnp.int32)
  found_A = (valid_A & (at_A < num_slots)
             & (slot_expert_S[slot_A] == e_A)
             & (start_S[slot_A] <= rank_A) & (rank_A < stop_S[slot_A]))
  # Positions and counts from the rows actually found (not from the
  # ranges), so a slot's rows are always 0..count-1 even where float32
  # shares overlapped by an ulp.
  key_A = jnp.where(found_A, slot_A, num_slots)
  order_A = jnp.argsort(key_A, stable=True).astype(jnp.int32)
  count_S = jnp.zeros((num_slots + 1,), jnp.int32).at[key_A].add(1)[:num_slots]
  first_S = jnp.cumsum(count_S) - count_S
  pos_sorted = (jnp.arange(num_assign, dtype=jnp.int32)
                - first_S[jnp.minimum(key_A[order_A], num_slots - 1)])
  pos_A = jnp.zeros((num_assign,), jnp.int32).at[order_A].set(pos_sorted)
  return SlotAssignment(slot_A, pos_A, found_A, count_S, order_A)
