"""Pure-jnp reference of MiniMax Sparse Attention (docs/design.md §6).

Everything here is dense and masked on purpose: it is slow, O(T*S) memory, and
written to be read against the paper rather than to run fast. The XLA path
(`xla.py`) and the Pallas kernels are tested against it.

Pipeline (docs/design.md §6.1-6.5; point n below is §6.n):
  index logits s[g,t,j]  ->  block scores S[g,t,n] (causal block max)
  ->  selection sel[g,t,k] (local block last, ties to the lower id, -1 pad)
  ->  main branch: exact softmax over the selected, causally visible keys
  ->  indexer KL loss (index distribution vs head-averaged main attention).

Letter key for shape suffixes:
  B batch, T query tokens, S key/value tokens (kv_len), H query heads,
  G KV groups, R query heads per group (H = G * R), D head dim,
  I index head dim, N key blocks (ceil(S / block_size)),
  C tokens per key block (block_size), K selected blocks per query (top_k).

Padding keys (docs/design.md §6.9): kv_valid_BS (bool [B, S], None = all
valid) marks real keys. An invalid key gets index logit -inf (so a block's
score is the max over its valid keys, -inf when it has none, and such a
block is never selected: its slot is -1), and the main branch and the KL
never attend it. A query left with no valid key gets output 0 and lse -inf.

Head h belongs to group h // R, the layout `jax.nn.dot_product_attention`
uses for GQA. Query t sits at absolute position t + o, where the offset o is
kv_len - q_len for chunked prefill and length - 1 for decode; o may differ per
sequence ([B]).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def query_positions_BT(q_offset, batch: int, q_len: int) -> jax.Array:
  """Absolute position t + o of every query, for a scalar or per-sequence o."""
  o_B = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (batch,))
  return o_B[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]


def visible_keys_BTS(q_offset, batch: int, q_len: int, kv_len: int,
                     kv_valid_BS=None) -> jax.Array:
  """Keys a query may see at all: causal (j <= t + o) and valid."""
  pos_BT = query_positions_BT(q_offset, batch, q_len)
  visible_BTS = jnp.arange(kv_len)[None, None, :] <= pos_BT[:, :, None]
  if kv_valid_BS is not None:
    visible_BTS = visible_BTS & jnp.asarray(kv_valid_BS, bool)[:, None, :]
  return visible_BTS


def index_logits_BGTS(qi_BTGI, ki_BSI, q_offset=0,
                      kv_valid_BS=None) -> jax.Array:
  """Point 1: s = <qI, kI> / sqrt(dI) in f32, -inf where j > t + o or the
  key is padding."""
  b, t = qi_BTGI.shape[:2]
  s = ki_BSI.shape[1]
  logits_BGTS = jnp.einsum(
      'btgi,bsi->bgts', qi_BTGI.astype(jnp.float32),
      ki_BSI.astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST) / jnp.sqrt(qi_BTGI.shape[-1])
  visible_BTS = visible_keys_BTS(q_offset, b, t, s, kv_valid_BS)
  return jnp.where(visible_BTS[:, None], logits_BGTS, NEG_INF)


def block_scores_BGTN(logits_BGTS, block_size: int) -> jax.Array:
  """Point 2: max of the visible logits in each key block (-inf if none)."""
  b, g, t, s = logits_BGTS.shape
  n = -(-s // block_size)
  padded = jnp.pad(logits_BGTS, ((0, 0), (0, 0), (0, 0), (0, n * block_size - s)),
                   constant_values=NEG_INF)
  return padded.reshape(b, g, t, n, block_size).max(axis=-1)


def select_blocks_BGTK(scores_BGTN, *, block_size: int, top_k: int,
                       q_offset=0) -> jax.Array:
  """Point 3: local block in the last valid slot, top K-1 earlier blocks before it.

  The earlier blocks are ranked by a stable sort on the negated score, so equal
  scores keep the lower block id first (the tie rule); -1 pads the row when
  fewer than K blocks are visible, and takes the slot of a block whose score
  is -inf (all padding), so such a block is never selected.
  """
  b, g, t, n = scores_BGTN.shape
  local_BT = query_positions_BT(q_offset, b, t) // block_size
  ids_N = jnp.arange(n, dtype=jnp.int32)
  earlier_BGTN = ids_N[None, None, None, :] < local_BT[:, None, :, None]
  ranked = jnp.where(earlier_BGTN, scores_BGTN, NEG_INF)
  order_BGTN = jnp.argsort(-ranked, axis=-1, stable=True).astype(jnp.int32)
  best_BGTN = jnp.take_along_axis(ranked, order_BGTN, axis=-1)
  order_BGTN = jnp.where(best_BGTN > NEG_INF, order_BGTN, -1)
  # Pad with -1 columns so a row with fewer than K-1 candidates still has K-1.
  order_BGTN = jnp.pad(order_BGTN, ((0, 0), (0, 0), (0, 0), (0, top_k)),
                       constant_values=-1)
  cand_BGTK = order_BGTN[..., :top_k]
  n_earlier_BT = jnp.minimum(local_BT, top_k - 1)
  slot_K = jnp.arange(top_k, dtype=jnp.int32)
  n_e = n_earlier_BT[:, None, :, None]
  l = local_BT[:, None, :, None]
  return jnp.where(slot_K < n_e, cand_BGTK,
                   jnp.where(slot_K == n_e, l, -1)).astype(jnp.int32)


def selection_BGTK(qi_BTGI, ki_BSI, *, block_size: int, top_k: int,
                   q_offset=0, kv_valid_BS=None) -> jax.Array:
  """Points 1-3 end to end."""
  logits = index_logits_BGTS(qi_BTGI, ki_BSI, q_offset, kv_valid_BS)
  return select_blocks_BGTK(block_scores_BGTN(logits, block_size),
                            block_size=block_size, top_k=top_k,
                            q_offset=q_offset)


def allowed_keys_BGTS(sel_BGTK, kv_len: int, *, block_size: int,
                      q_offset=0, kv_valid_BS=None) -> jax.Array:
  """Mask of keys a query may attend: block selected AND causally visible
  AND valid."""
  b, g, t, _ = sel_BGTK.shape
  block_S = jnp.arange(kv_len) // block_size
  chosen_BGTS = jnp.any(sel_BGTK[..., :, None] == block_S, axis=-2)
  visible_BTS = visible_keys_BTS(q_offset, b, t, kv_len, kv_valid_BS)
  return chosen_BGTS & visible_BTS[:, None]


def attention_logits_BGRTS(q_BTHD, k_BSGD) -> jax.Array:
  """Main-branch logits q.k / sqrt(D), f32, per group and group head."""
  b, t, h, d = q_BTHD.shape
  g = k_BSGD.shape[2]
  q_BTGRD = q_BTHD.reshape(b, t, g, h // g, d).astype(jnp.float32)
  return jnp.einsum('btgrd,bsgd->bgrts', q_BTGRD, k_BSGD.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST) / jnp.sqrt(d)


def sparse_attention(q_BTHD, k_BSGD, v_BSGD, sel_BGTK, *, block_size: int,
                     q_offset=0, kv_valid_BS=None):
  """Point 4: exact softmax over the allowed keys. Returns (out_BTHD, lse_BTH).

  A query with no allowed key (only padding visible) gets out 0, lse -inf,
  and zero gradient.
  """
  b, t, h, d = q_BTHD.shape
  s, g = k_BSGD.shape[1:3]
  allowed_BGTS = allowed_keys_BGTS(sel_BGTK, s, block_size=block_size,
                                   q_offset=q_offset, kv_valid_BS=kv_valid_BS)
  any_BGT1 = allowed_BGTS.any(axis=-1, keepdims=True)
  logits = attention_logits_BGRTS(q_BTHD, k_BSGD)
  # An empty row gets finite logits 0 (then masked to p = 0), so neither its
  # value nor its gradient sees -inf - -inf.
  logits = jnp.where(allowed_BGTS[:, :, None], logits,
                     jnp.where(any_BGT1[:, :, None], NEG_INF, 0.0))
  lse_BGRT = jax.nn.logsumexp(logits, axis=-1)
  p_BGRTS = jnp.where(allowed_BGTS[:, :, None],
                      jnp.exp(logits - lse_BGRT[..., None]), 0.0)
  lse_BGRT = jnp.where(any_BGT1[:, :, None, :, 0], lse_BGRT, NEG_INF)
  out_BGRTD = jnp.einsum('bgrts,bsgd->bgrtd', p_BGRTS,
                         v_BSGD.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
  out_BTHD = out_BGRTD.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
  lse_BTH = lse_BGRT.transpose(0, 3, 1, 2).reshape(b, t, h)
  return out_BTHD.astype(q_BTHD.dtype), lse_BTH


def msa_attention(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI, *, block_size: int,
                  top_k: int, q_offset=0, kv_valid_BS=None):
  """Points 1-4: (out_BTHD, {'sel_BGTK', 'lse_BTH'})."""
  sel = selection_BGTK(qi_BTGI, ki_BSI, block_size=block_size, top_k=top_k,
                       q_offset=q_offset, kv_valid_BS=kv_valid_BS)
  out, lse = sparse_attention(q_BTHD, k_BSGD, v_BSGD, sel,
                              block_size=block_size, q_offset=q_offset,
                              kv_valid_BS=kv_valid_BS)
  return out, {'sel_BGTK': sel, 'lse_BTH': lse}


def indexer_kl_loss(q_BTHD, k_BSGD, qi_BTGI, ki_BSI, sel_BGTK, *,
                    block_size: int, q_offset=0, weight_BT=None,
                    kv_valid_BS=None) -> jax.Array:
  """Point 5: mean over (b, g, t) of KL(main || index) on the allowed keys.

  The target is the main-branch attention averaged over the group's R heads;
  it is a stop-gradient, so only the index branch (qi, ki) learns from it.
  Padding keys are not allowed keys, so neither distribution covers them; a
  query with no allowed key has KL 0.
  weight_BT: weights of the query positions instead of the plain mean:
  sum_{b,t} weight[b, t] * mean_g KL[b, g, t].
  """
  s = k_BSGD.shape[1]
  allowed_BGTS = allowed_keys_BGTS(sel_BGTK, s, block_size=block_size,
                                   q_offset=q_offset, kv_valid_BS=kv_valid_BS)
  # Empty rows get finite logits 0 (their terms are masked to 0 below).
  fill_BGTS = jnp.where(allowed_BGTS.any(axis=-1, keepdims=True), NEG_INF, 0.0)
  logits = attention_logits_BGRTS(jax.lax.stop_gradient(q_BTHD),
                                  jax.lax.stop_gradient(k_BSGD))
  logits = jnp.where(allowed_BGTS[:, :, None], logits, fill_BGTS[:, :, None])
  p_BGTS = jax.nn.softmax(logits, axis=-1).mean(axis=2)
  p_BGTS = jnp.where(allowed_BGTS, p_BGTS, 0.0)
  idx = index_logits_BGTS(qi_BTGI, ki_BSI, q_offset)
  idx = jnp.where(allowed_BGTS, idx, fill_BGTS)
  logq_BGTS = jax.nn.log_softmax(idx, axis=-1)
  safe_logp = jnp.log(jnp.where(p_BGTS > 0, p_BGTS, 1.0))
  safe_logq = jnp.where(allowed_BGTS, logq_BGTS, 0.0)
  kl_BGT = jnp.sum(p_BGTS * (safe_logp - safe_logq), axis=-1)
  if weight_BT is None:
    return kl_BGT.mean()
  return jnp.sum(kl_BGT.mean(axis=1) * jnp.asarray(weight_BT, jnp.float32))


def dense_causal_attention(q_BTHD, k_BSGD, v_BSGD, q_offset=0):
  """Plain causal GQA with an offset: what MSA must equal when K >= N."""
  b, t, h, d = q_BTHD.shape
  s = k_BSGD.shape[1]
  pos_BT = query_positions_BT(q_offset, b, t)
  causal_BTS = jnp.arange(s)[None, None, :] <= pos_BT[:, :, None]
  return jax.nn.dot_product_attention(q_BTHD, k_BSGD, v_BSGD,
                                      mask=causal_BTS[:, None])
