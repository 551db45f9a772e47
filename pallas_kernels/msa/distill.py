"""Indexer distillation toward dense attention (docs/design.md §6.11), XLA.

Turning a dense checkpoint into MSA starts with an index branch that has
never seen the model's attention. Its training loss in the sparse model
(`indexer_loss.py`) compares distributions only over the blocks the index
branch itself selected, so a block it wrongly leaves out never gets a
gradient that would bring it in. While the main branch still runs dense, the
target can cover every key instead:

  target  p[j] = mean over the group's R heads of softmax_j(q.k_j / sqrt(D))
  index   i[j] = softmax_j(qI.kI_j / sqrt(dI))
  KL(p || i) over every causal, valid key j,

with q, k detached (only qI, kI learn). It is the dense warm-up of
DeepSeek's sparse attention and equals `reference.indexer_kl_loss` with
every block selected. Its companion, the selection's **recall**, is what the
sparse model keeps: the share of p that falls in the blocks the index branch
selects (top-k by block max, the local block always in), 1 for a perfect
indexer. `recall_far` counts only queries that see more than top_k blocks;
the others select every block they see and have recall 1 whatever the
indexer does.

Queries are processed in chunks of `q_chunk` under jax.checkpoint, so memory
is O(B x H x q_chunk x S), not O(T x S), in the forward and the backward.

Letter key: B batch, T query tokens, S key tokens, H query heads, G groups,
R heads per group, D head dim, I index head dim, K selected blocks, N key
blocks, C block size, Q queries of one chunk.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.msa import xla


class DistillStats(NamedTuple):
  """Weighted means over query positions (weights as `indexer_kl_loss`)."""
  kl: jax.Array  # sum_{b,t} w[b,t] * mean_g KL(p || i): the training loss.
  recall: jax.Array  # weighted mean of the selected blocks' share of p.
  recall_far: jax.Array  # the same over queries seeing > top_k blocks.
  # The best any selection of top_k blocks (the local one included) could
  # keep, over the far queries: the ceiling of recall_far for this model,
  # block size and top_k. (Each recall is NaN when no query counts.)
  recall_far_oracle: jax.Array


def _chunk_stats(q_BQGRD, k_BSGD, qi_BQGI, ki_BSI, sel_BGQK, visible_BQS,
                 pos_Q, *, block_size: int, top_k: int):
  """Per-query (KL, selected mass, best top_k mass, visible blocks) of one
  query chunk [B, Q]."""
  d, di = q_BQGRD.shape[-1], qi_BQGI.shape[-1]
  s = k_BSGD.shape[1]
  f32 = jnp.float32
  vis = visible_BQS[:, None]  # [B, 1, Q, S]
  logits = jnp.einsum('bqgrd,bsgd->bgrqs', q_BQGRD.astype(f32),
                      k_BSGD.astype(f32)) / math.sqrt(d)
  logits = jnp.where(vis[:, :, None], logits, xla.MASK_VALUE)
  p_BGQS = jnp.where(vis, jax.nn.softmax(logits, axis=-1).mean(axis=2), 0.0)
  idx = jnp.einsum('bqgi,bsi->bgqs', qi_BQGI.astype(f32),
                   ki_BSI.astype(f32)) / math.sqrt(di)
  logq = jax.nn.log_softmax(jnp.where(vis, idx, xla.MASK_VALUE), axis=-1)
  # A query with no visible key (a PAD) has p = 0 everywhere: KL 0.
  logp = jnp.log(jnp.where(p_BGQS > 0, p_BGQS, 1.0))
  kl_BGQ = jnp.sum(p_BGQS * (logp - jnp.where(vis, logq, 0.0)), axis=-1)
  block_S = jnp.arange(s, dtype=jnp.int32) // block_size
  chosen_BGQS = jnp.any(sel_BGQK[..., :, None] == block_S, axis=-2)
  mass_BGQ = jnp.sum(jnp.where(chosen_BGQS, p_BGQS, 0.0), axis=-1)
  n = -(-s // block_size)
  pad = n * block_size - s
  blocks_BQ = jnp.pad(visible_BQS, ((0, 0), (0, 0), (0, pad))).reshape(
      visible_BQS.shape[:2] + (n, block_size)).any(-1).sum(-1)
  # The oracle: the local block's mass plus the top_k - 1 largest earlier
  # blocks' (later blocks hold no mass: causal).
  mass_BGQN = jax.lax.stop_gradient(jnp.pad(
      p_BGQS, ((0, 0), (0, 0), (0, 0), (0, pad))).reshape(
          p_BGQS.shape[:3] + (n, block_size)).sum(-1))
  is_local_QN = (jnp.arange(n)[None, :] == (pos_Q // block_size)[:, None])
  local_BGQ = jnp.sum(jnp.where(is_local_QN, mass_BGQN, 0.0), axis=-1)
  best_BGQ = local_BGQ
  if top_k > 1:
    earlier = jnp.where(is_local_QN, 0.0, mass_BGQN)
    best_BGQ = best_BGQ + jax.lax.top_k(earlier, min(top_k - 1, n))[0].sum(-1)
  return (kl_BGQ.mean(axis=1), jax.lax.stop_gradient(mass_BGQ.mean(axis=1)),
          best_BGQ.mean(axis=1), blocks_BQ)


def dense_indexer_kl(q_BTHD, k_BSGD, qi_BTGI, ki_BSI, *, block_size: int,
                     top_k: int, weight_BT=None, kv_valid_BS=None,
                     q_chunk: int = 128) -> DistillStats:
  """The dense-target indexer KL and the selection's recall (module doc).

  Training tokens from position 0 (keys = queries' sequence, S = T).
  weight_BT: weights of the query positions (None: the plain mean over
  B x T); a position with weight 0 counts in neither the KL nor the recall.
  Gradients reach qi and ki only.
  """
  b, t, h, d = q_BTHD.shape
  s, g = k_BSGD.shape[1:3]
  r = h // g
  sg = jax.lax.stop_gradient
  sel_BGTK = xla.selection_BGTK(sg(qi_BTGI), sg(ki_BSI), block_size=block_size,
                                top_k=top_k, kv_valid_BS=kv_valid_BS)
  w_BT = (jnp.full((b, t), 1.0 / (b * t), jnp.float32) if weight_BT is None
          else jnp.asarray(weight_BT, jnp.float32))
  qc = min(q_chunk, t)
  tp = -(-t // qc) * qc
  pad_t = lambda x, axis=1: jnp.pad(
      x, [(0, tp - t) if i == axis else (0, 0) for i in range(x.ndim)])
  q_BTGRD = pad_t(sg(q_BTHD).reshape(b, t, g, r, d))
  qi_BTGI_p = pad_t(qi_BTGI)
  sel_BGTK = pad_t(sel_BGTK, axis=2)
  visible_BTS = jnp.arange(s)[None, None, :] <= jnp.arange(tp)[None, :, None]
  visible_BTS = jnp.broadcast_to(visible_BTS, (b, tp, s))
  if kv_valid_BS is not None:
    visible_BTS = visible_BTS & jnp.asarray(kv_valid_BS, bool)[:, None, :]
  k_BSGD = sg(k_BSGD)

  @jax.checkpoint
  def chunk(xs):
    q_c, qi_c, sel_c, vis_c, pos_c = xs
    return _chunk_stats(q_c, k_BSGD, qi_c, ki_BSI, sel_c, vis_c, pos_c,
                        block_size=block_size, top_k=top_k)

  split = lambda x, axis=1: jnp.moveaxis(
      x.reshape(x.shape[:axis] + (tp // qc, qc) + x.shape[axis + 1:]), axis, 0)
  kl_CBQ, mass_CBQ, best_CBQ, blocks_CBQ = jax.lax.map(
      chunk, (split(q_BTGRD), split(qi_BTGI_p), split(sel_BGTK, axis=2),
              split(visible_BTS), jnp.arange(tp).reshape(tp // qc, qc)))
  merge = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, tp)[:, :t]
  kl_BT, mass_BT, best_BT, blocks_BT = (
      merge(kl_CBQ), merge(mass_CBQ), merge(best_CBQ), merge(blocks_CBQ))
  counts_BT = (w_BT > 0) & (blocks_BT > 0)
  far_BT = counts_BT & (blocks_BT > top_k)
  def wmean(x_BT, m_BT):  # NaN when no query counts: not measured, not 0.
    den = jnp.sum(jnp.where(m_BT, w_BT, 0.0))
    num = jnp.sum(jnp.where(m_BT, w_BT * x_BT, 0.0))
    return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), jnp.nan)

  return DistillStats(kl=jnp.sum(kl_BT * w_BT),
                      recall=wmean(mass_BT, counts_BT),
                      recall_far=wmean(mass_BT, far_BT),
                      recall_far_oracle=wmean(best_BT, far_BT))
