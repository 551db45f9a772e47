"""The pure-functional RL step: GRPO with rollout routing replay (R3).

`rl_step(state, batch, plan) -> (state, metrics)` is one jit-compiled function
of arrays: it recomputes old (and reference) log-probs with the rollout's
routes replayed, turns rewards into group advantages, runs the M update
micro-steps as a `lax.scan` that accumulates gradients, micro-step m using
placement m of the plan, and applies one optax update to the canonical
parameters. The host (trainer.py) only prepares arrays and plans.

Shape letters: B samples in the step, M micro-steps, b = B / M samples per
micro-step, T tokens per sample (prompt + completion), L MoE layers, K top-k,
S slots, D EP devices.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax import placement as placement_lib
from foremoe_jax.rl import grpo


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['params', 'opt_state', 'ref_params', 'step'],
                   meta_fields=['graphdef'])
@dataclasses.dataclass(frozen=True)
class TrainState:
  graphdef: Any  # nnx.GraphDef: static, hashable.
  params: Any  # nnx.State of the model (canonical experts included).
  opt_state: Any
  ref_params: Any  # Reference policy for the KL term, or None.
  step: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['placement'], meta_fields=['capacity'])
@dataclasses.dataclass(frozen=True)
class StepPlan:
  """Placement per micro-step ([M, L, ...] arrays) and one static capacity.

  The scan over micro-steps needs one buffer shape, so capacity is the
  smallest bucket that drops nothing in *any* micro-step of the step.
  """
  placement: placement_lib.Placement
  capacity: int


def make_optimizer(learning_rate: float, grad_clip: float,
                   weight_decay: float = 0.0) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(learning_rate, weight_decay=weight_decay))


def init_train_state(graphdef, params, tx, mesh, *, with_ref: bool
                     ) -> TrainState:
  """A state whose every leaf already has the sharding the step returns.

  Leaves created on one device (optimizer counters, the step) are
  replicated over the mesh up front; otherwise the second call of the jitted
  step would see new input shardings and compile again.
  """
  ref = jax.tree.map(jnp.copy, params) if with_ref else None
  state = TrainState(graphdef, params, tx.init(params), ref,
                     jnp.zeros((), jnp.int32))
  replicated = NamedSharding(mesh, P())

  def place(x):
    if isinstance(getattr(x, 'sharding', None), NamedSharding):
      return x
    return jax.device_put(x, replicated)
  return jax.tree.map(place, state)


def token_logp(graphdef, params, tokens_bT, valid_bT, placement, routes_LbTK,
               capacity):
  """Log-probs of tokens[:, 1:] given tokens[:, :-1], with replayed routes.

  routes_LbTK covers the T-1 input positions (None: route freshly).
  Returns (logp_bT1, ModelAux).
  """
  model = nnx.merge(graphdef, params)
  inputs, targets = tokens_bT[:, :-1], tokens_bT[:, 1:]
  logits, aux, _ = model(inputs, valid_BT=valid_bT[:, :-1], placement=placement,
                         replay_routes_LBTK=routes_LbTK, capacity=capacity)
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0], aux


def _split_microbatches(x_B, microbatches_Mb):
  return jnp.take(x_B, microbatches_Mb, axis=0)


def accumulate_grads(state: TrainState, batch: dict, plan: StepPlan, *,
                     num_generations: int, eps_low: float, eps_high: float,
                     beta: float, indexer_loss_coef: float = 1.0,
                     balance_loss_coef: float = 0.0):
  """Recompute, advantages, and the scan over micro-steps; (grads, metrics).

  batch: dict with
    tokens_BT int32, valid_BT bool (real tokens), loss_mask_BT float32 over
    the T-1 target positions (completion tokens incl. EOS), routes_LBTK int
    (the routing record over the T-1 input positions), rewards_B float32,
    microbatches_Mb int32 (sample indices per micro-step), and optionally
    rollout_logp_BT (the sampler's log-probs, to report the replay gap).
  Gradients are a plain sum over micro-steps: the loss divides by the whole
  step's sequence count, so any composition gives the full-batch gradient.
  """
  mb = batch['microbatches_Mb']
  num_total = mb.size
  split = lambda x: _split_microbatches(x, mb)
  toks_MbT = split(batch['tokens_BT'])
  valid_MbT = split(batch['valid_BT'])
  mask_MbT = split(batch['loss_mask_BT'])
  routes_MLbTK = jnp.moveaxis(
      jnp.take(batch['routes_LBTK'].astype(jnp.int32), mb, axis=1), 1, 0)
  adv_B = grpo.group_advantages(batch['rewards_B'], num_generations)
  adv_Mb = split(adv_B)
  per_step = (toks_MbT, valid_MbT, routes_MLbTK, plan.placement)

  def recompute(params):
    def body(_, xs):
      toks, valid, routes, placement = xs
      logp, _ = token_logp(state.graphdef, params, toks, valid, placement,
                           routes, plan.capacity)
      return None, logp
    return jax.lax.scan(body, None, per_step)[1]

  old_logp_MbT = jax.lax.stop_gradient(recompute(state.params))
  ref_logp_MbT = (jax.lax.stop_gradient(recompute(state.ref_params))
                  if state.ref_params is not None else None)

  def micro_loss(params, toks, valid, routes, placement, mask, adv, old, ref):
    logp, aux = token_logp(state.graphdef, params, toks, valid, placement,
                           routes, plan.capacity)
    loss, metrics = grpo.policy_loss(
        logp, old, ref, adv, mask, eps_low=eps_low, eps_high=eps_high,
        beta=beta if ref is not None else 0.0, num_sequences_total=num_total)
    # MSA indexer KL (0 without MSA layers) and the MoE balance loss, each
    # weighted by this micro-batch's share of sequences so that the sum over
    # micro-steps is the step mean.
    share = toks.shape[0] / num_total
    index_loss = aux.indexer_loss * share
    balance = aux.balance_loss * share
    metrics['indexer_loss'] = jax.lax.stop_gradient(index_loss)
    metrics['balance_loss'] = jax.lax.stop_gradient(balance)
    metrics['dropped'] = aux.dropped_L.sum()
    metrics['max_cell'] = aux.max_cell_L.max()
    return (loss + indexer_loss_coef * index_loss
            + balance_loss_coef * balance), metrics

  grad_fn = jax.grad(micro_loss, has_aux=True)
  has_ref = ref_logp_MbT is not None

  def body(grads, xs):
    toks, valid, routes, placement, mask, adv, old, ref = xs
    g, metrics = grad_fn(state.params, toks, valid, routes, placement, mask,
                         adv, old, ref if has_ref else None)
    return jax.tree.map(jnp.add, grads, g), metrics

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  ref_xs = ref_logp_MbT if has_ref else old_logp_MbT  # Unused without a ref.
  grads, metrics_M = jax.lax.scan(
      body, zeros, (*per_step, mask_MbT, adv_Mb, old_logp_MbT, ref_xs))
  metrics = {k: v.sum() for k, v in metrics_M.items()
             if k not in ('dropped', 'max_cell')}
  metrics.update(dropped=metrics_M['dropped'].sum(),
                 max_cell_M=metrics_M['max_cell'],
                 adv_abs_mean=jnp.abs(adv_B).mean())
  if 'rollout_logp_BT' in batch:
    gap = jnp.where(mask_MbT > 0, old_logp_MbT - split(batch['rollout_logp_BT']),
                    0.0)
    metrics['rollout_vs_recompute_logp_max_abs'] = jnp.abs(gap).max()
  return grads, metrics


def make_rl_step(tx: optax.GradientTransformation, *, num_generations: int,
                 eps_low: float, eps_high: float, beta: float,
                 indexer_loss_coef: float = 1.0,
                 balance_loss_coef: float = 0.0):
  """Builds the jit-compiled pure `rl_step(state, batch, plan)`."""

  def rl_step(state: TrainState, batch: dict, plan: StepPlan):
    grads, metrics = accumulate_grads(
        state, batch, plan, num_generations=num_generations, eps_low=eps_low,
        eps_high=eps_high, beta=beta, indexer_loss_coef=indexer_loss_coef,
        balance_loss_coef=balance_loss_coef)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics['grad_norm'] = optax.tree.norm(grads)
    new_state = dataclasses.replace(state, params=params, opt_state=opt_state,
                                    step=state.step + 1)
    return new_state, metrics

  return jax.jit(rl_step, donate_argnums=0)


def make_sft_step(tx: optax.GradientTransformation,
                  indexer_loss_coef: float = 1.0,
                  balance_loss_coef: float = 0.0):
  """Supervised warm start: next-token cross-entropy on masked positions."""

  def sft_step(state: TrainState, tokens_BT, loss_mask_BT):
    def loss_fn(params):
      valid = jnp.ones(tokens_BT.shape, bool)
      logp, aux = token_logp(state.graphdef, params, tokens_BT, valid, None,
                             None, None)
      mask = loss_mask_BT[:, 1:]
      nll = -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)
      exact = ((logp > jnp.log(0.5)) | (mask == 0)).all(axis=1).mean()
      total = (nll + indexer_loss_coef * aux.indexer_loss
               + balance_loss_coef * aux.balance_loss)
      return total, {'loss': nll, 'indexer_loss': aux.indexer_loss,
                     'token_p50_seq_frac': exact}
    grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return dataclasses.replace(state, params=params, opt_state=opt_state,
                               step=state.step + 1), metrics

  return jax.jit(sft_step, donate_argnums=0)
