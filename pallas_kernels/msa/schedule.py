"""Visit lists for the TPU MSA kernels: which key blocks a query tile reads.

Selection is per token, but a TPU kernel step is a tile of queries against one
key block. A query tile therefore visits the union of its tokens' selected
blocks (ascending, so each block is fetched once) and a row mask keeps every
token to its own K blocks; the backward dK/dV kernel walks the inverse lists
(which query tiles read a key block). The lists go to the kernels by scalar
prefetch, and their index_maps fetch only the listed blocks. Past a list's
count the last entry repeats, so the pipeline sees an unchanged block index
and issues no DMA while the kernel body is skipped.

SMEM holds these lists whole: B*G*(T/Tq)*min(N, Tq*K) int32 entries for the
forward. For very long prompts, call per query chunk (q_offset) to bound it.

Letter key: B batch, G groups, T query tokens, K selected blocks, N key
blocks, Q query tiles, U union entries per tile, V query tiles per block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _membership_BGQN(sel_BGTK, q_tile: int, n_blocks: int) -> jax.Array:
  b, g, t, k = sel_BGTK.shape
  nq = t // q_tile
  blk = jnp.where(sel_BGTK < 0, n_blocks, sel_BGTK).reshape(b, g, nq,
                                                           q_tile * k)
  member = jnp.zeros((b, g, nq, n_blocks + 1), jnp.bool_)
  bi = jnp.arange(b)[:, None, None, None]
  gi = jnp.arange(g)[None, :, None, None]
  qi = jnp.arange(nq)[None, None, :, None]
  return member.at[bi, gi, qi, blk].set(True)[..., :n_blocks]


def _sorted_lists(member_XY, width: int):
  """Ascending ids of the True entries per row, padded by repeating the last."""
  order = jnp.argsort(~member_XY, axis=-1, stable=True)[..., :width]
  count = member_XY.sum(axis=-1).astype(jnp.int32)
  last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None],
                             axis=-1)
  u = jnp.arange(width)
  lists = jnp.where(u < count[..., None], order, last)
  return lists.astype(jnp.int32), count


def tile_visits(sel_BGTK, q_tile: int, n_blocks: int):
  """Per query tile: (blocks_BGQU ascending, count_BGQ); U = min(N, Tq*K)."""
  k = sel_BGTK.shape[-1]
  member = _membership_BGQN(sel_BGTK, q_tile, n_blocks)
  return _sorted_lists(member, min(n_blocks, q_tile * k))


def block_visits(sel_BGTK, q_tile: int, n_blocks: int):
  """Per key block: (query tiles_BGNV ascending, count_BGN); V = T / Tq."""
  member = _membership_BGQN(sel_BGTK, q_tile, n_blocks)
  member_BGNQ = member.transpose(0, 1, 3, 2)
  return _sorted_lists(member_BGNQ, member_BGNQ.shape[-1])
