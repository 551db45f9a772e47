"""Decoder-only MoE transformer (Qwen3-MoE / Mixtral / OLMoE families).

Shape letters: B batch, T tokens, V vocab, M model dim, L MoE layers,
K top-k, E experts, S slots, D EP devices, n layers of one segment.

Layers are stored in *segments* (`config.layer_segments`): maximal runs of
layers of one kind (attention dense or MSA, FFN dense or MoE), each with
its parameters stacked along a leading layer axis ([n, ...] leaves under
`segments/k`). Training runs a segment as one `lax.scan` over its layers,
as MaxText's `scan_layers` does, so compile time does not grow with
depth; with a KV cache (prefill, decode) the layers run one after another
on slices of the stack, so each layer updates its own cache in place.

`__call__` takes the placement for the step's MoE layers ([L, ...] arrays)
with the slot weights the transfer engine filled for it (three [L, S, ...]
arrays), optional replayed routes [L, B, T, K] and a static capacity; it
returns the logits, the routes it used (the routing record) and MoE
statistics.

Without a KV cache (training), each layer can run under `jax.checkpoint`
(`model.remat_policy`): the backward pass recomputes what the policy does
not keep, trading compute for activation memory as MaxText's
`remat_policy` does. The numbers do not change, only what is stored.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax.model import attention, expert_parallel, layers, moe, router
from pallas_kernels import msa
from pallas_kernels.msa import distill


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
  """Routing facts and auxiliary losses of one forward.

  Per device (inside the RL step's shard_map) the counts, sums and stats
  are this device's, so that the caller can reduce them over the mesh once
  for all layers, when it needs them (`reduced`); on global arrays they
  are the batch's.
  """
  routes_LBTK: jax.Array  # int32 expert ids per MoE layer (routing record).
  counts_LE: jax.Array  # int32 assignments per expert per MoE layer.
  prob_sum_LE: jax.Array  # float32 router probabilities summed over tokens.
  num_valid_L: jax.Array  # float32 valid tokens per MoE layer.
  balance_loss: jax.Array  # float32 mean over MoE layers.
  dropped_L: jax.Array  # int32 assignments over capacity per MoE layer.
  # int32 per MoE layer: the most rows its capacity had to hold (a
  # device's received rows, or the largest cell with 'padded' dispatch).
  max_rows_L: jax.Array
  indexer_loss: jax.Array  # float32 sum over MSA layers of the indexer KL.
  # With model.msa_indexer_kl='dense' (indexer distillation): the KL and
  # the recalls of each MSA layer's selection, float32 [L_msa] each
  # (pallas_kernels/msa/distill.py); else None.
  indexer_distill: distill.DistillStats | None = None
  # With slot_fills: the MoE layers' slot buffers for the next placement
  # ((weights [L, s, X...]..., ids [L, s]) per device); else None.
  next_slots: tuple | None = None

  def reduced(self, axes) -> 'ModelAux':
    """The batch's facts from per-device ones (one reduction for all
    layers): sums over `axes`, the most rows as a max, the balance loss
    recomputed from the batch's sums. The indexer loss stays this
    device's share."""
    counts_LE, prob_sum_LE, num_valid_L, dropped_L = jax.lax.psum(
        (self.counts_LE, self.prob_sum_LE, self.num_valid_L, self.dropped_L),
        axes)
    return self._replace(
        counts_LE=counts_LE, prob_sum_LE=prob_sum_LE, num_valid_L=num_valid_L,
        balance_loss=jnp.mean(router.balance_loss_from_sums(
            prob_sum_LE, num_valid_L, counts_LE)),
        dropped_L=dropped_L, max_rows_L=jax.lax.pmax(self.max_rows_L, axes))


class Block(nnx.Module):
  """One pre-norm decoder layer: attention, then a dense or MoE FFN."""

  def __init__(self, cfg, mesh, attention_type: str, is_moe: bool, *,
               rngs: nnx.Rngs, dispatch: str = 'exact'):
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    self.attn_norm = layers.RMSNorm(cfg.d_model, eps=cfg.norm_eps,
                                    param_dtype=pdt, dtype=cdt)
    self.attn = attention.Attention(cfg, attention_type, rngs=rngs,
                                    mesh=mesh)
    self.ffn_norm = layers.RMSNorm(cfg.d_model, eps=cfg.norm_eps,
                                   param_dtype=pdt, dtype=cdt)
    self.is_moe = is_moe
    if self.is_moe:
      self.ffn = moe.MoE(cfg, mesh, rngs=rngs, dispatch=dispatch)
    else:
      self.ffn = layers.SwiGLU(cfg.d_model, cfg.dense_d_ff, rngs=rngs,
                               param_dtype=pdt, dtype=cdt)


