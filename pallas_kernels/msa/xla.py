"""MSA fast path in plain XLA: the path the model takes on CPU.

Same API and numbers as `reference.py`, with work close to the FLOP formula
of docs/design.md §6.6 instead of the reference's dense O(T*S):

* Index branch: the logits are made tile by tile over the causal triangle
  only (a fori_loop over a static list of (query chunk, key chunk) tiles), and
  each tile is reduced to its block maxima at once, so [T, S] logits are never
  held and the upper triangle is never computed.
* Main branch, key-centric: selection is per token, so two tokens rarely share
  their K blocks and gathering K*C keys per token would move K*C*D floats per
  token (measured 3x slower than dense at 8k). Instead the (token, slot) pairs
  are sorted by block and packed into tiles of `pairs_per_tile` pairs that all
  read the same key block; a tile is one [Q*R, D] x [D, C] matmul, the block is
  read once per tile and the query rows are reused by all R heads. A tile's
  pairs belong to distinct tokens, and its partial (max, sum, out) merges
  into their running rows by the log-sum-exp rule, exactly as flash
  attention merges key tiles.

The index branch is differentiable by autodiff; the main branch has its own
backward (`_attend_bwd`, flash attention's, over the same tiles).
kv_valid_BS (bool [B, S], None = all valid) masks padding keys in both
branches, as in `reference.py` (docs/design.md §6.9).

Letter key (as in reference.py): B batch, T query tokens, S key tokens,
H query heads, G KV groups, R heads per group, D head dim, I index head dim,
N key blocks, C tokens per block, K selected blocks, P (token, slot) pairs,
M tiles of pairs, Q pairs per tile.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.msa.kernel_common import like_inputs

# Finite stand-in for -inf in the main branch: keeps exp() and its gradient
# NaN-free on fully masked padding lanes (the jax.nn attention convention).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def causal_tiles(q_len: int, kv_len: int, q_offset: int, q_chunk: int,
                 k_chunk: int) -> np.ndarray:
  """Static (query chunk, key chunk) pairs that hold at least one visible key."""
  tiles = []
  for c in range(-(-q_len // q_chunk)):
    last_pos = min(c * q_chunk + q_chunk - 1, q_len - 1) + q_offset
    for kc in range(-(-kv_len // k_chunk)):
      if kc * k_chunk <= last_pos:
        tiles.append((c, kc))
  return np.asarray(tiles, np.int32).reshape(-1, 2)


def block_scores_BGTN(qi_BTGI, ki_BSI, *, block_size: int, q_offset: int = 0,
                      q_chunk: int = 256, k_chunk: int = 1024,
                      kv_valid_BS=None) -> jax.Array:
  """Causal block-max index scores [B, G, T, N] over the valid keys, -inf
  for blocks with no visible valid key."""
  b, t, g, di = qi_BTGI.shape
  s = ki_BSI.shape[1]
  n = -(-s // block_size)
  k_chunk = _round_up(min(k_chunk, n * block_size), block_size)
  q_chunk = min(q_chunk, t)
  tp, sp = _round_up(t, q_chunk), _round_up(s, k_chunk)
  # Unscaled: 1/sqrt(I) is applied to the block maxima at the end, as the
  # reference and decode scale the dot's result. A scale folded into qi
  # (inexact for I = 8, 32, 128) rounds two tied dots apart, and the tie
  # went to the rounding instead of the lower block id.
  qi = jnp.pad(qi_BTGI.astype(jnp.float32), ((0, 0), (0, tp - t), (0, 0), (0, 0)))
  # [I, S] once, so no tile transposes its key slice again (measured ~10%).
  ki_BIS = jnp.pad(ki_BSI.astype(jnp.float32),
                   ((0, 0), (0, sp - s), (0, 0))).transpose(0, 2, 1)
  valid_BS = None
  if kv_valid_BS is not None:
    valid_BS = jnp.pad(jnp.asarray(kv_valid_BS, bool), ((0, 0), (0, sp - s)))
  tiles = causal_tiles(t, s, q_offset, q_chunk, k_chunk)
  # Tiles below the diagonal need no causal mask; only the others pay for it.
  below = (tiles[:, 0] * q_chunk + q_offset >= (tiles[:, 1] + 1) * k_chunk - 1)
  nb_chunk = k_chunk // block_size

  def tile(i, scores_TGN, qi_TGI, ki_IS, valid_S, tile_list, masked):
    c, kc = tile_list[i, 0], tile_list[i, 1]
    q_QGI = jax.lax.dynamic_slice_in_dim(qi_TGI, c * q_chunk, q_chunk)
    k_IL = jax.lax.dynamic_slice_in_dim(ki_IS, kc * k_chunk, k_chunk, axis=1)
    logits = jnp.dot(q_QGI.reshape(q_chunk * g, di), k_IL)
    logits = logits.reshape(q_chunk, g, nb_chunk, block_size)
    if masked:
      qpos = c * q_chunk + jnp.arange(q_chunk) + q_offset
      kpos = kc * k_chunk + jnp.arange(k_chunk).reshape(nb_chunk, block_size)
      visible = kpos[None, :, :] <= qpos[:, None, None]
      logits = jnp.where(visible[:, None], logits, -jnp.inf)
    if valid_S is not None:
      ok_L = jax.lax.dynamic_slice_in_dim(valid_S, kc * k_chunk, k_chunk)
      logits = jnp.where(ok_L.reshape(nb_chunk, block_size), logits, -jnp.inf)
    return jax.lax.dynamic_update_slice(
        scores_TGN, logits.max(axis=-1), (c * q_chunk, 0, kc * nb_chunk))

  def one_sequence(qi_TGI, ki_IS, valid_S):
    scores = like_inputs(
        jnp.full((tp, g, sp // block_size), -jnp.inf, jnp.float32),
        qi_TGI, ki_IS)
    for masked in (False, True):
      tile_list = jnp.asarray(tiles[below != masked])
      if tile_list.shape[0]:
        scores = jax.lax.fori_loop(0, tile_list.shape[0], functools.partial(
            tile, qi_TGI=qi_TGI, ki_IS=ki_IS, valid_S=valid_S,
            tile_list=tile_list, masked=masked), scores)
    return scores

  # A long sequence alone a step: a vmap over one sequence turns the tile
  # loop's slices into gathers (measured 1.2x slower at 16k).
  scores_BTGN = map_groups(lambda args: one_sequence(*args),
                           (qi, ki_BIS, valid_BS), tp * g * (sp // block_size))
  return (scores_BTGN[:, :t, :, :n] / math.sqrt(di)).transpose(0, 2, 1, 3)


def select_blocks_BGTK(scores_BGTN, *, block_size: int, top_k: int,
                       q_offset=0) -> jax.Array:
  """docs/design.md §6.3's selection with lax.top_k (ties to the lower index)."""
  b, g, t, n = scores_BGTN.shape
  o_B = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (b,))
  local_BT = (o_B[:, None] + jnp.arange(t, dtype=jnp.int32)) // block_size
  l = local_BT[:, None, :, None]
  ids_N = jnp.arange(n, dtype=jnp.int32)
  ranked = jnp.where(ids_N < l, scores_BGTN, -jnp.inf)
  kk = min(top_k - 1, n)
  if kk > 0:
    best_BGTK, cand_BGTK = jax.lax.top_k(ranked, kk)
    # A block with no visible valid key (all padding) is never selected.
    cand_BGTK = jnp.where(best_BGTK > -jnp.inf, cand_BGTK, -1)
  else:
    cand_BGTK = jnp.zeros((b, g, t, 0), jnp.int32)
  cand_BGTK = jnp.pad(cand_BGTK, ((0, 0), (0, 0), (0, 0), (0, top_k - kk)),
                      constant_values=-1)
  n_earlier = jnp.minimum(l, top_k - 1)
  slot_K = jnp.arange(top_k, dtype=jnp.int32)
  return jnp.where(slot_K < n_earlier, cand_BGTK,
                   jnp.where(slot_K == n_earlier, l, -1)).astype(jnp.int32)


