"""Expert parallelism where the placement of experts is runtime data.

The MoE FFN's dispatch -> expert compute -> combine, under `jax.shard_map` over
a ('data', 'expert') mesh. Tokens are sharded over both axes (data-major);
canonical expert weights [E, ...] are sharded over 'expert'. Each EP device
holds `s` slots; a `Placement` (see foremoe_jax/placement.py) says which expert
sits in each slot and how each source device splits its tokens for an expert
across that expert's replicas. Placement arrays are ordinary jit inputs, so a
new placement never recompiles anything.

Dispatch is into per-(source device, destination device) cells of static
capacity C, exchanged by `all_to_all` over 'expert' with each row's local
slot as a label. Each 'data' row dispatches its own tokens over its own
'expert' ring (same placement on every row), so cells, and C, are per data
group (`placement.max_cell`). The receiver groups its R = D * C rows by slot into tiles
of t rows and runs a tiled grouped GEMM, so it computes ~R + s * t rows: the
busiest (source, destination) cell picks C (from a few static buckets), and
device balance, which is what the planner optimises, is what sets C.
(`jax.lax.ragged_dot` would be the natural op, but on CPU it lowers to a
dense matmul per group.)

Shape letters: N tokens on this device, K top-k, A = N*K assignments,
E experts, D EP devices, S slots (= D * s), C capacity per cell, R = D * C
rows a device receives, n tiles of t rows (T = n * t), M model dim,
F expert hidden dim, X and Y any expert weight's two matrix dims.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

DATA, EXPERT = 'data', 'expert'


class DispatchStats(NamedTuple):
  """Per-layer dispatch statistics, summed over all devices."""
  dropped: jax.Array  # int32 []: assignments over capacity (not computed).
  # int32 []: largest (source, destination device) count of any data group;
  # <= C is dropless.
  max_cell: jax.Array
  slot_tokens_S: jax.Array  # int32 [S]: assignments each slot received.


def slot_assignment(e_A, valid_A, slot_expert_S, share_S, num_experts):
  """Slot and in-slot position of each assignment, by the placement split rule.

  Source-local: ranks each assignment among this device's assignments to the
  same expert, then gives slot i of that expert the rank range
  [round(lo_i n), round(hi_i n)) (see foremoe_jax/placement.py).
  Returns (slot_A, pos_A, found_A, count_S).
  """
  onehot_AE = (e_A[:, None] == jnp.arange(num_experts)[None, :]) & valid_A[:, None]
  onehot_AE = onehot_AE.astype(jnp.int32)
  rank_A = jnp.take_along_axis(jnp.cumsum(onehot_AE, axis=0) - 1,
                               e_A[:, None], axis=1)[:, 0]
  n_E = onehot_AE.sum(axis=0)
  num_slots = slot_expert_S.shape[0]
  same_SS = slot_expert_S[:, None] == slot_expert_S[None, :]
  before_SS = jnp.tril(jnp.ones((num_slots, num_slots), bool), k=-1)
  share_S = share_S.astype(jnp.float32)
  # lo[s] = sum of shares of earlier slots holding the same expert.
  lo_S = jnp.einsum('t,st->s', share_S, (same_SS & before_SS).astype(jnp.float32))
  hi_S = lo_S + share_S
  n_S = n_E[slot_expert_S].astype(jnp.float32)
  start_S = jnp.floor(lo_S * n_S + 0.5).astype(jnp.int32)
  stop_S = jnp.floor(hi_S * n_S + 0.5).astype(jnp.int32)
  r = rank_A[:, None]
  cand_AS = ((slot_expert_S[None, :] == e_A[:, None]) & (start_S[None, :] <= r)
             & (r < stop_S[None, :]))
  slot_A = jnp.argmax(cand_AS, axis=1).astype(jnp.int32)
  found_A = cand_AS.any(axis=1) & valid_A
  pos_A = rank_A - start_S[slot_A]
  return slot_A, pos_A, found_A, stop_S - start_S


def default_tile(num_rows: int, slots_per_device: int) -> int:
  """Rows per tile of the grouped GEMM: a power of two in [8, 128].

  Each slot pads its rows up to a whole tile (s * t rows of waste), and each
  tile costs a loop step and a less efficient small matmul (about h rows'
  worth of compute; h ~ 5 measured on CPU), so the work is ~R + s * t +
  h * R / t rows, least at t ~ sqrt(h * R / s). On an accelerator the matrix
  unit (e.g. 128 rows) would set t instead.
  """
  best = (5.0 * num_rows / max(slots_per_device, 1)) ** 0.5
  return int(min(128, max(8, 2 ** round(math.log2(max(best, 1.0))))))


def _slot_weights(cache, slot, w_sXY, dtype):
  """(slot, its weights cast to `dtype`), re-sliced from w_sXY only when the
  slot changes.

  Tiles come in slot order, so a scan that carries the current slot's
  weights copies (and casts) each slot's matrices once instead of once per
  tile (the per-tile copy cost as much as a dozen rows of compute on CPU).
  """
  prev, cached = cache
  cached = jax.lax.cond(slot != prev,
                        lambda: tuple(w[slot].astype(dtype) for w in w_sXY),
                        lambda: cached)
  return slot, cached


def _first_slot_weights(w_sXY, slot_n, dtype):
  return slot_n[0], tuple(w[slot_n[0]].astype(dtype) for w in w_sXY)


@jax.custom_vjp
def _tiled_swiglu(x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n):
  """y[n] = SwiGLU of tile x[n] with slot slot_n[n]'s weights: [n, t, M].

  A scan over tiles, slot_n ascending. (The batched einsum 'ntm,nmf->ntf'
  on weights gathered per tile is the same math, but on CPU the gather of
  [n, M, F] costs several times the matmuls.) It computes in x's dtype
  and casts the weights per slot, so they may be stored wider (the float32
  master on the canonical path); their gradient is summed over tiles in
  float32 and rounded once, to their own dtype.
  """
  w_sXY = (wg_sMF, wu_sMF, wd_sFM)

  def tile(cache, xs):
    x_tM, slot = xs
    cache = _slot_weights(cache, slot, w_sXY, x_tM.dtype)
    wg_MF, wu_MF, wd_FM = cache[1]
    return cache, (jax.nn.silu(x_tM @ wg_MF) * (x_tM @ wu_MF)) @ wd_FM

  return jax.lax.scan(tile, _first_slot_weights(w_sXY, slot_n, x_ntM.dtype),
                      (x_ntM, slot_n))[1]


def _tiled_swiglu_fwd(x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n):
  # Only the input tiles are kept; the backward recomputes g and u per tile.
  return (_tiled_swiglu(x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n),
          (x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n))


def _tiled_swiglu_bwd(res, dy_ntM):
  x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n = res
  w_sXY = (wg_sMF, wu_sMF, wd_sFM)

  def tile(carry, xs):
    cache, dw_sXY = carry
    x_tM, dy_tM, slot = xs
    cache = _slot_weights(cache, slot, w_sXY, x_tM.dtype)
    wg_MF, wu_MF, wd_FM = cache[1]
    g_tF, u_tF = x_tM @ wg_MF, x_tM @ wu_MF
    sig_tF = jax.nn.sigmoid(g_tF)
    act_tF = g_tF * sig_tF  # silu(g)
    dh_tF = dy_tM @ wd_FM.T
    du_tF = dh_tF * act_tF
    dg_tF = dh_tF * u_tF * sig_tF * (1 + g_tF * (1 - sig_tF))
    dx_tM = dg_tF @ wg_MF.T + du_tF @ wu_MF.T
    # Autodiff of the scan would add a whole zero-padded [s, ...] cotangent
    # per tile; adding into the carried gradients touches only this slot.
    dw_sXY = tuple(
        dw.at[slot].add(jnp.dot(a.T, b, preferred_element_type=jnp.float32))
        for dw, a, b in zip(dw_sXY, (x_tM, x_tM, act_tF * u_tF),
                            (dg_tF, du_tF, dy_tM)))
    return (cache, dw_sXY), dx_tM

  dw0 = tuple(jnp.zeros_like(w, jnp.float32) for w in w_sXY)
  (_, dw_sXY), dx_ntM = jax.lax.scan(
      tile, (_first_slot_weights(w_sXY, slot_n, x_ntM.dtype), dw0),
      (x_ntM, dy_ntM, slot_n))
  return (dx_ntM, *(dw.astype(w.dtype) for dw, w in zip(dw_sXY, w_sXY)),
          None)


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)


def _grouped_swiglu(x_RM, label_R, wg_sMF, wu_sMF, wd_sFM, tile):
  """SwiGLU of each row with its local slot's weights (rows labelled -1: any).

  A tiled grouped GEMM (as in MegaBlocks' grouped matmul): rows are grouped
  by slot, each group padded to whole tiles of `tile` rows, and every tile
  runs against one slot's weights. The static tile count floor(R / t) + s
  covers any split of R rows over s slots (each slot wastes less than one
  tile), so the padded work is ~R + s * t rows however unevenly the rows
  fall on the slots.
  """
  num_rows, _ = x_RM.shape
  spd = wg_sMF.shape[0]
  num_tiles = num_rows // tile + spd
  onehot_Rs = (label_R[:, None] == jnp.arange(spd)[None, :]).astype(jnp.int32)
  count_s = onehot_Rs.sum(axis=0)
  rank_R = jnp.take_along_axis(jnp.cumsum(onehot_Rs, axis=0) - 1,
                               jnp.maximum(label_R, 0)[:, None], axis=1)[:, 0]
  padded_s = (count_s + tile - 1) // tile * tile
  end_s = jnp.cumsum(padded_s)
  start_s = end_s - padded_s
  # Row r's place in the tiled layout; empty rows land out of range.
  dest_R = jnp.where(label_R >= 0, start_s[jnp.maximum(label_R, 0)] + rank_R,
                     num_tiles * tile)
  # Gather (not scatter) the tiled rows: the inverse map is an int scatter.
  src_T = jnp.full((num_tiles * tile,), num_rows, jnp.int32)
  src_T = src_T.at[dest_R].set(jnp.arange(num_rows, dtype=jnp.int32),
                               mode='drop')
  x_pad_RM = jnp.concatenate([x_RM, jnp.zeros_like(x_RM[:1])])
  x_ntM = x_pad_RM[src_T].reshape(num_tiles, tile, -1)
  # A tile's slot: how many slot groups end at or before its first row.
  first_n = jnp.arange(num_tiles) * tile
  slot_n = jnp.minimum((end_s[None, :] <= first_n[:, None]).sum(axis=1),
                       spd - 1)
  # The weights go in as stored: the tiles cast them to the rows' dtype.
  y_ntM = _tiled_swiglu(x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n)
  y_TM = y_ntM.reshape(num_tiles * tile, -1)
  # Empty rows read some tile's row; the combine never reads them back.
  return jnp.take(y_TM, jnp.minimum(dest_R, num_tiles * tile - 1), axis=0)


def _ep_body(x_NM, ids_NK, gates_NK, valid_N, wg_sMF, wu_sMF, wd_sFM,
             slot_expert_S, slot_share_DS, *, capacity, num_experts, tile):
  """Per-device body under shard_map; lower-case s: this device's slots."""
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
  slot_A, pos_A, found_A, count_S = slot_assignment(
      e_A, valid_A, slot_expert_S, slot_share_DS[me], num_experts)
  # Within a (source, destination device) cell, slot-major: a slot's tokens
  # stay one contiguous run, and over capacity drops the last slots' tail.
  count_Ds = count_S.reshape(num_ep, spd)
  offset_S = (jnp.cumsum(count_Ds, axis=1) - count_Ds).reshape(num_slots)
  cell_pos_A = offset_S[slot_A] + pos_A
  keep_A = found_A & (cell_pos_A < capacity)
  flat_A = jnp.where(keep_A, slot_A // spd * capacity + cell_pos_A, num_rows)

  send_RM = jnp.zeros((num_rows, model_dim), x_NM.dtype)
  send_RM = send_RM.at[flat_A].add(x_NM[token_A], mode='drop')
  label_R = jnp.full((num_rows,), -1, jnp.int32)
  label_R = label_R.at[flat_A].set(slot_A % spd, mode='drop')
  # The slot weights are the same on every 'data' shard, the rows are not;
  # saying so up front gives the grouped matmul's hand-written VJP one type,
  # and its transpose sums the weight gradients over 'data'.
  wg_sMF, wu_sMF, wd_sFM = (jax.lax.pcast(w, DATA, to='varying')
                            for w in (wg_sMF, wu_sMF, wd_sFM))
  recv_DCM = jax.lax.all_to_all(send_RM.reshape(num_ep, capacity, model_dim),
                                EXPERT, 0, 0, tiled=True)
  recv_label_DC = jax.lax.all_to_all(label_R.reshape(num_ep, capacity),
                                     EXPERT, 0, 0, tiled=True)
  out_RM = _grouped_swiglu(recv_DCM.reshape(num_rows, model_dim),
                           recv_label_DC.reshape(num_rows), wg_sMF, wu_sMF,
                           wd_sFM, tile)
  back_DCM = jax.lax.all_to_all(out_RM.reshape(num_ep, capacity, model_dim),
                                EXPERT, 0, 0, tiled=True)

  back_RM = back_DCM.reshape(num_rows, model_dim)
  y_AM = jnp.take(back_RM, jnp.minimum(flat_A, num_rows - 1), axis=0)
  w_A = jnp.where(keep_A, gates_NK.reshape(-1), 0).astype(y_AM.dtype)
  y_NM = (y_AM * w_A[:, None]).reshape(num_tokens, top_k, model_dim).sum(axis=1)

  axes = (DATA, EXPERT)
  # One psum for both sums: on CPU each collective is a rendezvous of all
  # devices, a fixed cost per layer call.
  sums = jax.lax.psum(jnp.append(count_S, (found_A & ~keep_A).sum()
                                 ).astype(jnp.int32), axes)
  max_cell = jax.lax.pmax(count_Ds.sum(axis=1).max().astype(jnp.int32), axes)
  return y_NM, DispatchStats(sums[-1], max_cell, sums[:-1])


def _gather_body(w_eXY, slot_expert_S):
  num_ep = jax.lax.axis_size(EXPERT)
  spd = slot_expert_S.shape[0] // num_ep
  local_experts_s = jax.lax.dynamic_slice_in_dim(
      slot_expert_S, jax.lax.axis_index(EXPERT) * spd, spd)
  return jax.lax.all_gather(w_eXY, EXPERT, tiled=True)[local_experts_s]


def gather_slot_weights(w_EXY, slot_expert_S, *, mesh):
  """Slot weights [S, ...] (sharded over 'expert') from canonical [E, ...].

  This is the weight transfer of a placement; its transpose sums the slot
  gradients of a replicated expert onto the canonical weights
  (docs/design.md §4.5).
  Computed once per placement, apart from the token path, so the transfer
  can be scheduled (and overlapped) independently of dispatch.
  """
  return jax.shard_map(_gather_body, mesh=mesh,
                       in_specs=(P(EXPERT), P()), out_specs=P(EXPERT))(
                           w_EXY, slot_expert_S)


def expert_parallel_ffn(x_NM, ids_NK, gates_NK, valid_N, wg_SMF, wu_SMF,
                        wd_SFM, slot_expert_S, slot_share_DS, *, mesh,
                        capacity: int, num_experts: int,
                        tile: int | None = None):
  """SwiGLU experts under expert parallelism with a runtime placement.

  Args:
    x_NM: all tokens (global view), sharded over ('data', 'expert').
    ids_NK, gates_NK: routed expert ids and gate weights per token.
    valid_N: bool; invalid tokens (padding) are not dispatched.
    wg_SMF, wu_SMF, wd_SFM: slot weights (`gather_slot_weights` of the
      canonical experts for this placement), sharded over 'expert'.
    slot_expert_S, slot_share_DS: one layer of a Placement.
    mesh: a mesh with 'data' and 'expert' axes.
    capacity: static per-(source device, destination device) capacity C.
      A token never sends one expert two rows, so C = local tokens *
      min(top_k, s) is dropless.
    num_experts: E, the number of canonical experts.
    tile: rows per tile of the grouped GEMM (static); None picks
      `default_tile(D * C, s)`.
  Returns:
    (y_NM, DispatchStats).
  """
  num_shards = mesh.shape[DATA] * mesh.shape[EXPERT]
  if x_NM.shape[0] % num_shards:
    raise ValueError(
        f'{x_NM.shape[0]} tokens do not split evenly over the {num_shards} '
        f'devices of the ({DATA}, {EXPERT}) mesh; pad the batch.')
  if slot_share_DS.shape[0] != mesh.shape[EXPERT]:
    raise ValueError(f'placement has {slot_share_DS.shape[0]} source devices '
                     f'but the expert axis has {mesh.shape[EXPERT]}.')
  if slot_expert_S.shape[0] % mesh.shape[EXPERT]:
    raise ValueError(f'{slot_expert_S.shape[0]} slots do not split over '
                     f'{mesh.shape[EXPERT]} EP devices.')
  if tile is None:
    tile = default_tile(mesh.shape[EXPERT] * int(capacity),
                        slot_expert_S.shape[0] // mesh.shape[EXPERT])
  tok = P((DATA, EXPERT))
  fn = jax.shard_map(
      lambda *a: _ep_body(*a, capacity=int(capacity), num_experts=num_experts,
                          tile=int(tile)),
      mesh=mesh,
      in_specs=(tok, tok, tok, tok, P(EXPERT), P(EXPERT), P(EXPERT), P(), P()),
      out_specs=(tok, DispatchStats(P(), P(), P())),
  )
  return fn(x_NM, ids_NK, gates_NK, valid_N, wg_SMF, wu_SMF, wd_SFM,
            slot_expert_S, slot_share_DS)


def routed_experts(x_NM, ids_NK, gates_NK, valid_N, wg_EMF, wu_EMF, wd_EFM,
                   slot_expert_S, slot_share_DS, *, mesh, capacity: int,
                   tile: int | None = None):
  """Canonical weights in, routed-expert output out: transfer, then dispatch."""
  slot_w = [gather_slot_weights(w, slot_expert_S, mesh=mesh)
            for w in (wg_EMF, wu_EMF, wd_EFM)]
  return expert_parallel_ffn(x_NM, ids_NK, gates_NK, valid_N, *slot_w,
                             slot_expert_S, slot_share_DS, mesh=mesh,
                             capacity=capacity, num_experts=wg_EMF.shape[0],
                             tile=tile)


def make_mesh(num_data: int = 1, num_expert: int = 1, devices=None):
  """A ('data', 'expert') mesh with Auto axes, so shard_map reshards inputs."""
  devices = jax.devices() if devices is None else devices
  need = num_data * num_expert
  if len(devices) < need:
    raise ValueError(
        f'mesh ({num_data} data x {num_expert} expert) needs {need} devices, '
        f'found {len(devices)}; on CPU set XLA_FLAGS='
        f'--xla_force_host_platform_device_count={need} before importing jax.')
  return jax.make_mesh((num_data, num_expert), (DATA, EXPERT),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=devices[:need])
