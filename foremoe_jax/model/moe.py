"""Mixture-of-experts FFN: router, canonical SwiGLU experts, optional shared expert.

Shape letters: B batch, T tokens, N = B*T, M model dim, F expert hidden dim,
E experts, K top-k, S slots, D EP devices.

The routed experts run under expert parallelism with one layer of a
`Placement` and the slot weights the transfer engine filled for it
(foremoe_jax/transfer); without a placement, each device's slots are its
canonical experts (no transfer). The layer always returns the ids it used
(the routing record), per-expert counts and the balance loss.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel, layers, router


class MoEAux(NamedTuple):
  """Per-layer routing facts. Per device (inside the RL step's shard_map)
  the counts, sums and stats are this device's, summed by the caller once
  for all layers; on global arrays they are the batch's."""
  ids_BTK: jax.Array  # int32 expert ids used (record these for replay).
  counts_E: jax.Array  # int32 assignments per expert (valid tokens).
  prob_sum_E: jax.Array  # float32 router probabilities summed over tokens.
  num_valid: jax.Array  # float32 valid tokens.
  stats: expert_parallel.DispatchStats
  # With slot_fills: the layer's slot buffers for the next placement,
  # (weights [s, X...]..., ids [s]) per device; else None.
  next_slots: Any = None


class ExpertWeight(nnx.Param):
  """Canonical expert weights [E, ...]: sharded over the 'expert' mesh axis."""


class MoE(nnx.Module):

  def __init__(self, cfg, mesh, *, rngs: nnx.Rngs, dispatch: str = 'exact'):
    m, f, e = cfg.d_model, cfg.moe_d_ff, cfg.num_experts
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    self.router = nnx.Linear(m, e, use_bias=False, param_dtype=pdt, dtype=cdt,
                             kernel_init=layers.dense_init(m), rngs=rngs)
    self.w_gate = ExpertWeight(layers.dense_init(m)(rngs.params(), (e, m, f), pdt))
    self.w_up = ExpertWeight(layers.dense_init(m)(rngs.params(), (e, m, f), pdt))
    self.w_down = ExpertWeight(layers.dense_init(f)(rngs.params(), (e, f, m), pdt))
    if cfg.num_shared_experts:
      self.shared = layers.SwiGLU(m, cfg.shared_d_ff * cfg.num_shared_experts,
                                  rngs=rngs, param_dtype=pdt, dtype=cdt)
    self.has_shared = bool(cfg.num_shared_experts)
    self.num_experts, self.top_k = e, cfg.top_k
    self.renormalize = bool(cfg.renormalize_topk)
    self.mesh = mesh
    if dispatch not in expert_parallel.DISPATCHES:
      raise ValueError(f'dispatch must be one of {expert_parallel.DISPATCHES}'
                       f', got {dispatch!r}.')
    self.dispatch = dispatch
    # The exact dispatch's exchange (dispatch_exact.EXCHANGES); None: the
    # backend's. Only the memory report sets it ('footprint').
    self.exchange = None

  def __call__(self, x_BTM, *, slot_expert_S=None, slot_share_DS=None,
               capacity: int | None = None, replay_ids_BTK=None,
               valid_BT=None, slot_weights=None, slot_returns=None,
               slot_fills=None):
    """slot_weights: (w_gate [S, M, F], w_up [S, M, F], w_down [S, F, M])
    sharded over 'expert', holding the placement's experts. Given a
    placement without them, the slots are gathered from the canonical
    experts (`expert_parallel.routed_experts`: an all-gather, kept as the
    reference path; the RL step always passes slot weights).
    slot_returns: per device, (the canonical experts' gradient sums so
    far, accumulated slot gradients, ((one layer of a device transition,
    active), ...)): the slots' gradients go home in this layer's backward,
    the sums' cotangent being the sums with what arrived added
    (`transfer.engine.returns_in_backward`; the RL update's flush, and the
    returns of the replicas the moves between micro-steps evict).
    slot_fills: per device, (this layer's slot buffers with ids, its
    canonical experts in the slot dtype, one layer of a device transition):
    the next placement's slots are filled here, beside this layer's
    compute and reading nothing it computes, and returned as
    `MoEAux.next_slots` (`transfer.engine.fill_layer_local`; the RL
    update's moves between micro-steps)."""
    b, t, m = x_BTM.shape
    n = b * t
    x_NM = x_BTM.reshape(n, m)
    valid_N = (jnp.ones((n,), bool) if valid_BT is None
               else valid_BT.reshape(n).astype(bool))
    logits_NE = self.router(x_NM).astype(jnp.float32)
    replay_NK = None if replay_ids_BTK is None else replay_ids_BTK.reshape(n, -1)
    r = router.route(logits_NE, self.top_k, renormalize=self.renormalize,
                     replay_ids_NK=replay_NK)
    num_ep = self.mesh.shape[expert_parallel.EXPERT]
    # Inside the RL step's shard_map the arrays are this device's: its
    # tokens, its slots' weights, its canonical shard.
    manual = expert_parallel.is_manual()
    # Without a placement: plain EP (identity, no redundant slots), whose slot
    # weights are exactly the local canonical shard, so no transfer at all
    # (this is the sampler's decode loop and the warm start).
    canonical_slots = slot_expert_S is None
    if canonical_slots:
      ident = placement_lib.identity_placement(1, self.num_experts, num_ep,
                                               self.num_experts // num_ep)
      slot_expert_S, slot_share_DS = ident.slot_expert[0], ident.slot_share[0]
    if capacity is None:
      per_device = n if manual else n // (
          num_ep * self.mesh.shape[expert_parallel.DATA])
      capacity = config_lib.dropless_capacity(
          self.dispatch, per_device, self.top_k, num_ep,
          len(slot_expert_S) // num_ep)
    args = (x_NM, r.ids_NK, r.gates_NK.astype(x_NM.dtype), valid_N,
            self.w_gate[...], self.w_up[...], self.w_down[...],
            jnp.asarray(slot_expert_S, jnp.int32),
            jnp.asarray(slot_share_DS, jnp.float32))
    if slot_weights is not None:
      if slot_returns is not None:
        # pylint: disable-next=g-import-not-at-top
        from foremoe_jax.transfer import engine
        home_acc, acc, returns = slot_returns
        slot_weights = engine.returns_in_backward(
            tuple(slot_weights), tuple(home_acc), acc, returns)
      args = args[:4] + tuple(slot_weights) + args[7:]
    kw = dict(capacity=capacity, dispatch=self.dispatch)
    if self.dispatch == 'exact' and self.exchange:
      kw['exchange'] = self.exchange
    if manual:
      if not (canonical_slots or slot_weights is not None):
        raise ValueError('per device, a placement needs its slot weights '
                         '(the transfer engine fills them)')
      y_NM, stats = expert_parallel.local_expert_ffn(
          *args, num_experts=self.num_experts, reduce_stats=False, **kw)
    elif canonical_slots or slot_weights is not None:
      y_NM, stats = expert_parallel.expert_parallel_ffn(
          *args, num_experts=self.num_experts, mesh=self.mesh, **kw)
    else:
      y_NM, stats = expert_parallel.routed_experts(*args, mesh=self.mesh,
                                                   **kw)
    y_BTM = y_NM.reshape(b, t, m)
    if self.has_shared:
      y_BTM = y_BTM + self.shared(x_BTM)
    counts_E = router.expert_counts(r.ids_NK, valid_N, self.num_experts)
    prob_sum_E, num_valid = router.prob_sums(r.probs_NE, valid_N)
    next_slots = None
    if slot_fills is not None:
      # pylint: disable-next=g-import-not-at-top
      from foremoe_jax.transfer import engine
      slots_l, canon_l, t_l = slot_fills
      next_slots = engine.fill_layer_local(
          jax.lax.stop_gradient(tuple(slots_l)), tuple(canon_l), t_l)
    aux = MoEAux(r.ids_NK.reshape(b, t, -1), counts_E, prob_sum_E, num_valid,
                 stats, next_slots)
    return y_BTM, aux
