"""The grouped matmul's spec in pure jnp (kernel.py holds the Triton kernels).

Also what the kernels' calls run when compiled for anything but a CUDA GPU.
slot_matmul_t holds one [K, N] f32 product per tile: fine at test sizes,
heavy at a real layer (a CPU run of the MoE layer uses the tile loop,
grouped_swiglu's 'tiles_lockstep').

An operand is in one of two layouts. Tiles: [n, t, X], tile i's t rows.
Rows: [R, X], with src_nt [n, t] naming the row each tile slot holds (R or
more: none, a zero row); each row sits in at most one slot. Reading rows
as tiles gathers them; writing tiles as rows scatters them, and rows no
live tile holds are zero.

Shape letters: n tiles, t rows per tile, K contraction dim, N output dim,
s slots, R rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rows_to_tiles(a_RX, src_nt):
  """[n, t, X]: slot (i, r) holds row src_nt[i, r] (zeros where none)."""
  return jnp.take(a_RX, src_nt, axis=0, mode='fill', fill_value=0)


def tiles_to_rows(y_ntX, src_nt, used_1, num_rows: int):
  """[num_rows, X]: each live tile's slots written to their rows; every
  other row zero."""
  n, t = src_nt.shape
  live = (jnp.arange(n) < used_1[0])[:, None]
  dest = jnp.where(live, src_nt, num_rows).reshape(-1)
  return jnp.zeros((num_rows,) + y_ntX.shape[2:], y_ntX.dtype).at[dest].set(
      y_ntX.reshape((n * t,) + y_ntX.shape[2:]), mode='drop')


def grouped_matmul(a, w, src_nt, slot_n, used_1, init=None, *,
                   a_rows: bool = False, out_rows: int | None = None,
                   transpose_w: bool = False):
  """kernel.grouped_matmul in jnp: each tile against its slot's matrix
  (f32 sums, output in a's dtype), tiles past used_1[0] zero. a: tiles, or
  rows (a_rows); output: tiles, or rows [out_rows, N], added to init when
  given (the sum in f32, rounded once); transpose_w: w is [s, N, K] and
  its transpose is used."""
  x_ntK = rows_to_tiles(a, src_nt) if a_rows else a
  if transpose_w:
    w = jnp.swapaxes(w, 1, 2)
  w_ntKN = w[slot_n].astype(x_ntK.dtype)
  y = jnp.einsum('ntk,nkm->ntm', x_ntK, w_ntKN,
                 preferred_element_type=jnp.float32)
  live = (jnp.arange(x_ntK.shape[0]) < used_1[0])[:, None, None]
  y = jnp.where(live, y, 0)
  if out_rows is None:
    return y.astype(x_ntK.dtype)
  if init is None:
    return tiles_to_rows(y.astype(x_ntK.dtype), src_nt, used_1, out_rows)
  held = tiles_to_rows(jnp.ones(y.shape[:2] + (1,), bool), src_nt, used_1,
                       out_rows)
  total = init.astype(jnp.float32) + tiles_to_rows(y, src_nt, used_1,
                                                   out_rows)
  return jnp.where(held, total.astype(x_ntK.dtype), init)


def tile_matmul(x_ntK, w_sKN, slot_n, used_1, transpose_w: bool = False):
  """grouped_matmul of tiles to tiles."""
  return grouped_matmul(x_ntK, w_sKN, None, slot_n, used_1,
                        transpose_w=transpose_w)


def slot_matmul_t(a, b, slot_n, used_1, num_slots: int,
                  out_dtype=jnp.float32, src_nt=None, a_rows: bool = False,
                  b_rows: bool = False):
  """kernel.slot_matmul_t in jnp: each live tile's a^T b, summed per slot
  (f32), rounded once to out_dtype; a and b tiles, or rows (a_rows,
  b_rows: gathered by src_nt)."""
  a_ntK = rows_to_tiles(a, src_nt) if a_rows else a
  b_ntN = rows_to_tiles(b, src_nt) if b_rows else b
  live = (jnp.arange(a_ntK.shape[0]) < used_1[0])[:, None, None]
  per_tile = jnp.einsum('ntk,ntm->nkm', a_ntK, b_ntN,
                        preferred_element_type=jnp.float32)
  return jax.ops.segment_sum(jnp.where(live, per_tile, 0), slot_n,
                             num_segments=num_slots).astype(out_dtype)