def stacked_blocks(cfg, mesh, seg: config_lib.Segment, rngs: nnx.Rngs,
                   dispatch: str = 'exact') -> Block:
  """A segment's layers as one Block whose every leaf has a leading [n]
  layer axis (each layer initialised from its own split of the RNG)."""
  @nnx.split_rngs(splits=seg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(r):
    return Block(cfg, mesh, seg.attention, seg.moe, rngs=r, dispatch=dispatch)
  return make(rngs)


def _block_forward(block, x, positions_BT, cache, valid_BT, indexer_weight_BT,
                   moe_kw, *, capacity, cache_index):
  """One pre-norm block: x + attn(norm(x)), then + ffn(norm(x)).

  Returns (x, new cache, indexer loss, MoE aux or None); a function of its
  arguments only, so `jax.checkpoint` can wrap it.
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


def _as_f32(index_loss):
  """A layer's indexer loss (a scalar, or distillation's DistillStats)."""
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), index_loss)


def _layer(tree, i):
  return jax.tree.map(lambda a: a[i], tree)


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
    self.layer_segments = config_lib.layer_segments(cfg)
    self.segments = nnx.List([
        stacked_blocks(cfg, self.mesh, seg, rngs, dispatch)
        for seg in self.layer_segments])
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
               slot_weights=None, indexer_weight_BT=None,
               return_hidden: bool = False, slot_returns=None,
               slot_fills=None):
    """Returns (logits_BTV f32, ModelAux, new_cache or None).

    slot_weights: the MoE layers' slot weights (w_gate [L, S, M, F], w_up
    [L, S, M, F], w_down [L, S, F, M]) for `placement`; None with a
    placement gathers them from the canonical experts (the reference path).
    slot_returns: per device, with slot_weights, (the canonical experts'
    gradient sums [L, h, ...] tuple, accumulated slot gradients [L, S, ...]
    tuple, ((a device transition [L, ...], active bool []), ...) whose
    returns run in each MoE layer's backward, in order): `MoE.__call__`.
    slot_fills: per device, with slot_weights, (the slot buffers with ids
    [L, s, ...] tuple, the canonical experts [L, h, ...] tuple in the slot
    dtype, a device transition [L, ...]): each MoE layer fills its slots
    for the next placement beside its compute (`MoE.__call__`); they come
    back as `ModelAux.next_slots`.
    indexer_weight_BT: float weights of the query positions in each MSA
    layer's indexer KL (`pallas_kernels.msa.msa_indexer_kl_loss`), e.g. the
    loss mask over its sum, so padding and prompt positions do not count;
    None: the plain mean over every position.
    return_hidden: return the final normalised hidden states [B, T, M]
    in place of the logits (`unembed` maps them; a caller that needs one
    token's log-prob per position can then avoid the [B, T, V] logits).
    """
    b, t = tokens_BT.shape
    if positions_BT is None:
      start = 0 if cache_index is None else cache_index
      positions_BT = jnp.broadcast_to(start + jnp.arange(t), (b, t))
    x = self.embed(tokens_BT)
    policy = self.cfg.get('remat_policy', 'none')
    run_kw = dict(positions_BT=positions_BT, valid_BT=valid_BT,
                  indexer_weight_BT=indexer_weight_BT, capacity=capacity)
    auxes, index_losses, recalls = [], [], []
    new_cache = None if cache is None else []
    for seg, stack in zip(self.layer_segments, self.segments):
      layer_xs = self._moe_inputs(seg, placement, slot_weights,
                                  replay_routes_LBTK, slot_returns,
                                  slot_fills)
      if cache is None:
        x, (index_loss_n, aux_n) = _scan_segment(
            stack, x, layer_xs, remat_policy=policy, **run_kw)
      else:
        x, (index_loss_n, aux_n), caches = _unrolled_segment(
            stack, x, layer_xs, cache[seg.start:seg.stop], cache_index,
            seg.num_layers, **run_kw)
        new_cache.extend(caches)
      if isinstance(index_loss_n, distill.DistillStats):
        recalls.append(index_loss_n)
        index_loss_n = index_loss_n.kl
      index_losses.append(index_loss_n.sum())
      if seg.moe:
        auxes.append(aux_n)
    x = self.final_norm(x)
    cat = lambda f: jnp.concatenate([f(a) for a in auxes])
    counts_LE, prob_sum_LE, num_valid_L = (
        cat(lambda a: a.counts_E), cat(lambda a: a.prob_sum_E),
        cat(lambda a: a.num_valid))
    aux = ModelAux(
        routes_LBTK=cat(lambda a: a.ids_BTK),
        counts_LE=counts_LE, prob_sum_LE=prob_sum_LE, num_valid_L=num_valid_L,
        balance_loss=jnp.mean(router.balance_loss_from_sums(
            prob_sum_LE, num_valid_L, counts_LE)),
        dropped_L=cat(lambda a: a.stats.dropped),
        max_rows_L=cat(lambda a: a.stats.max_rows),
        indexer_loss=jnp.asarray(sum(index_losses), jnp.float32))
    if recalls:
      aux = aux._replace(indexer_distill=jax.tree.map(
          lambda *a: jnp.concatenate(a), *recalls))
    if slot_fills is not None:
      nxt = [a.next_slots for a in auxes]
      aux = aux._replace(next_slots=nxt[0] if len(nxt) == 1 else tuple(
          jnp.concatenate(x) for x in zip(*nxt)))
    out = x if return_hidden else self.unembed(x)
    return out, aux, new_cache

  def unembed(self, x_BTM):
    """float32 logits [..., V] of final hidden states."""
    if self.cfg.tie_embeddings:
      # The tied unembedding runs in float32 on the compute-dtype table.
      table = self.embed.embedding[...].astype(self.dtype)
      logits = jnp.dot(x_BTM.astype(jnp.float32), table.astype(jnp.float32).T)
    else:
      logits = self.lm_head(x_BTM)
    return logits.astype(jnp.float32)

  @staticmethod
  def _moe_inputs(seg, placement, slot_weights, replay_routes_LBTK,
                  slot_returns=None, slot_fills=None) -> dict:
    """The per-layer MoE inputs of one segment ([n, ...] each)."""
    if not seg.moe:
      return {}
    lo, hi = seg.moe_start, seg.moe_start + seg.num_layers
    xs = {}
    if placement is not None:
      xs['slot_expert_S'] = placement.slot_expert[lo:hi]
      xs['slot_share_DS'] = placement.slot_share[lo:hi]
      if slot_weights is not None:
        xs['slot_weights'] = tuple(w[lo:hi] for w in slot_weights)
        if slot_returns is not None:
          home_acc, acc, returns = slot_returns
          xs['slot_returns'] = (
              tuple(h[lo:hi] for h in home_acc),
              tuple(a[lo:hi] for a in acc),
              tuple(({k: v[lo:hi] for k, v in t.items()},
                     jnp.broadcast_to(active, (hi - lo,)))
                    for t, active in returns))
        if slot_fills is not None:
          slots, canon, t = slot_fills
          xs['slot_fills'] = (tuple(x[lo:hi] for x in slots),
                              tuple(c[lo:hi] for c in canon),
                              {k: v[lo:hi] for k, v in t.items()})
    if replay_routes_LBTK is not None:
      xs['replay_ids_BTK'] = replay_routes_LBTK[lo:hi]
    return xs

  def init_cache(self, batch: int, max_len: int):
    """One KVCache per layer for up to max_len tokens. An MSA layer's is
    as long as its decode kernels read in place (slots past max_len are
    never attended: decode is causal), so no step copies the cache."""
    cfg = self.cfg
    caches = []
    for t in config_lib.layer_attention_types(cfg):
      msa_layer = t == 'msa'
      length = (msa.decode_cache_len(max_len, block_size=cfg.msa_block_size)
                if msa_layer else max_len)
      caches.append(attention.init_kv_cache(
          batch, length, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype),
          index_dim=cfg.msa_index_dim if msa_layer else None))
    return caches


def _scan_segment(stack, x, layer_xs, *, positions_BT, valid_BT,
                  indexer_weight_BT, capacity, remat_policy):
  """One segment as a scan over its layers: (x, (index losses [n], MoE aux
  stacked [n, ...] or None))."""
  graphdef, state = nnx.split(stack)

  def body(x, xs):
    layer_state, moe_kw = xs
    block = nnx.merge(graphdef, layer_state)
    x, _, index_loss, aux = _block_forward(
        block, x, positions_BT, None, valid_BT, indexer_weight_BT, moe_kw,
        capacity=capacity, cache_index=None)
    return x, (_as_f32(index_loss), aux)

  if remat_policy != 'none':
    body = jax.checkpoint(body, policy=REMAT_POLICIES[remat_policy])
  return jax.lax.scan(body, x, (state, layer_xs))


def _unrolled_segment(stack, x, layer_xs, caches, cache_index, num_layers, *,
                      positions_BT, valid_BT, indexer_weight_BT, capacity):
  """One segment layer by layer, each with its own KV cache: (x, (index
  losses [n], MoE aux stacked or None), new caches)."""
  graphdef, state = nnx.split(stack)
  outs, new_caches = [], []
  for i in range(num_layers):
    block = nnx.merge(graphdef, _layer(state, i))
    x, c, index_loss, aux = _block_forward(
        block, x, positions_BT, caches[i], valid_BT, indexer_weight_BT,
        _layer(layer_xs, i), capacity=capacity, cache_index=cache_index)
    outs.append((_as_f32(index_loss), aux))
    new_caches.append(c)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *outs)
  return x, stacked, new_caches
