"""Decoder-only MoE transformer (Qwen3-MoE / Mixtral / OLMoE families).

Shape letters: B batch, T tokens, V vocab, M model dim, L MoE layers,
K top-k, E experts, S slots, D EP devices.

`__call__` takes the placement for the step's MoE layers ([L, ...] arrays)
with, per MoE layer, the slot weights the transfer engine filled for it,
optional replayed routes [L, B, T, K] and a static capacity; it returns the
logits, the routes it used (the routing record) and MoE statistics.

Without a KV cache (training), each block can run under `nnx.remat`
(`model.remat_policy`): the backward pass recomputes what the policy does not
keep, trading compute for activation memory as MaxText's `remat_policy`
does. The numbers do not change, only what is stored.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax.model import attention, expert_parallel, layers, moe


# model.remat_policy -> what the backward pass keeps of a block's forward.
# 'full': nothing but the block input; 'minimal': also the outputs of
# matmuls without batch dimensions (the projections and expert GEMMs), as
# MaxText's 'minimal'; 'dots': every dot output, batched ones included.
REMAT_POLICIES = {
    'full': None,
    'minimal': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    'dots': jax.checkpoint_policies.checkpoint_dots,
}
assert set(REMAT_POLICIES) | {'none'} == set(config_lib.REMAT_POLICIES)


class ModelAux(NamedTuple):
  routes_LBTK: jax.Array  # int32 expert ids per MoE layer (routing record).
  counts_LE: jax.Array  # int32 assignments per expert per MoE layer.
  balance_loss: jax.Array  # float32 mean over MoE layers.
  dropped_L: jax.Array  # int32 assignments over capacity per MoE layer.
  # int32 per MoE layer: the most rows its capacity had to hold (a
  # device's received rows, or the largest cell with 'padded' dispatch).
  max_rows_L: jax.Array
  indexer_loss: jax.Array  # float32 sum over MSA layers of the indexer KL.


class Block(nnx.Module):

  def __init__(self, cfg, mesh, layer_idx: int, attention_type: str, *,
               rngs: nnx.Rngs, dispatch: str = 'exact'):
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    self.attn_norm = layers.RMSNorm(cfg.d_model, eps=cfg.norm_eps,
                                    param_dtype=pdt, dtype=cdt)
    self.attn = attention.Attention(cfg, attention_type, rngs=rngs)
    self.ffn_norm = layers.RMSNorm(cfg.d_model, eps=cfg.norm_eps,
                                   param_dtype=pdt, dtype=cdt)
    self.is_moe = layer_idx >= cfg.first_dense_layers
    if self.is_moe:
      self.ffn = moe.MoE(cfg, mesh, rngs=rngs, dispatch=dispatch)
    else:
      self.ffn = layers.SwiGLU(cfg.d_model, cfg.dense_d_ff, rngs=rngs,
                               param_dtype=pdt, dtype=cdt)


def _block_forward(block, x, positions_BT, cache, valid_BT, indexer_weight_BT,
                   moe_kw, *, capacity, cache_index):
  """One pre-norm block: x + attn(norm(x)), then + ffn(norm(x)).

  Returns (x, new cache, indexer loss, MoE aux or None); a function of its
  arguments only, so `nnx.remat` can wrap it.
  """
  h, c, index_loss = block.attn(block.attn_norm(x), positions_BT, cache=cache,
                                cache_index=cache_index,
                                indexer_weight_BT=indexer_weight_BT,
                                valid_BT=valid_BT)
  x = x + h
  hn = block.ffn_norm(x)
  aux = None
  if block.is_moe:
    h, aux = block.ffn(hn, capacity=capacity, valid_BT=valid_BT, **moe_kw)
  else:
    h = block.ffn(hn)
  return x + h, c, index_loss, aux


class Transformer(nnx.Module):

  def __init__(self, cfg, mesh=None, *, rngs: nnx.Rngs,
               dispatch: str = 'exact'):
    """dispatch: the MoE layers' expert dispatch (`parallel.dispatch`)."""
    self.cfg = cfg
    self.mesh = expert_parallel.make_mesh(1, 1) if mesh is None else mesh
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=pdt,
                           dtype=cdt,
                           # Row norm ~1: with tied embeddings the initial
                           # logits are ~N(0, 1), not saturated.
                           embedding_init=layers.dense_init(cfg.d_model),
                           rngs=rngs)
    types = config_lib.layer_attention_types(cfg)
    self.blocks = nnx.List([Block(cfg, self.mesh, i, types[i], rngs=rngs,
                                  dispatch=dispatch)
                            for i in range(cfg.num_layers)])
    self.final_norm = layers.RMSNorm(cfg.d_model, eps=cfg.norm_eps,
                                     param_dtype=pdt, dtype=cdt)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                param_dtype=pdt, dtype=cdt,
                                kernel_init=layers.dense_init(cfg.d_model),
                                rngs=rngs)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, tokens_BT, *, positions_BT=None, valid_BT=None,
               placement=None, replay_routes_LBTK=None,
               capacity: int | None = None, cache=None, cache_index=None,
               slot_weights_L=None, indexer_weight_BT=None):
    """Returns (logits_BTV f32, ModelAux, new_cache or None).

    indexer_weight_BT: float weights of the query positions in each MSA
    layer's indexer KL (`pallas_kernels.msa.msa_indexer_kl_loss`), e.g. the
    loss mask over its sum, so padding and prompt positions do not count;
    None: the plain mean over every position.
    """
    b, t = tokens_BT.shape
    if positions_BT is None:
      start = 0 if cache_index is None else cache_index
      positions_BT = jnp.broadcast_to(start + jnp.arange(t), (b, t))
    x = self.embed(tokens_BT)
    moe_auxes, new_cache, index_losses, moe_idx = [], [], [], 0
    def run(*args):
      return _block_forward(*args, capacity=capacity, cache_index=cache_index)
    policy = self.cfg.get('remat_policy', 'none')
    if cache is None and policy != 'none':
      run = nnx.remat(run, policy=REMAT_POLICIES[policy])
    for i, block in enumerate(self.blocks):
      moe_kw = {}
      if block.is_moe:
        if placement is not None:
          moe_kw = dict(slot_expert_S=placement.slot_expert[moe_idx],
                        slot_share_DS=placement.slot_share[moe_idx])
          if slot_weights_L is not None:
            moe_kw['slot_weights'] = slot_weights_L[moe_idx]
        if replay_routes_LBTK is not None:
          moe_kw['replay_ids_BTK'] = replay_routes_LBTK[moe_idx]
        moe_idx += 1
      x, c, index_loss, moe_aux = run(
          block, x, positions_BT, None if cache is None else cache[i],
          valid_BT, indexer_weight_BT, moe_kw)
      new_cache.append(c)
      index_losses.append(index_loss)
      if moe_aux is not None:
        moe_auxes.append(moe_aux)
    x = self.final_norm(x)
    if self.cfg.tie_embeddings:
      # The tied unembedding runs in float32 on the compute-dtype table.
      table = self.embed.embedding[...].astype(self.dtype)
      logits = jnp.dot(x.astype(jnp.float32), table.astype(jnp.float32).T)
    else:
      logits = self.lm_head(x)
    aux = ModelAux(
        routes_LBTK=jnp.stack([a.ids_BTK for a in moe_auxes]),
        counts_LE=jnp.stack([a.counts_E for a in moe_auxes]),
        balance_loss=jnp.mean(jnp.stack([a.balance_loss for a in moe_auxes])),
        dropped_L=jnp.stack([a.stats.dropped for a in moe_auxes]),
        max_rows_L=jnp.stack([a.stats.max_rows for a in moe_auxes]),
        indexer_loss=jnp.asarray(sum(index_losses), jnp.float32))
    return logits.astype(jnp.float32), aux, (None if cache is None else new_cache)

  def init_cache(self, batch: int, max_len: int):
    cfg = self.cfg
    return [attention.init_kv_cache(
        batch, max_len, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype),
        index_dim=cfg.msa_index_dim if t == 'msa' else None)
            for t in config_lib.layer_attention_types(cfg)]
