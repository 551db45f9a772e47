"""GQA self-attention with RoPE and an optional KV cache.

The layer type picks the attention kernel: 'dense' is exact causal GQA in
jnp; 'msa' is MiniMax Sparse Attention (pallas_kernels/msa, docs/design.md §6):
an index branch (one query head per group, one shared key head, RMSNorm and
RoPE) selects top-k key blocks and the main branch attends only to them. The
index branch trains on its own KL loss, computed from a detached backbone;
with `msa_indexer_warmup` the layer keeps dense attention while the indexer
learns.

Left padding in MSA layers (docs/design.md §6.9): MSA blocks sit at fixed
positions, so a left-padded row is first shifted left by u = (leading PADs)
mod block_size columns, which puts its first real token on a block boundary
exactly as when the prompt is alone; the kernels then mask the remaining
PADs as invalid keys (whole blocks, never selected). The cache stores the
shifted row and its shift, so decode writes and reads the same layout.

Shape letters: B batch, T query tokens, S key tokens (cache length),
H query heads, G KV groups (heads), R = H / G heads per group, D head dim,
I index head dim, M model dim.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from foremoe_jax.model import layers
from pallas_kernels import msa
from pallas_kernels.msa import distill

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


class KVCache(NamedTuple):
  k_BSGD: jax.Array
  v_BSGD: jax.Array
  ki_BSI: jax.Array | None = None  # MSA index keys (MSA layers only).
  # bool [B, S]: the key at this position is a real token. A left-padded
  # prompt's PADs are written False, so later decode steps never see them.
  valid_BS: jax.Array | None = None
  # int32 [B] (MSA layers only): the row's left shift u; column c of the
  # sequence lives at cache slot c - u (module docstring).
  shift_B: jax.Array | None = None


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype=jnp.float32, index_dim: int | None = None) -> KVCache:
  shape = (batch, max_len, num_kv_heads, head_dim)
  ki = (None if index_dim is None
        else jnp.zeros((batch, max_len, index_dim), dtype))
  shift = None if index_dim is None else jnp.zeros((batch,), jnp.int32)
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), ki,
                 jnp.ones((batch, max_len), bool), shift)


def block_shift_B(valid_BT, block_size: int) -> jax.Array:
  """int32 [B]: a row's leading invalid columns mod block_size (0 for a row
  with no valid token). Shifting the row left by it puts the first real
  token on a block boundary."""
  lead_B = jnp.argmax(valid_BT, axis=1).astype(jnp.int32)
  return lead_B % block_size


def shift_left(x_BT, shift_B):
  """x'[b, j] = x[b, j + shift[b]]; zeros (False) past the row's end."""
  t = x_BT.shape[1]
  src_BT = jnp.arange(t, dtype=jnp.int32)[None, :] + shift_B[:, None]
  inside_BT = src_BT < t
  src = jnp.minimum(src_BT, t - 1).reshape(src_BT.shape + (1,) * (x_BT.ndim - 2))
  out = jnp.take_along_axis(x_BT, src, axis=1)
  return jnp.where(inside_BT.reshape(src.shape), out, jnp.zeros((), x_BT.dtype))


def shift_right(x_BT, shift_B):
  """Inverse of shift_left on the kept columns: x[b, j] = x'[b, j - shift[b]];
  zeros at the dropped leading columns (PADs)."""
  t = x_BT.shape[1]
  src_BT = jnp.arange(t, dtype=jnp.int32)[None, :] - shift_B[:, None]
  inside_BT = src_BT >= 0
  src = jnp.maximum(src_BT, 0).reshape(src_BT.shape + (1,) * (x_BT.ndim - 2))
  out = jnp.take_along_axis(x_BT, src, axis=1)
  return jnp.where(inside_BT.reshape(src.shape), out, jnp.zeros((), x_BT.dtype))


def _put_rows(cache_BS, x_B1, slot_B):
  """Write x_B1 [B, 1, ...] at cache slot slot_B[b] of each row."""
  return jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(
      c, x.astype(c.dtype), i, axis=0))(cache_BS, x_B1, slot_B)


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

  def __init__(self, cfg, layer_type: str = 'dense', *, rngs: nnx.Rngs,
               mesh=None):
    """mesh: the model's device mesh, over which an MSA layer called
    outside a shard_map runs its kernels per device (`_per_device`); None:
    as called."""
    m, h, g, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    kw = dict(use_bias=False, param_dtype=pdt, dtype=cdt, rngs=rngs)
    norm = lambda n, init=1.0: layers.RMSNorm(
        n, eps=cfg.norm_eps, param_dtype=pdt, dtype=cdt, init=init)
    self.q_proj = nnx.Linear(m, h * d, kernel_init=layers.dense_init(m), **kw)
    self.k_proj = nnx.Linear(m, g * d, kernel_init=layers.dense_init(m), **kw)
    self.v_proj = nnx.Linear(m, g * d, kernel_init=layers.dense_init(m), **kw)
    self.o_proj = nnx.Linear(h * d, m, kernel_init=layers.dense_init(h * d), **kw)
    # qk_norm_scope 'head' (Qwen3): one RMSNorm over head_dim, its scale
    # shared by every head; 'full' (OLMoE): one RMSNorm over all heads'
    # projection at once ([H * D] for q, [G * D] for k), before the split
    # into heads. The two differ in the statistics, not only the scale shape.
    self.qk_norm_full = cfg.get('qk_norm_scope', 'head') == 'full'
    if cfg.qk_norm:
      # The scales bound the logits: |q.k| / sqrt(D) <= sqrt(D) * gq * gk
      # after the norm, so their start (qk_norm_init) sets how peaked
      # attention can become in a short training (docs/design.md §6.11).
      g0 = cfg.get('qk_norm_init', 1.0)
      self.q_norm, self.k_norm = (
          (norm(h * d, g0), norm(g * d, g0)) if self.qk_norm_full
          else (norm(d, g0), norm(d, g0)))
    self.qk_norm = bool(cfg.qk_norm)
    self.layer_type = layer_type
    if layer_type == 'msa':
      i = cfg.msa_index_dim
      self.qi_proj = nnx.Linear(m, g * i, kernel_init=layers.dense_init(m), **kw)
      self.ki_proj = nnx.Linear(m, i, kernel_init=layers.dense_init(m), **kw)
      self.qi_norm, self.ki_norm = norm(i), norm(i)
      self.index_dim = i
      self.block_size, self.top_k = cfg.msa_block_size, cfg.msa_top_k
      self.indexer_warmup = bool(cfg.msa_indexer_warmup)
      # 'dense': the distillation mode (docs/design.md §6.11): attention
      # stays dense and the indexer's KL targets every causal key; the layer
      # reports the selection's recall with it.
      self.indexer_kl = cfg.get('msa_indexer_kl', 'selected')
      # The Pallas GPU kernel set (pallas_kernels/msa/api.py GPU_KERNELS).
      self.gpu_kernels = cfg.get('msa_gpu_kernels', 'kv_outer')
    self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
    self.rope_theta = cfg.rope_theta
    self.mesh = mesh

  def __call__(self, x_BTM, positions_BT, *, cache: KVCache | None = None,
               cache_index=None, indexer_weight_BT=None, valid_BT=None):
    """Returns (y_BTM, new_cache, indexer_loss).

    With a cache, positions must be cache_index + arange(T) for every row
    (prompts share one padded length). valid_BT (bool, None: all valid)
    marks real tokens: in dense layers an invalid token is never a key, which
    is how a left-padded prompt hides its PADs (positions stay the column
    index; RoPE scores depend only on offsets, so the shift is harmless). A
    query at an invalid position attends nowhere in particular: its output
    is garbage by design (finite) and must not be used. MSA layers mask
    invalid keys too, in both branches, after aligning each row's first
    valid token to a block boundary (module docstring), so a left-padded
    prompt selects, attends and trains as if alone.
    indexer_loss is 0 for dense layers; for MSA it weights query positions by
    indexer_weight_BT (None: plain mean). With msa_indexer_kl='dense' (no
    cache) it is a `distill.DistillStats` (KL over every key, recall).
    """
    b, t, _ = x_BTM.shape
    q, k = self.q_proj(x_BTM), self.k_proj(x_BTM)
    if self.qk_norm and self.qk_norm_full:
      q, k = self.q_norm(q), self.k_norm(k)
    q = q.reshape(b, t, self.num_heads, self.head_dim)
    k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x_BTM).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.qk_norm and not self.qk_norm_full:
      q, k = self.q_norm(q), self.k_norm(k)
    q = layers.apply_rope(q, positions_BT, self.rope_theta)
    k = layers.apply_rope(k, positions_BT, self.rope_theta)
    if self.layer_type == 'msa':
      qi, ki = self._index_branch(x_BTM, positions_BT)
      out, new_cache, index_loss = self._msa(
          q, k.astype(q.dtype), v.astype(q.dtype), qi, ki, positions_BT, cache,
          cache_index, indexer_weight_BT, valid_BT)
      return self.o_proj(out.reshape(b, t, -1)), new_cache, index_loss
    if cache is None:
      k_all, v_all, key_pos_BS = k, v, positions_BT
      key_valid_BS = valid_BT
      new_cache = None
    else:
      idx = jnp.asarray(cache_index, jnp.int32)
      put = lambda c, x: jax.lax.dynamic_update_slice_in_dim(
          c, x.astype(c.dtype), idx, axis=1)
      k_all, v_all = put(cache.k_BSGD, k), put(cache.v_BSGD, v)
      key_valid_BS = cache.valid_BS
      if key_valid_BS is not None:
        key_valid_BS = put(key_valid_BS, jnp.ones((b, t), bool)
                           if valid_BT is None else valid_BT)
      new_cache = KVCache(k_all, v_all, None, key_valid_BS)
      key_pos_BS = jnp.broadcast_to(jnp.arange(k_all.shape[1]),
                                    (b, k_all.shape[1]))
    k_all, v_all = k_all.astype(q.dtype), v_all.astype(q.dtype)
    mask_BTS = key_pos_BS[:, None, :] <= positions_BT[:, :, None]
    if key_valid_BS is not None:
      mask_BTS = mask_BTS & key_valid_BS[:, None, :]
    out = dense_attention(q, k_all, v_all, mask_BTS)
    return self.o_proj(out.reshape(b, t, -1)), new_cache, 0.0

  def _index_branch(self, x_BTM, positions_BT):
    """Index queries [B, T, G, I] and keys [B, T, I] from a detached backbone."""
    b, t, _ = x_BTM.shape
    # The KL trains the indexer only (docs/design.md §6.5).
    x = jax.lax.stop_gradient(x_BTM)
    qi = self.qi_norm(self.qi_proj(x).reshape(b, t, self.num_kv_heads,
                                              self.index_dim))
    ki = self.ki_norm(self.ki_proj(x))
    qi = layers.apply_rope(qi, positions_BT, self.rope_theta)
    ki = layers.apply_rope(ki[:, :, None], positions_BT, self.rope_theta)[:, :, 0]
    return qi, ki

  def _msa(self, q, k, v, qi, ki, positions_BT, cache, cache_index,
           indexer_weight_BT, valid_BT):
    """(out_BTHD, new cache or None, indexer loss) of an MSA layer."""
    b, t = q.shape[:2]
    kw = dict(block_size=self.block_size)
    if cache is not None and t == 1:  # Decode: one token against the cache.
      return self._msa_decode(q, k, v, qi, ki, positions_BT, cache, valid_BT)
    if cache is not None and not (isinstance(cache_index, int)
                                  and cache_index == 0):
      raise NotImplementedError(
          'MSA layers prefill from an empty cache (cache_index=0) or decode '
          'one token at a time; chunked prefill into a filled cache is not '
          'wired into the model.')
    # Training, or prefill from position 0: keys are this call's tokens.
    distilling = self.indexer_kl == 'dense' and cache is None
    if valid_BT is None and cache is None:
      # No mask: every key is real and no row shifts (the unpadded path).
      shift_B = kv_valid_BS = None
      qs, ks, vs, qis, kis, weight_BT = q, k, v, qi, ki, indexer_weight_BT
    else:
      valid_BT = (jnp.ones((b, t), bool) if valid_BT is None
                  else jnp.asarray(valid_BT, bool))
      shift_B = block_shift_B(valid_BT, self.block_size)
      qs, ks, vs, qis, kis, kv_valid_BS = (shift_left(x, shift_B) for x in (
          q, k, v, qi, ki, valid_BT))
      # None is the plain mean over the T columns; the columns shifted in at
      # the end are no positions of the sequence and weigh 0.
      weight_BT = (jnp.full((b, t), 1.0 / (b * t), jnp.float32)
                   if indexer_weight_BT is None else indexer_weight_BT)
      weight_BT = shift_left(jnp.asarray(weight_BT, jnp.float32), shift_B)
    if distilling:
      # The dense model's output, exactly; the indexer learns toward its
      # attention over every key, on the block layout the sparse model uses.
      stats = distill.dense_indexer_kl(
          qs, ks, qis, kis, block_size=self.block_size, top_k=self.top_k,
          weight_BT=weight_BT, kv_valid_BS=kv_valid_BS)
      mask = positions_BT[:, None, :] <= positions_BT[:, :, None]
      if valid_BT is not None:
        mask = mask & valid_BT[:, None, :]
      return dense_attention(q, k, v, mask), None, stats
    out, aux = self._per_device(
        lambda *a, **k: msa.msa_attention(*a, **k, top_k=self.top_k,
                                          gpu_kernels=self.gpu_kernels, **kw),
        qs, ks, vs, qis, kis, kv_valid_BS=kv_valid_BS)
    sg = jax.lax.stop_gradient
    index_loss = msa.msa_indexer_kl_loss(sg(qs), sg(ks), qis, kis,
                                         jax.tree.map(sg, aux),
                                         weight_BT=weight_BT,
                                         kv_valid_BS=kv_valid_BS, **kw)
    if shift_B is not None:
      out = shift_right(out, shift_B)
    if self.indexer_warmup:
      mask = positions_BT[:, None, :] <= positions_BT[:, :, None]
      if valid_BT is not None:
        mask = mask & valid_BT[:, None, :]
      out = dense_attention(q, k, v, mask)
    new_cache = None
    if cache is not None:
      put = lambda c, x: jax.lax.dynamic_update_slice_in_dim(
          c, x.astype(c.dtype), 0, axis=1)
      new_cache = KVCache(put(cache.k_BSGD, ks), put(cache.v_BSGD, vs),
                          put(cache.ki_BSI, kis),
                          put(cache.valid_BS, kv_valid_BS), shift_B)
    return out, new_cache, index_loss

  def _per_device(self, fn, *args, **kwargs):
    """fn(*args, **kwargs), every array's leading axis the batch, run on
    each device's rows inside a shard_map over the whole mesh when the MSA
    kernels are Pallas calls and this is not already per device.

    A Pallas kernel is a custom call that XLA's partitioner cannot split:
    jit'd on rows spread over the mesh (the sampler's prefill and decode,
    a sharded forward), XLA would gather every device's rows, and in
    decode the whole KV cache, to each device and run the kernel on all of
    them. The XLA path (CPU) partitions like any jnp code and runs as
    called, as does a call inside the RL step's own shard_map.
    """
    mesh, b = self.mesh, args[0].shape[0]
    if (mesh is None or mesh.size == 1 or b % mesh.size
        or jax.sharding.get_abstract_mesh().manual_axes
        or msa.api.resolve_impl('auto')[0] != 'pallas'):
      return fn(*args, **kwargs)
    rows = P(tuple(mesh.axis_names))
    # Every output varies over the rows; unchecked, because jax's Pallas
    # interpreter (the kernels on CPU, in the tests) rejects the checked
    # form's mixed varying axes.
    return jax.shard_map(lambda a, k: fn(*a, **k), mesh=mesh,
                         in_specs=rows, out_specs=rows,
                         check_vma=False)(args, kwargs)

  def _msa_decode(self, q, k, v, qi, ki, positions_BT, cache, valid_BT):
    """One token per row, written at cache slot (column - shift) of its row."""
    b = q.shape[0]
    shift_B = (jnp.zeros((b,), jnp.int32) if cache.shift_B is None
               else cache.shift_B)
    slot_B = positions_BT[:, 0].astype(jnp.int32) - shift_B
    valid_B1 = (jnp.ones((b, 1), bool) if valid_BT is None
                else jnp.asarray(valid_BT, bool))
    new_cache = KVCache(*(_put_rows(c, x, slot_B) for x, c in (
        (k, cache.k_BSGD), (v, cache.v_BSGD), (ki, cache.ki_BSI),
        (valid_B1, cache.valid_BS))), shift_B)
    k_all = new_cache.k_BSGD.astype(q.dtype)
    v_all = new_cache.v_BSGD.astype(q.dtype)
    lengths_B = slot_B + 1
    if self.indexer_warmup:
      mask = ((jnp.arange(k_all.shape[1])[None, :] < lengths_B[:, None])
              & new_cache.valid_BS)[:, None, :]
      return dense_attention(q, k_all, v_all, mask), new_cache, 0.0
    out, _ = self._per_device(
        lambda *a, **k: msa.msa_decode(*a, **k, top_k=self.top_k,
                                       block_size=self.block_size,
                                       gpu_kernels=self.gpu_kernels),
        q[:, 0], k_all, v_all, qi[:, 0], new_cache.ki_BSI, lengths_B,
        kv_valid_BS=new_cache.valid_BS)
    return out[:, None], new_cache, 0.0
