"""Indexer training loss of MSA (docs/design.md §6.5), XLA implementation.

For each query t of group g, over the keys the main branch attended
(selected block AND causal):
  target  p[j] = mean over the group's R heads of exp(q.k_j / sqrt(D) - lse)
  index   log i[j] = s[j] - logsumexp over the same keys of s, s = qI.kI/sqrt(dI)
  KL(p || i) = sum_j p log p - sum_j p s + logsumexp(s) * sum_j p.
The target uses the forward's LSE and stop-gradient q, k (the backbone gets no
gradient from this loss); only qI and kI do.

It runs on the key-centric pair tiles of `xla.py`: each (token, slot) pair
reads one key block, and the three sums above are additive over pairs
(logsumexp merges by its own rule), so the loss never forms [T, K*C] rows.
The Pallas impl also uses this path; there is no loss kernel.
Padding keys (kv_valid_BS False) are outside both distributions; a query
with no valid key in its selection adds KL 0.

Letter key: B batch, T query tokens, S key tokens, H query heads, G groups,
R heads per group, D head dim, I index head dim, K selected blocks, N key
blocks, C block size, M pair tiles, Q pairs per tile.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.msa import xla

MASK_VALUE = xla.MASK_VALUE


def _group_kl_T(q_TRD, k_NCD, qi_TI, ki_NCI, sel_TK, lse_TR, valid_NC=None, *,
                q_offset: int, pairs_per_tile: int | None,
                tiles_per_step: int | None):
  t, r, d = q_TRD.shape
  n, c, di = ki_NCI.shape
  k = sel_TK.shape[1]
  n_visible = min(n, (t - 1 + q_offset) // c + 1)
  q, mc, n_tiles = xla.tile_shape(t * k, n_visible, pairs_per_tile,
                                  tiles_per_step)
  table_MQ, block_M, slot_P = xla.pack_pairs(sel_TK, n, n_tiles, q)

  def step(carry, i):
    table = jax.lax.dynamic_slice_in_dim(table_MQ, i * mc, mc)
    block = jax.lax.dynamic_slice_in_dim(block_M, i * mc, mc)
    tok = jnp.minimum(table // k, t - 1)
    kpos = block[:, None] * c + jnp.arange(c)
    ok = (kpos[:, None, :] <= (tok + q_offset)[:, :, None]) & \
        (table < t * k)[:, :, None]
    if valid_NC is not None:
      ok = ok & valid_NC[block][:, None, :]
    main = jnp.einsum('sqrd,scd->sqrc', q_TRD[tok], k_NCD[block]) / math.sqrt(d)
    # lse is -inf for a query with no valid key; its keys are all masked, so
    # the exponent is clamped there rather than evaluated at +inf.
    p = jnp.where(ok[:, :, None], jnp.exp(jnp.where(
        ok[:, :, None], main - lse_TR[tok][..., None], 0.0)), 0.0)
    p = p.mean(axis=2)
    s = jnp.einsum('sqi,sci->sqc', qi_TI[tok], ki_NCI[block]) / math.sqrt(di)
    s = jnp.where(ok, s, MASK_VALUE)
    plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
    cross = (plogp - p * jnp.where(ok, s, 0.0)).sum(axis=-1)
    return carry, (cross, p.sum(axis=-1), jax.nn.logsumexp(s, axis=-1))

  _, (cross, mass, lse_i) = jax.lax.scan(step, None,
                                         jnp.arange(n_tiles // mc))
  slot_TK = slot_P.reshape(t, k)
  used = slot_TK < n_tiles * q
  slot_TK = jnp.minimum(slot_TK, n_tiles * q - 1)
  pick = lambda x, fill: jnp.where(used, x.reshape(-1)[slot_TK], fill)
  lse_i_T = jax.nn.logsumexp(pick(lse_i, MASK_VALUE), axis=1)
  return pick(cross, 0.0).sum(axis=1) + lse_i_T * pick(mass, 0.0).sum(axis=1)


def indexer_kl_loss(q_BTHD, k_BSGD, qi_BTGI, ki_BSI, sel_BGTK, lse_BTH, *,
                    block_size: int, q_offset: int = 0,
                    pairs_per_tile: int | None = None,
                    tiles_per_step: int | None = None,
                    weight_BT=None, kv_valid_BS=None) -> jax.Array:
  """Mean over (b, g, t) of KL(head-averaged main attention || index dist).

  weight_BT: weights of the query positions instead of the plain mean:
  sum_{b,t} weight[b, t] * mean_g KL[b, g, t].
  """
  b, t, h, d = q_BTHD.shape
  s, g = k_BSGD.shape[1:3]
  r = h // g
  di = qi_BTGI.shape[-1]
  n = -(-s // block_size)
  sp = n * block_size
  f32 = jnp.float32
  sg = jax.lax.stop_gradient
  q_XTRD = sg(q_BTHD).astype(f32).reshape(b, t, g, r, d).transpose(
      0, 2, 1, 3, 4).reshape(b * g, t, r, d)
  k_XNCD = jnp.pad(sg(k_BSGD).astype(f32), ((0, 0), (0, sp - s), (0, 0), (0, 0)))
  k_XNCD = k_XNCD.transpose(0, 2, 1, 3).reshape(b * g, n, block_size, d)
  lse_XTR = sg(lse_BTH).astype(f32).reshape(b, t, g, r).transpose(
      0, 2, 1, 3).reshape(b * g, t, r)
  qi_XTI = qi_BTGI.astype(f32).transpose(0, 2, 1, 3).reshape(b * g, t, di)
  ki_BNCI = jnp.pad(ki_BSI.astype(f32), ((0, 0), (0, sp - s), (0, 0))).reshape(
      b, n, block_size, di)
  ki_XNCI = jnp.repeat(ki_BNCI, g, axis=0)
  sel_XTK = sg(sel_BGTK).reshape(b * g, t, -1)
  args = (q_XTRD, k_XNCD, qi_XTI, ki_XNCI, sel_XTK, lse_XTR)
  if kv_valid_BS is not None:
    args += (jnp.repeat(jnp.pad(jnp.asarray(kv_valid_BS, bool),
                                ((0, 0), (0, sp - s))).reshape(
                                    b, n, block_size), g, axis=0),)

  def one_group(args):
    return _group_kl_T(*args, q_offset=q_offset,
                       pairs_per_tile=pairs_per_tile,
                       tiles_per_step=tiles_per_step)

  kl_XT = xla.map_groups(one_group, args,
                         t * sel_XTK.shape[-1] * r * (d + di))
  if weight_BT is None:
    return kl_XT.mean()
  kl_BT = kl_XT.reshape(b, g, t).mean(axis=1)
  return jnp.sum(kl_BT * jnp.asarray(weight_BT, f32))
