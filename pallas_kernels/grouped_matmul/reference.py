"""The grouped matmul's spec in pure jnp (kernel.py holds the Triton kernels).

Also what the kernels' calls run when compiled for anything but a CUDA GPU.
slot_matmul_t holds one [K, N] f32 product per tile: fine at test sizes,
heavy at a real layer (a CPU run of the MoE layer uses the tile loop,
grouped_swiglu's 'tiles_lockstep').

Shape letters: n tiles, t rows per tile, K contraction dim, N output dim,
s slots.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tile_matmul(x_ntK, w_sKN, slot_n, used_1, transpose_w: bool = False):
  """kernel.tile_matmul in jnp: each tile against its slot's matrix (f32
  sums); with transpose_w, w is [s, N, K] and its transpose is used."""
  if transpose_w:
    w_sKN = jnp.swapaxes(w_sKN, 1, 2)
  w_ntKN = w_sKN[slot_n].astype(x_ntK.dtype)
  y = jnp.einsum('ntk,nkm->ntm', x_ntK, w_ntKN,
                 preferred_element_type=jnp.float32)
  live = (jnp.arange(x_ntK.shape[0]) < used_1[0])[:, None, None]
  return jnp.where(live, y, 0).astype(x_ntK.dtype)


def slot_matmul_t(a_ntK, b_ntN, slot_n, used_1, num_slots: int,
                  out_dtype=jnp.float32):
  """kernel.slot_matmul_t in jnp: each live tile's a^T b, summed per slot
  (f32), rounded once to out_dtype."""
  live = (jnp.arange(a_ntK.shape[0]) < used_1[0])[:, None, None]
  per_tile = jnp.einsum('ntk,ntm->nkm', a_ntK, b_ntN,
                        preferred_element_type=jnp.float32)
  return jax.ops.segment_sum(jnp.where(live, per_tile, 0), slot_n,
                             num_segments=num_slots).astype(out_dtype)
