"""Padded-cell dispatch: every (source, destination) cell padded to one capacity.

The expert-parallel layer as first built, kept as `parallel.dispatch =
'padded'` for comparison with the exact-count dispatch (dispatch_exact.py).
Each source lays its rows out in D cells of static capacity C (slot-major
inside a cell; rows past C are dropped and counted), one `all_to_all` over
'expert' sends them with their local slot labels, and the receiver runs all
D * C rows through the grouped SwiGLU with a static tile count, so its work
follows C whatever arrived. C must hold the busiest cell, which at 16+
devices is the dropless bound whatever the balance (docs/design.md §4.3).

Runs per device under `jax.shard_map` (expert_parallel.py builds it).

Shape letters: N tokens on this device, K top-k, A = N * K assignments,
D EP devices, S slots (= D * s), C capacity per cell, R = D * C rows a
device receives, M model dim, F expert hidden dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from foremoe_jax.model import grouped_swiglu
from foremoe_jax.model.slot_assignment import assign_slots, own_share_row

DATA, EXPERT = 'data', 'expert'


def dispatch_body(x_NM, ids_NK, gates_NK, valid_N, wg_sMF, wu_sMF, wd_sFM,
                  slot_expert_S, slot_share_DS, *, capacity: int,
                  num_experts: int, tile: int, gemm: str):
  """(y_NM, counts) on one device; counts = (count_S, dropped, demand) for
  the stats: `demand` is this device's largest cell, which C must hold."""
  del gemm  # Padded compute is the static tile scan, by definition.
  num_ep = jax.lax.axis_size(EXPERT)
  me = jax.lax.axis_index(EXPERT)
  num_tokens, top_k = ids_NK.shape
  num_slots = slot_expert_S.shape[0]
  spd = num_slots // num_ep
  model_dim = x_NM.shape[-1]
  num_rows = num_ep * capacity

  e_A = ids_NK.reshape(-1).astype(jnp.int32)
  valid_A = jnp.repeat(valid_N, top_k)
  token_A = jnp.repeat(jnp.arange(num_tokens), top_k)
  sa = assign_slots(e_A, valid_A, slot_expert_S,
                    own_share_row(slot_share_DS), num_experts)
  # Within a (source, destination device) cell, slot-major: a slot's tokens
  # stay one contiguous run, and over capacity drops the last slots' tail.
  count_Ds = sa.count_S.reshape(num_ep, spd)
  offset_S = (jnp.cumsum(count_Ds, axis=1) - count_Ds).reshape(num_slots)
  cell_pos_A = offset_S[sa.slot_A] + sa.pos_A
  keep_A = sa.found_A & (cell_pos_A < capacity)
  flat_A = jnp.where(keep_A, sa.slot_A // spd * capacity + cell_pos_A,
                     num_rows)

  send_RM = jnp.zeros((num_rows, model_dim), x_NM.dtype)
  send_RM = send_RM.at[flat_A].add(x_NM[token_A], mode='drop')
  label_R = jnp.full((num_rows,), -1, jnp.int32)
  label_R = label_R.at[flat_A].set(sa.slot_A % spd, mode='drop')
  recv_DCM = jax.lax.all_to_all(send_RM.reshape(num_ep, capacity, model_dim),
                                EXPERT, 0, 0, tiled=True)
  recv_label_DC = jax.lax.all_to_all(label_R.reshape(num_ep, capacity),
                                     EXPERT, 0, 0, tiled=True)
  out_RM = grouped_swiglu.grouped_swiglu(
      recv_DCM.reshape(num_rows, model_dim), recv_label_DC.reshape(num_rows),
      wg_sMF, wu_sMF, wd_sFM, tile=tile, kind='tiles_static')
  back_DCM = jax.lax.all_to_all(out_RM.reshape(num_ep, capacity, model_dim),
                                EXPERT, 0, 0, tiled=True)

  back_RM = back_DCM.reshape(num_rows, model_dim)
  y_AM = jnp.take(back_RM, jnp.minimum(flat_A, num_rows - 1), axis=0)
  w_A = jnp.where(keep_A, gates_NK.reshape(-1), 0).astype(y_AM.dtype)
  y_NM = (y_AM * w_A[:, None]).reshape(num_tokens, top_k, model_dim).sum(axis=1)
  dropped = (valid_A & ~keep_A).sum()  # Over capacity or in no slot.
  return y_NM, (sa.count_S, dropped, count_Ds.sum(axis=1).max())
