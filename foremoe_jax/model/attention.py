"""GQA self-attention with RoPE and an optional KV cache.

`attend` is the seam where the attention kernel is chosen per layer: 'dense'
is exact causal GQA in jnp; 'msa' (MiniMax Sparse Attention) plugs in from
pallas_kernels/msa.

Shape letters: B batch, T query tokens, S key tokens (cache length),
H query heads, G KV groups (heads), R = H / G heads per group, D head dim,
M model dim.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from foremoe_jax.model import layers

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


class KVCache(NamedTuple):
  k_BSGD: jax.Array
  v_BSGD: jax.Array


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype=jnp.float32) -> KVCache:
  shape = (batch, max_len, num_kv_heads, head_dim)
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def dense_attention(q_BTHD, k_BSGD, v_BSGD, mask_BTS):
  """Exact softmax GQA attention; mask True where a query may see a key."""
  b, t, h, d = q_BTHD.shape
  g = k_BSGD.shape[2]
  q_BTGRD = q_BTHD.reshape(b, t, g, h // g, d)
  logits = jnp.einsum('btgrd,bsgd->bgrts', q_BTGRD, k_BSGD,
                      preferred_element_type=jnp.float32) * d ** -0.5
  logits = jnp.where(mask_BTS[:, None, None], logits, _NEG)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_BSGD.dtype)
  out = jnp.einsum('bgrts,bsgd->btgrd', probs, v_BSGD)
  return out.reshape(b, t, h, d)


class Attention(nnx.Module):

  def __init__(self, cfg, layer_type: str = 'dense', *, rngs: nnx.Rngs):
    m, h, g, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    kw = dict(use_bias=False, param_dtype=pdt, rngs=rngs)
    self.q_proj = nnx.Linear(m, h * d, kernel_init=layers.dense_init(m), **kw)
    self.k_proj = nnx.Linear(m, g * d, kernel_init=layers.dense_init(m), **kw)
    self.v_proj = nnx.Linear(m, g * d, kernel_init=layers.dense_init(m), **kw)
    self.o_proj = nnx.Linear(h * d, m, kernel_init=layers.dense_init(h * d), **kw)
    if cfg.qk_norm:
      self.q_norm = layers.RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt)
      self.k_norm = layers.RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt)
    self.qk_norm = bool(cfg.qk_norm)
    self.layer_type = layer_type
    self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
    self.rope_theta = cfg.rope_theta

  def __call__(self, x_BTM, positions_BT, *, cache: KVCache | None = None,
               cache_index=None):
    """Returns (y_BTM, new_cache). With a cache, positions must be
    cache_index + arange(T) for every row (prompts share one length)."""
    b, t, _ = x_BTM.shape
    q = self.q_proj(x_BTM).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x_BTM).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x_BTM).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = layers.apply_rope(q, positions_BT, self.rope_theta)
    k = layers.apply_rope(k, positions_BT, self.rope_theta)
    if cache is None:
      k_all, v_all, key_pos_BS = k, v, positions_BT
      new_cache = None
    else:
      idx = jnp.asarray(cache_index, jnp.int32)
      k_all = jax.lax.dynamic_update_slice_in_dim(cache.k_BSGD, k.astype(
          cache.k_BSGD.dtype), idx, axis=1)
      v_all = jax.lax.dynamic_update_slice_in_dim(cache.v_BSGD, v.astype(
          cache.v_BSGD.dtype), idx, axis=1)
      new_cache = KVCache(k_all, v_all)
      key_pos_BS = jnp.broadcast_to(jnp.arange(k_all.shape[1]),
                                    (b, k_all.shape[1]))
    mask_BTS = key_pos_BS[:, None, :] <= positions_BT[:, :, None]
    out = self.attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask_BTS)
    return self.o_proj(out.reshape(b, t, -1)), new_cache

  def attend(self, q_BTHD, k_BSGD, v_BSGD, mask_BTS):
    if self.layer_type == 'dense':
      return dense_attention(q_BTHD, k_BSGD, v_BSGD, mask_BTS)
    raise NotImplementedError(
        f'attention layer type {self.layer_type!r} is not wired into the model.')
