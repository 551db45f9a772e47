"""The expert compute after dispatch: a grouped SwiGLU over rows grouped by slot.

A device receives rows labelled with one of its `s` local slots (or -1:
an empty row of a padded buffer) and runs each through its slot's expert.
Shared by both dispatch strategies, in five forms:

* ``tiles_static``: rows grouped by slot into tiles of `t` rows, one slot
  per tile; a scan over all floor(R / t) + s tiles the buffer can hold.
  Work follows the buffer size R, not the rows that arrived: the padded
  dispatch as built (dispatch_padded.py), kept for comparison.
* ``tiles``: the same tiles, but a loop whose trip count is the number of
  non-empty tiles, so work follows the rows that arrived (about rows +
  s * t). The exact-count dispatch's expert compute on CPU, where
  `jax.lax.ragged_dot` lowers to a dense matmul per group (G x the work).
* ``tiles_lockstep``: ``tiles`` with the trip count of the busiest device
  of the mesh. Simulated CPU devices share the host's cores, so a device
  that finishes early hands its core to the others and the straggler
  vanishes from wall-clock time; running every device for the busiest
  device's tiles (the extra tiles compute zeros, never read back) makes
  wall-clock follow the straggler as it does on a real mesh, where an
  idle device waits at the next collective. The CPU default.
* ``ragged_dot``: rows sorted by slot and `jax.lax.ragged_dot` with the
  slot counts as group sizes: the TPU default. On a GPU this XLA (jax 0.10
  and 0.11) has no grouped kernel for it: compiled for an H100 it masks the
  rows into every group and runs dense GEMMs over groups x rows (s x the
  work, and tens of GB of masking at a Qwen3-30B-A3B layer:
  experiments/gpu_launches, docs/results.md "What an H100 launches").
* ``pallas``: the tiles of ``tiles`` (of PALLAS_TILE rows), each matmul one
  Pallas Triton launch (pallas_kernels/grouped_matmul.swiglu: a program
  per tile and column block; the weight gradient per slot over its
  tiles): the GPU default. The kernels gather a tile's rows as they read
  them and scatter the output rows as they write them, so the rows are
  never copied into tiles and back. Compiled for anything else it runs
  the kernels' jnp reference over the same tiles.

All of them compute in x's dtype, casting the weights per slot, so the
weights may be stored wider (the float32 master); weight gradients are
summed in float32 and rounded once to the weights' dtype.

Shape letters: R rows received, M model dim, F expert hidden dim, s local
slots, t rows per tile, n tiles (n * t = padded rows), X and Y any weight's
two matrix dims.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul

KINDS = ('tiles_static', 'tiles', 'tiles_lockstep', 'ragged_dot', 'pallas')
# Rows per tile of 'pallas': a tensor-core tile (a dot needs 16 rows on a
# GPU; 128 fills a warpgroup MMA's M twice).
PALLAS_TILE = 128
SCOPE = 'grouped_swiglu'


def default_tile(num_rows: int, slots_per_device: int) -> int:
  """Rows per tile: a power of two in [8, 128].

  Each slot pads its rows up to a whole tile (s * t rows of waste), and each
  tile costs a loop step and a less efficient small matmul (about h rows'
  worth of compute; h ~ 5 measured on CPU), so the work is ~R + s * t +
  h * R / t rows, least at t ~ sqrt(h * R / s). On an accelerator the matrix
  unit (e.g. 128 rows) would set t instead.
  """
  best = (5.0 * num_rows / max(slots_per_device, 1)) ** 0.5
  return int(min(128, max(8, 2 ** round(math.log2(max(best, 1.0))))))


def default_kind(backend: str | None = None) -> str:
  """'tiles_lockstep' on CPU (simulated devices), 'pallas' on GPU (XLA
  compiles ragged_dot there as dense GEMMs over every group), 'ragged_dot'
  on TPU."""
  backend = jax.default_backend() if backend is None else backend
  return {'cpu': 'tiles_lockstep', 'gpu': 'pallas'}.get(backend,
                                                        'ragged_dot')


# ----------------------------------------------------------------- tiles


def _slot_weights(cache, slot, w_sXY, dtype):
  """(slot, its weights cast to `dtype`), re-sliced only when the slot
  changes: tiles come in slot order, so carrying the current slot's weights
  copies (and casts) each slot's matrices once instead of once per tile
  (the per-tile copy cost as much as a dozen rows of compute on CPU)."""
  prev, cached = cache
  cached = jax.lax.cond(slot != prev,
                        lambda: tuple(w[slot].astype(dtype) for w in w_sXY),
                        lambda: cached)
  return slot, cached


def _first_slot_weights(w_sXY, slot_n, dtype):
  return slot_n[0], tuple(w[slot_n[0]].astype(dtype) for w in w_sXY)


def _loop(num_used, body, init, num_tiles: int):
  """body(i, carry) over tiles 0..num_used-1; num_used None: all, as a
  fori_loop with static bounds (XLA may unroll or pipeline it)."""
  if num_used is None:
    return jax.lax.fori_loop(0, num_tiles, body, init)
  return jax.lax.fori_loop(0, num_used, body, init)


@jax.custom_vjp
def _tiled_swiglu(x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n, num_used):
  """y[i] = SwiGLU of tile x[i] with slot slot_n[i]'s weights, for the first
  num_used tiles (the rest stay zero); num_used None: every tile."""
  w_sXY = (wg_sMF, wu_sMF, wd_sFM)
  num_tiles = x_ntM.shape[0]

  def tile(i, carry):
    cache, y_ntM = carry
    x_tM = x_ntM[i]
    cache = _slot_weights(cache, slot_n[i], w_sXY, x_tM.dtype)
    wg_MF, wu_MF, wd_FM = cache[1]
    y_tM = (jax.nn.silu(x_tM @ wg_MF) * (x_tM @ wu_MF)) @ wd_FM
    return cache, y_ntM.at[i].set(y_tM.astype(y_ntM.dtype))

  init = (_first_slot_weights(w_sXY, slot_n, x_ntM.dtype),
          jnp.zeros_like(x_ntM))
  return _loop(num_used, tile, init, num_tiles)[1]


def _tiled_swiglu_fwd(x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n, num_used):
  # Only the input tiles are kept; the backward recomputes g and u per tile.
  return (_tiled_swiglu(x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n, num_used),
          (x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n, num_used))


def _tiled_swiglu_bwd(res, dy_ntM):
  x_ntM, wg_sMF, wu_sMF, wd_sFM, slot_n, num_used = res
  w_sXY = (wg_sMF, wu_sMF, wd_sFM)
  num_tiles = x_ntM.shape[0]

  def tile(i, carry):
    cache, dw_sXY, dx_ntM = carry
    x_tM, dy_tM, slot = x_ntM[i], dy_ntM[i], slot_n[i]
    cache = _slot_weights(cache, slot, w_sXY, x_tM.dtype)
    wg_MF, wu_MF, wd_FM = cache[1]
    g_tF, u_tF = x_tM @ wg_MF, x_tM @ wu_MF
    sig_tF = jax.nn.sigmoid(g_tF)
    act_tF = g_tF * sig_tF  # silu(g)
    dh_tF = dy_tM @ wd_FM.T
    du_tF = dh_tF * act_tF
    dg_tF = dh_tF * u_tF * sig_tF * (1 + g_tF * (1 - sig_tF))
    dx_tM = dg_tF @ wg_MF.T + du_tF @ wu_MF.T
    # Autodiff of the loop would add a whole zero-padded [s, ...] cotangent
    # per tile; adding into the carried gradients touches only this slot.
    dw_sXY = tuple(
        dw.at[slot].add(jnp.dot(a.T, b, preferred_element_type=jnp.float32))
        for dw, a, b in zip(dw_sXY, (x_tM, x_tM, act_tF * u_tF),
                            (dg_tF, du_tF, dy_tM)))
    return cache, dw_sXY, dx_ntM.at[i].set(dx_tM.astype(dx_ntM.dtype))

  dw0 = tuple(jnp.zeros_like(w, jnp.float32) for w in w_sXY)
  init = (_first_slot_weights(w_sXY, slot_n, x_ntM.dtype), dw0,
          jnp.zeros_like(x_ntM))
  _, dw_sXY, dx_ntM = _loop(num_used, tile, init, num_tiles)
  return (dx_ntM, *(dw.astype(w.dtype) for dw, w in zip(dw_sXY, w_sXY)),
          None, None)


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)


def tiles_to_run(count_s, tile: int, kind: str, mesh_axes=()):
  """Trip count of the tile loop: this device's non-empty tiles ('tiles'),
  the busiest device's over `mesh_axes` ('tiles_lockstep'; callers that
  know every device's counts pass the count instead), or None for every
  tile of the buffer ('tiles_static')."""
  if kind == 'tiles_static':
    return None
  used = ((count_s + tile - 1) // tile).sum()
  if kind == 'tiles_lockstep' and mesh_axes:
    used = jax.lax.pmax(used, tuple(mesh_axes))
  return used


def _slot_order(label_R, num_slots: int):
  """(rows sorted by slot, empty rows last; rows per slot [s])."""
  key_R = jnp.where(label_R >= 0, label_R, num_slots).astype(jnp.int32)
  order_R = jnp.argsort(key_R, stable=True).astype(jnp.int32)
  count_s = jnp.zeros((num_slots + 1,), jnp.int32).at[key_R].add(1)[:num_slots]
  return key_R, order_R, count_s


@jax.custom_vjp
def _gather_rows(a_XM, to_Y, from_X):
  """out[y] = a[to_Y[y]], a zero row where to_Y[y] is out of range.

  to_Y and from_X are inverse partial maps (row x goes to y = from_X[x],
  and to_Y[y] = x; out of range on either side: no partner), so the
  transpose is the same gather the other way, da[x] = g[from_X[x]], where
  autodiff would scatter-add (on a GPU a scatter into a zeroed buffer,
  twice the bytes of a gather and serialised on duplicate targets)."""
  return jnp.take(a_XM, to_Y, axis=0, mode='fill', fill_value=0)


def _gather_rows_fwd(a_XM, to_Y, from_X):
  return _gather_rows(a_XM, to_Y, from_X), (to_Y, from_X)


def _gather_rows_bwd(res, g_YM):
  to_Y, from_X = res
  return _gather_rows(g_YM, from_X, to_Y), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _tiles(x_RM, label_R, w_sXY, tile: int, kind: str, mesh_axes=(),
           num_tiles=None):
  num_rows = x_RM.shape[0]
  spd = w_sXY[0].shape[0]
  # floor(R / t) + s tiles hold any split of R rows over s slots (each slot
  # wastes less than one tile).
  num_tiles_static = num_rows // tile + spd
  key_R, order_R, count_s = _slot_order(label_R, spd)
  tiles_s = (count_s + tile - 1) // tile
  end_s = jnp.cumsum(tiles_s) * tile
  start_s = end_s - tiles_s * tile
  # Row r's place in the tiled layout; empty rows land out of range.
  first_s = jnp.cumsum(count_s) - count_s
  rank_sorted = jnp.arange(num_rows, dtype=jnp.int32) - first_s[
      jnp.minimum(key_R[order_R], spd - 1)]
  dest_sorted = jnp.where(key_R[order_R] < spd,
                          start_s[jnp.minimum(key_R[order_R], spd - 1)]
                          + rank_sorted, num_tiles_static * tile)
  dest_R = jnp.zeros((num_rows,), jnp.int32).at[order_R].set(dest_sorted)
  # The row in each tile slot (the inverse map, an int scatter). Padding
  # slots hold num_rows (out of range: a zero row).
  src_T = jnp.full((num_tiles_static * tile,), num_rows, jnp.int32)
  src_T = src_T.at[dest_R].set(jnp.arange(num_rows, dtype=jnp.int32),
                               mode='drop')
  # A tile's slot: how many slot groups end at or before its first row.
  first_n = jnp.arange(num_tiles_static) * tile
  slot_n = jnp.minimum((end_s[None, :] <= first_n[:, None]).sum(axis=1),
                       spd - 1).astype(jnp.int32)
  if kind == 'pallas':
    # One launch per matmul over the device's own non-empty tiles (GPUs),
    # the rest skipped in the kernels. The kernels read the rows through
    # src_nt and write the output rows the same way: the rows are never
    # copied into tiles and back (2 GB of copies at a Qwen3-30B-A3B layer).
    used_1 = jnp.reshape(tiles_to_run(count_s, tile, 'tiles'), (1,)).astype(
        jnp.int32)
    # Empty rows come out zero.
    return grouped_matmul.swiglu(x_RM, *w_sXY,
                                 src_T.reshape(num_tiles_static, tile),
                                 slot_n, used_1)
  x_ntM = _gather_rows(x_RM, src_T, dest_R).reshape(num_tiles_static, tile,
                                                    -1)
  num_used = (tiles_to_run(count_s, tile, kind, mesh_axes)
              if num_tiles is None or kind == 'tiles_static' else
              jnp.minimum(num_tiles, num_tiles_static))
  y_ntM = _tiled_swiglu(x_ntM, *w_sXY, slot_n, num_used)
  y_TM = y_ntM.reshape(num_tiles_static * tile, -1)
  # Empty rows (dest out of range) read zeros; the combine never reads
  # them back.
  return _gather_rows(y_TM, dest_R, src_T)


# ------------------------------------------------------------ ragged_dot


def _ragged(x_RM, label_R, w_sXY):
  wg_sMF, wu_sMF, wd_sFM = w_sXY
  spd = wg_sMF.shape[0]
  _, order_R, count_s = _slot_order(label_R, spd)
  x_sorted = x_RM[order_R]
  dt = x_RM.dtype
  # As the tiles: float32 accumulation, each product rounded to x's dtype.
  mm = lambda a, w: jax.lax.ragged_dot(
      a, w.astype(dt), count_s, preferred_element_type=jnp.float32
  ).astype(dt)
  h = jax.nn.silu(mm(x_sorted, wg_sMF)) * mm(x_sorted, wu_sMF)
  y_sorted = mm(h, wd_sFM)
  return jnp.zeros_like(y_sorted).at[order_R].set(y_sorted)


# -------------------------------------------------------------- dispatch


def grouped_swiglu(x_RM, label_R, wg_sMF, wu_sMF, wd_sFM, *, tile: int,
                   kind: str, mesh_axes=(), num_tiles=None):
  """SwiGLU of each row with its local slot's weights: [R, M].

  label_R: int32 local slot of each row, -1 for empty rows (their output is
  unspecified; callers never read it back). kind: one of KINDS.
  mesh_axes: the mesh axes this runs under ('tiles_lockstep' takes the
  busiest device over them; none: the device's own count).
  num_tiles: for 'tiles' and 'tiles_lockstep', the trip count when the
  caller already knows it (an int32 scalar, at least this device's
  non-empty tiles); None: computed here.
  """
  w_sXY = (wg_sMF, wu_sMF, wd_sFM)
  # The scope names these ops (and their transposes) in profiles
  # (`utils.op_profile`: the expert compute, apart from the rest).
  with jax.named_scope(SCOPE):
    if kind in ('tiles_static', 'tiles', 'tiles_lockstep', 'pallas'):
      return _tiles(x_RM, label_R, w_sXY, tile, kind, mesh_axes, num_tiles)
    if kind == 'ragged_dot':
      return _ragged(x_RM, label_R, w_sXY)
  raise ValueError(f'grouped GEMM kind must be one of {KINDS}, got {kind!r}.')