def selection_BGTK(qi_BTGI, ki_BSI, *, block_size: int, top_k: int,
                   q_offset: int = 0, kv_valid_BS=None) -> jax.Array:
  scores = block_scores_BGTN(qi_BTGI, ki_BSI, block_size=block_size,
                             q_offset=q_offset, kv_valid_BS=kv_valid_BS)
  return jax.lax.stop_gradient(select_blocks_BGTK(
      scores, block_size=block_size, top_k=top_k, q_offset=q_offset))


# Largest block * P + pair key `pack_pairs` sorts as one int32.
SORT_KEY_LIMIT = 2**31 - 1


def pack_pairs(sel_TK, n_blocks: int, n_tiles: int, pairs_per_tile: int):
  """Sort (token, slot) pairs by block and pack them into same-block tiles.

  Returns table_MQ (pair id per tile lane, P for an empty lane), block_M (the
  key block every lane of a tile reads) and slot_P (each pair's flat lane
  index, M*Q for the -1 slots) to bring the partials back in pair order.
  """
  t, k = sel_TK.shape
  p, q = t * k, pairs_per_tile
  blk_P = jnp.where(sel_TK < 0, n_blocks, sel_TK).reshape(p)
  if (n_blocks + 1) * p <= SORT_KEY_LIMIT:
    # One int32 key, block * P + pair: a one-operand sort of unique keys,
    # in the stable order (measured 3.6x faster than argsort at 32k).
    key_P = jax.lax.sort(blk_P * p + jnp.arange(p, dtype=jnp.int32),
                         is_stable=False)
    order_P, sorted_P = key_P % p, key_P // p
  else:
    order_P = jnp.argsort(blk_P, stable=True).astype(jnp.int32)
    sorted_P = blk_P[order_P]
  count_N = jnp.bincount(blk_P, length=n_blocks + 1)[:n_blocks]
  first_N = jnp.cumsum(count_N) - count_N
  tiles_N = -(-count_N // q)
  tile0_N = jnp.cumsum(tiles_N) - tiles_N
  blk = jnp.minimum(sorted_P, n_blocks - 1)
  rank = jnp.arange(p, dtype=jnp.int32) - first_N[blk]
  valid = sorted_P < n_blocks
  tile_P = jnp.where(valid, tile0_N[blk] + rank // q, n_tiles)
  lane_P = rank % q
  table_MQ = jnp.full((n_tiles, q), p, jnp.int32).at[tile_P, lane_P].set(
      order_P, mode='drop')
  block_M = jnp.zeros((n_tiles,), jnp.int32).at[tile_P].set(blk, mode='drop')
  slot_sorted = jnp.where(valid, tile_P * q + lane_P, n_tiles * q)
  slot_P = jnp.zeros((p,), jnp.int32).at[order_P].set(slot_sorted)
  return table_MQ, block_M, slot_P


# Lanes (pairs) per loop step when the tile shape is chosen automatically.
STEP_LANES = 512
# Floats of per-pair work that one lax.map step over (sequence, group) may
# hold: long sequences go one group at a time (a 32k group alone holds
# ~300M), while short ones are vmapped many at a time, because a
# while-loop iteration per tiny group costs more than its work (measured:
# the tiny MSA config's update, 128 groups of 32 tokens, ran ~2x slower
# one group a step).
GROUP_STEP_FLOATS = 1 << 22


def groups_per_step(n_groups: int, floats_per_group: int) -> int:
  """lax.map batch size over (sequence, group) for `sparse_attention` and
  the indexer loss: as many groups as fit in GROUP_STEP_FLOATS, at least 1."""
  return int(max(1, min(n_groups, GROUP_STEP_FLOATS // max(floats_per_group,
                                                             1))))


def map_groups(fn, args, floats_per_group: int):
  """lax.map of `fn` over the leading (sequence, group) axis of `args`,
  `groups_per_step` groups a step.

  One group a step is a plain lax.map: `batch_size=1` would vmap `fn` over a
  batch of one, which turns every gather and slice in its tile loop into a
  batched one (measured: the 16k main branch 1.8x slower that way).
  """
  n_groups = jax.tree.leaves(args)[0].shape[0]
  per_step = groups_per_step(n_groups, floats_per_group)
  if per_step == 1:
    return jax.lax.map(fn, args)
  return jax.lax.map(fn, args, batch_size=per_step)


def tile_shape(n_pairs: int, n_visible: int, pairs_per_tile: int | None = None,
               tiles_per_step: int | None = None) -> tuple[int, int, int]:
  """(pairs per tile Q, tiles per step, tile count) for a query chunk.

  Every visible block may leave one part-filled tile, so Q is sized from the
  mean pairs per block (about K*C once T >> C): a quarter of it, a power of
  two in [8, 256], wastes at most ~1/4 of the lanes. Big tiles matter on
  CPU: a [Q*R, D] x [D, C] matmul with Q = 256 runs ~1.7x faster per FLOP
  than 32 batched ones with Q = 64, whose small dots XLA:CPU keeps on one
  core (measured at 8k-16k, benchmark shapes). A step holds ~STEP_LANES
  lanes; it never spans more tiles than there are.
  """
  q = pairs_per_tile
  if q is None:
    mean = n_pairs / max(n_visible, 1)
    q = int(min(256, max(8, 2 ** math.floor(math.log2(max(mean / 4, 1))))))
  # P/Q full tiles plus at most one part-filled tile per block.
  raw = -(-n_pairs // q) + n_visible
  mc = tiles_per_step
  if mc is None:
    mc = max(1, min(STEP_LANES // q, raw))
  return q, mc, _round_up(raw, mc)


def _diagonal(t: int, r: int, n: int, c: int, p0: int):
  """Layout of a chunk's tokens (positions p0..p0+t-1) on their own key
  blocks: (lead rows padded in front, first block b0, block count nb, the
  token-axis pad, the [C*R, C] causal mask of a block)."""
  lead, b0 = p0 % c, p0 // c
  nb = -(-(lead + t) // c)
  if b0 + nb > n:
    raise ValueError(f'MSA: queries up to position {p0 + t - 1} but only '
                     f'{n * c} key positions.')
  # Row x of a block is its token x // R; it sees keys up to its position.
  diag_XC = (jnp.arange(c * r)[:, None] // r) >= jnp.arange(c)[None, :]
  return lead, b0, nb, (lead, nb * c - lead - t), diag_XC


def _local_partials(q_TRD, k_NCD, v_NCD, valid_NC, has_local_T, p0: int):
  """Each token against its own (diagonal) key block: (m_TR, l_TR, o_TRD).

  The chunk's tokens are contiguous, so padded to whole blocks they line up
  with the key blocks they sit in, and every block pays the same causal
  mask: one [C*R, D] x [D, C] matmul per block, no gathers. Tokens whose
  selection lacks their own block (has_local_T False) get l = 0.
  """
  t, r, d = q_TRD.shape
  lead, b0, nb, pad, diag_XC = _diagonal(t, r, k_NCD.shape[0],
                                         k_NCD.shape[1], p0)
  c = k_NCD.shape[1]
  q_JXD = jnp.pad(q_TRD, (pad, (0, 0), (0, 0))).reshape(nb, c * r, d)
  has_JX = jnp.repeat(jnp.pad(has_local_T, pad).reshape(nb, c), r, axis=1)
  args = (q_JXD, k_NCD[b0:b0 + nb], v_NCD[b0:b0 + nb], has_JX)
  if valid_NC is not None:
    args += (valid_NC[b0:b0 + nb],)

  def one_block(args):
    q_XD, k_CD, v_CD, has_X = args[:4]
    visible_XC = diag_XC & has_X[:, None]
    if len(args) > 4:
      visible_XC = visible_XC & args[4][None, :]
    logits_XC = jnp.where(visible_XC, q_XD @ k_CD.T, MASK_VALUE)
    m_X = logits_XC.max(axis=-1)
    p_XC = jnp.where(visible_XC, jnp.exp(logits_XC - m_X[:, None]), 0.0)
    return m_X, p_XC.sum(axis=-1), p_XC @ v_CD

  m_JX, l_JX, o_JXD = jax.lax.map(one_block, args,
                                  batch_size=min(nb, LOCAL_BLOCKS_PER_STEP))
  rows = slice(lead, lead + t)
  return (m_JX.reshape(nb * c, r)[rows], l_JX.reshape(nb * c, r)[rows],
          o_JXD.reshape(nb * c, r, d)[rows])


# Diagonal blocks per step of `_local_partials`.
LOCAL_BLOCKS_PER_STEP = 4
# Tiles a loop step merges one after another (unrolled), at most.
MERGE_TILES_PER_STEP = 4


def _merge(m_QR, l_QR, o_QRD, m_part_QR, l_part_QR, o_part_QRD):
  """Running rows (m, l, o) plus one partial, by the log-sum-exp rule."""
  m_out = jnp.maximum(m_QR, m_part_QR)
  w_old, w_new = jnp.exp(m_QR - m_out), jnp.exp(m_part_QR - m_out)
  return (m_out, w_old * l_QR + w_new * l_part_QR,
          w_old[..., None] * o_QRD + w_new[..., None] * o_part_QRD)


def _plan(sel_TK, n_blocks: int, c: int, p0: int, n_visible: int,
          pairs_per_tile: int | None, tiles_per_step: int | None):
  """The chunk's pair tiles, own blocks left out: (table_MQ, block_M,
  has_local_T, (Q, tiles per step, tile count))."""
  t, k = sel_TK.shape
  sel_TK = jax.lax.stop_gradient(sel_TK)
  local_T = (p0 + jnp.arange(t, dtype=jnp.int32)) // c
  is_local_TK = sel_TK == local_T[:, None]
  far_TK = jnp.where(is_local_TK | (sel_TK > local_T[:, None]), -1, sel_TK)
  if tiles_per_step is None:
    tiles_per_step = min(MERGE_TILES_PER_STEP,
                         tile_shape(t * k, n_visible, pairs_per_tile)[1])
  shape = tile_shape(t * k, n_visible, pairs_per_tile, tiles_per_step)
  table_MQ, block_M, _ = pack_pairs(far_TK, n_blocks, shape[2], shape[0])
  return table_MQ, block_M, is_local_TK.any(axis=-1), shape


def _chunk_attention(q_TRD, k_NCD, v_NCD, valid_NC, sel_TK, t0: int,
                     q_offset: int, n_visible: int, pairs_per_tile: int | None,
                     tiles_per_step: int | None):
  """Key-centric attention of the query chunk starting at t0 (one group).

  A token's own block is the only selected block it sees in part: it goes
  to `_local_partials`, one causal diagonal pass. Every other selected
  block is wholly visible (a block after the token's own is dropped: it
  holds no visible key), so the pair tiles need no causal mask.

  A tile's lanes are Q pairs that read the same key block, so they belong
  to Q distinct tokens. A loop step computes the partial (max, sum, out) of
  its tiles in one batch, then merges tile after tile straight into those
  tokens' running rows, as flash attention merges a key tile: gather the
  rows, rescale, add, scatter back. No per-pair partials are held (P*R*D
  floats, 1.2 GB per group at 32k) nor merged afterwards: measured at
  16k-32k, the forward is 1.2x faster without.
  """
  t, r, d = q_TRD.shape
  k = sel_TK.shape[1]
  p0 = t0 + q_offset
  table_MQ, block_M, has_local_T, (q, mc, n_tiles) = _plan(
      sel_TK, k_NCD.shape[0], k_NCD.shape[1], p0, n_visible, pairs_per_tile,
      tiles_per_step)
  # Scaling the T*R query rows once, not the P*R*C logits.
  q_TRD = q_TRD * (1.0 / math.sqrt(d))
  # An empty lane writes to its own spare row t + lane, so the Q rows a
  # tile scatters to are always distinct (a unique-index scatter, whose
  # derivative is a plain gather/scatter pair). What it computes there (on
  # real rows and keys, so finite) is never read.
  spare_Q = t + jnp.arange(q, dtype=jnp.int32)

  def step(i, carry):
    table_SQ = jax.lax.dynamic_slice_in_dim(table_MQ, i * mc, mc)
    block_S = jax.lax.dynamic_slice_in_dim(block_M, i * mc, mc)

    def merge_tiles(carry):
      tok_SQ = jnp.where(table_SQ < t * k, table_SQ // k, spare_Q)
      q_SXD = q_TRD[jnp.minimum(tok_SQ, t - 1)].reshape(mc, q * r, d)
      logits_SXC = jnp.einsum('sxd,scd->sxc', q_SXD, k_NCD[block_S])
      if valid_NC is not None:
        ok_S1C = valid_NC[block_S][:, None, :]
        logits_SXC = jnp.where(ok_S1C, logits_SXC, MASK_VALUE)
      m_SX = logits_SXC.max(axis=-1)
      p_SXC = jnp.exp(logits_SXC - m_SX[..., None])
      if valid_NC is not None:
        # Padding keys weigh exactly 0, also in a row with none valid.
        p_SXC = jnp.where(ok_S1C, p_SXC, 0.0)
      l_SX = p_SXC.sum(axis=-1)
      o_SXD = jnp.einsum('sxc,scd->sxd', p_SXC, v_NCD[block_S])
      m_TR, l_TR, o_TRD = carry
      # Tiles of one step may share tokens (other blocks): merged in turn.
      for j in range(mc):
        tok_Q = tok_SQ[j]
        rows = _merge(m_TR[tok_Q], l_TR[tok_Q], o_TRD[tok_Q],
                      m_SX[j].reshape(q, r), l_SX[j].reshape(q, r),
                      o_SXD[j].reshape(q, r, d))
        m_TR, l_TR, o_TRD = (buf.at[tok_Q].set(x, unique_indices=True)
                             for buf, x in zip((m_TR, l_TR, o_TRD), rows))
      return m_TR, l_TR, o_TRD

    # Tiles fill from the front; the tile bound leaves empty ones at the end
    # (about 1/8 of them at 32k), skipped here.
    return jax.lax.cond(table_SQ[0, 0] < t * k, merge_tiles, lambda x: x,
                        carry)

  init = like_inputs((jnp.full((t + q, r), MASK_VALUE, jnp.float32),
                      jnp.zeros((t + q, r), jnp.float32),
                      jnp.zeros((t + q, r, d), jnp.float32)),
                     q_TRD, k_NCD, v_NCD, table_MQ)
  m_TR, l_TR, o_TRD = jax.lax.fori_loop(0, n_tiles // mc, step, init)
  local = _local_partials(q_TRD, k_NCD, v_NCD, valid_NC, has_local_T, p0)
  m_TR, l_TR, o_TRD = _merge(m_TR[:t], l_TR[:t], o_TRD[:t], *local)
  # A query with no valid key (only padding visible): out 0, lse -inf.
  empty = l_TR == 0.0
  l_TR = jnp.where(empty, 1.0, l_TR)
  lse_TR = jnp.where(empty, -jnp.inf, m_TR + jnp.log(l_TR))
  return o_TRD / l_TR[..., None], lse_TR


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attend(q_TRD, k_NCD, v_NCD, valid_NC, sel_TK, t0, q_offset, n_visible,
            pairs_per_tile, tiles_per_step):
  """`_chunk_attention` with a flash-attention backward (`_attend_bwd`)."""
  return _chunk_attention(q_TRD, k_NCD, v_NCD, valid_NC, sel_TK, t0,
                          q_offset, n_visible, pairs_per_tile, tiles_per_step)


def _attend_fwd(q_TRD, k_NCD, v_NCD, valid_NC, sel_TK, t0, q_offset,
                n_visible, pairs_per_tile, tiles_per_step):
  o_TRD, lse_TR = _chunk_attention(q_TRD, k_NCD, v_NCD, valid_NC, sel_TK, t0,
                                   q_offset, n_visible, pairs_per_tile,
                                   tiles_per_step)
  return (o_TRD, lse_TR), (q_TRD, k_NCD, v_NCD, valid_NC, sel_TK, o_TRD,
                           lse_TR)


def _attend_bwd(t0, q_offset, n_visible, pairs_per_tile, tiles_per_step,
                res, cts):
  """Flash attention's backward over the forward's tiles and diagonal pass.

  With p = exp(logits - lse) from the saved lse, each tile adds p^T dO to
  dV, dS^T Q to dK and dS K to dQ, dS = p * (dO.V^T - (dO.O - dlse)), all
  by scatter-adds into carried buffers. Autodiff of the forward loop
  instead accumulated each gather's cotangent into a zeroed full-size copy
  of Q, K and V every loop step (fwd+bwd at 8k, bench shapes: 19 s, against
  4.2-5.4 s this way).
  """
  q_TRD, k_NCD, v_NCD, valid_NC, sel_TK, o_TRD, lse_TR = res
  do_TRD, dlse_TR = cts
  t, r, d = q_TRD.shape
  n, c = k_NCD.shape[:2]
  k = sel_TK.shape[1]
  p0 = t0 + q_offset
  table_MQ, block_M, has_local_T, (q, mc, n_tiles) = _plan(
      sel_TK, n, c, p0, n_visible, pairs_per_tile, tiles_per_step)
  scale = 1.0 / math.sqrt(d)
  qs_TRD = q_TRD * scale
  # A row with no visible key (lse -inf), and the spare rows, get p = 0.
  lse_TR = jnp.where(jnp.isfinite(lse_TR), lse_TR, jnp.inf)
  delta_TR = (do_TRD * o_TRD).sum(axis=-1) - dlse_TR
  spare = ((0, q), (0, 0))
  lse_pad = jnp.pad(lse_TR, spare, constant_values=jnp.inf)
  delta_pad = jnp.pad(delta_TR, spare)
  do_pad = jnp.pad(do_TRD, spare + ((0, 0),))
  spare_Q = t + jnp.arange(q, dtype=jnp.int32)

  def grads(q_XD, do_XD, lse_X, delta_X, k_CD, v_CD, ok_XC):
    """(dq_XD, dk_CD, dv_CD) of one tile or diagonal block (q_XD scaled)."""
    p_XC = jnp.exp(q_XD @ k_CD.T - lse_X[:, None])
    if ok_XC is not None:
      p_XC = jnp.where(ok_XC, p_XC, 0.0)
    ds_XC = p_XC * (do_XD @ v_CD.T - delta_X[:, None])
    return ds_XC @ k_CD, ds_XC.T @ q_XD, p_XC.T @ do_XD

  def step(i, carry):
    table_SQ = jax.lax.dynamic_slice_in_dim(table_MQ, i * mc, mc)
    block_S = jax.lax.dynamic_slice_in_dim(block_M, i * mc, mc)

    def add_tiles(carry):
      dq_TRD, dk_NCD, dv_NCD = carry
      tok_SQ = jnp.where(table_SQ < t * k, table_SQ // k, spare_Q)
      rows = lambda x: x[tok_SQ].reshape(mc, q * r, *x.shape[2:])
      ok = None
      if valid_NC is not None:
        ok = jnp.broadcast_to(valid_NC[block_S][:, None, :], (mc, q * r, c))
      dq_SXD, dk_SCD, dv_SCD = jax.vmap(grads)(
          rows(jnp.pad(qs_TRD, spare + ((0, 0),))), rows(do_pad),
          rows(lse_pad), rows(delta_pad), k_NCD[block_S], v_NCD[block_S], ok)
      dq_TRD = dq_TRD.at[tok_SQ.reshape(-1)].add(
          dq_SXD.reshape(mc * q, r, d))
      return (dq_TRD, dk_NCD.at[block_S].add(dk_SCD),
              dv_NCD.at[block_S].add(dv_SCD))

    return jax.lax.cond(table_SQ[0, 0] < t * k, add_tiles, lambda x: x,
                        carry)

  init = like_inputs((jnp.zeros((t + q, r, d), jnp.float32),
                      jnp.zeros_like(k_NCD), jnp.zeros_like(v_NCD)),
                     q_TRD, k_NCD, v_NCD, do_TRD, table_MQ)
  dq_TRD, dk_NCD, dv_NCD = jax.lax.fori_loop(0, n_tiles // mc, step, init)

  # The diagonal pass, block by block as in `_local_partials`.
  lead, b0, nb, pad, diag_XC = _diagonal(t, r, n, c, p0)
  blocks = lambda x, fill=0.0: jnp.pad(
      x, (pad,) + ((0, 0),) * (x.ndim - 1), constant_values=fill).reshape(
          nb, c * r, *x.shape[2:])
  ok_JXC = diag_XC & jnp.repeat(jnp.pad(has_local_T, pad).reshape(nb, c), r,
                                axis=1)[..., None]
  if valid_NC is not None:
    ok_JXC = ok_JXC & valid_NC[b0:b0 + nb][:, None, :]
  dq_JXD, dk_JCD, dv_JCD = jax.lax.map(
      lambda a: grads(*a), (blocks(qs_TRD), blocks(do_TRD),
                            blocks(lse_TR, jnp.inf), blocks(delta_TR),
                            k_NCD[b0:b0 + nb], v_NCD[b0:b0 + nb], ok_JXC),
      batch_size=min(nb, LOCAL_BLOCKS_PER_STEP))
  dq_TRD = dq_TRD[:t] + dq_JXD.reshape(nb * c, r, d)[lead:lead + t]
  dk_NCD = dk_NCD.at[b0:b0 + nb].add(dk_JCD)
  dv_NCD = dv_NCD.at[b0:b0 + nb].add(dv_JCD)
  return dq_TRD * scale, dk_NCD, dv_NCD, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def sparse_attention(q_BTHD, k_BSGD, v_BSGD, sel_BGTK, *, block_size: int,
                     q_offset: int = 0, pairs_per_tile: int | None = None,
                     tiles_per_step: int | None = None, q_chunk: int = 16384,
                     kv_valid_BS=None):
  """Main branch over a given selection. Returns (out_BTHD, lse_BTH f32).

  pairs_per_tile / tiles_per_step: None picks them from the shapes
  (`tile_shape`, at most MERGE_TILES_PER_STEP tiles a step); the numbers do
  not depend on them.
  """
  b, t, h, d = q_BTHD.shape
  s, g = k_BSGD.shape[1:3]
  r = h // g
  n = -(-s // block_size)
  sp = n * block_size
  pad = ((0, 0), (0, sp - s), (0, 0), (0, 0))
  f32 = jnp.float32
  # [B*G, ...] so one lax.map step holds one group's working set only.
  q_XTRD = q_BTHD.astype(f32).reshape(b, t, g, r, d).transpose(0, 2, 1, 3, 4)
  q_XTRD = q_XTRD.reshape(b * g, t, r, d)
  k_XNCD = jnp.pad(k_BSGD.astype(f32), pad).transpose(0, 2, 1, 3).reshape(
      b * g, n, block_size, d)
  v_XNCD = jnp.pad(v_BSGD.astype(f32), pad).transpose(0, 2, 1, 3).reshape(
      b * g, n, block_size, d)
  sel_XTK = sel_BGTK.reshape(b * g, t, -1)
  valid_XNC = None
  if kv_valid_BS is not None:
    valid_XNC = jnp.repeat(jnp.pad(jnp.asarray(kv_valid_BS, bool),
                                   ((0, 0), (0, sp - s))).reshape(
                                       b, n, block_size), g, axis=0)
  q_chunk = min(q_chunk, t)

  def one_group(args):
    q_TRD, k_NCD, v_NCD, sel_TK = args[:4]
    valid_NC = args[4] if len(args) > 4 else None
    outs, lses = [], []
    for t0 in range(0, t, q_chunk):
      t1 = min(t0 + q_chunk, t)
      n_visible = min(n, (t1 - 1 + q_offset) // block_size + 1)
      o, lse = _attend(q_TRD[t0:t1], k_NCD, v_NCD, valid_NC,
                                sel_TK[t0:t1], t0, q_offset, n_visible,
                                pairs_per_tile, tiles_per_step)
      outs.append(o)
      lses.append(lse)
    return jnp.concatenate(outs), jnp.concatenate(lses)

  args = (q_XTRD, k_XNCD, v_XNCD, sel_XTK)
  if valid_XNC is not None:
    args += (valid_XNC,)
  out_XTRD, lse_XTR = map_groups(one_group, args,
                                 t * sel_XTK.shape[-1] * r * d)
  out_BTHD = out_XTRD.reshape(b, g, t, r, d).transpose(0, 2, 1, 3, 4).reshape(
      b, t, h, d)
  lse_BTH = lse_XTR.reshape(b, g, t, r).transpose(0, 2, 1, 3).reshape(b, t, h)
  return out_BTHD.astype(q_BTHD.dtype), lse_BTH


def msa_attention(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI, *, block_size: int,
                  top_k: int, q_offset: int = 0, kv_valid_BS=None):
  sel = selection_BGTK(qi_BTGI, ki_BSI, block_size=block_size, top_k=top_k,
                       q_offset=q_offset, kv_valid_BS=kv_valid_BS)
  out, lse = sparse_attention(q_BTHD, k_BSGD, v_BSGD, sel,
                              block_size=block_size, q_offset=q_offset,
                              kv_valid_BS=kv_valid_BS)
  return out, {'sel_BGTK': sel, 'lse_BTH': lse}


def msa_decode(q_BHD, k_cache_BSGD, v_cache_BSGD, qi_BGI, ki_cache_BSI,
               lengths_B, *, block_size: int, top_k: int, kv_valid_BS=None):
  """One token per sequence at position length-1; gathers its K blocks.

  At decode every (sequence, group) has its own K blocks and only one query
  row, so a direct gather is already minimal traffic (K*C keys).
  """
  b, h, d = q_BHD.shape
  s, g = k_cache_BSGD.shape[1:3]
  r = h // g
  di = qi_BGI.shape[-1]
  n = -(-s // block_size)
  sp = n * block_size
  off_B = lengths_B.astype(jnp.int32) - 1
  logits_BGS = jnp.einsum('bgi,bsi->bgs', qi_BGI.astype(jnp.float32),
                          ki_cache_BSI.astype(jnp.float32)) / math.sqrt(di)
  visible_BS = jnp.arange(s)[None, :] <= off_B[:, None]
  if kv_valid_BS is not None:
    visible_BS = visible_BS & jnp.asarray(kv_valid_BS, bool)
  logits_BGS = jnp.where(visible_BS[:, None], logits_BGS, -jnp.inf)
  logits_BGS = jnp.pad(logits_BGS, ((0, 0), (0, 0), (0, sp - s)),
                       constant_values=-jnp.inf)
  scores_BGN = logits_BGS.reshape(b, g, n, block_size).max(axis=-1)
  sel_BGK = select_blocks_BGTK(scores_BGN[:, :, None], block_size=block_size,
                               top_k=top_k, q_offset=off_B)[:, :, 0]
  sel_BGK = jax.lax.stop_gradient(sel_BGK)
  # Gather the K*C selected keys straight from the [B, S, G, D] cache: no
  # padded or transposed copy of the whole cache (that alone would read and
  # write all of it, what dense decode costs). Positions past S are clamped
  # and masked below.
  pos_BGKC = jnp.clip(jnp.maximum(sel_BGK, 0)[..., None] * block_size
                      + jnp.arange(block_size), 0, s - 1)
  b_idx = jnp.arange(b)[:, None, None, None]
  g_idx = jnp.arange(g)[None, :, None, None]
  k_BGKCD = k_cache_BSGD[b_idx, pos_BGKC, g_idx].astype(jnp.float32)
  v_BGKCD = v_cache_BSGD[b_idx, pos_BGKC, g_idx].astype(jnp.float32)
  # One [R, D] x [D, K*C] matmul per (sequence, group): flattening (B, G)
  # into one batch axis and (K, C) into one key axis lets XLA:CPU run a
  # plain batched matmul (measured 5x faster than the 5-d einsum).
  kc = top_k * block_size
  q_XRD = q_BHD.astype(jnp.float32).reshape(b * g, r, d)
  k_XSD = k_BGKCD.reshape(b * g, kc, d)
  v_XSD = v_BGKCD.reshape(b * g, kc, d)
  logits_XRS = jnp.einsum('xrd,xsd->xrs', q_XRD, k_XSD) / math.sqrt(d)
  kpos_BGKC = sel_BGK[..., None] * block_size + jnp.arange(block_size)
  ok_BGKC = (sel_BGK[..., None] >= 0) & (kpos_BGKC <= off_B[:, None, None,
                                                             None])
  if kv_valid_BS is not None:
    ok_BGKC = ok_BGKC & jnp.asarray(kv_valid_BS, bool)[b_idx, pos_BGKC]
  ok_X1S = ok_BGKC.reshape(b * g, 1, kc)
  logits_XRS = jnp.where(ok_X1S, logits_XRS, MASK_VALUE)
  lse_XR = jax.nn.logsumexp(logits_XRS, axis=-1)
  p_XRS = jnp.where(ok_X1S, jnp.exp(logits_XRS - lse_XR[..., None]), 0.0)
  out_XRD = jnp.einsum('xrs,xsd->xrd', p_XRS, v_XSD)
  # A query with no valid key (only padding visible): out 0, lse -inf.
  empty_X1 = ~ok_X1S.any(axis=-1)
  lse_XR = jnp.where(empty_X1, -jnp.inf, lse_XR)
  return (out_XRD.reshape(b, h, d).astype(q_BHD.dtype),
          {'sel_BGK': sel_BGK, 'lse_BH': lse_XR.reshape(b, h)})
