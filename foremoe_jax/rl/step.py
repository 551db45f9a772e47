"""The pure-functional RL step: GRPO with rollout routing replay (R3).

Two pure jit-compiled functions of arrays: `recompute` (old and reference
log-probs with the rollout's routes replayed, on the canonical expert
layout, so it needs no plan and the host plans while it runs) and `update`
(group advantages, then `num_update_epochs` optimizer updates on the same
batch, each the M micro-steps as a `lax.scan` that accumulates gradients --
micro-step m computes with placement m on slot buffers that the transfer
engine fills while the previous micro-step computes -- followed by one optax
update of the canonical parameters). The host (trainer.py) only prepares
arrays and plans.

Mixed precision (WORKSPACE.md): the train state keeps a float32 master copy
of every parameter and float32 optimizer moments; the model computes in
`model.dtype` (each weight cast where it is used); the transfer engine moves
slot copies in `model.param_dtype`; every gradient sum (micro-steps, slot
buffers, returns home) is float32.

Shape letters: B samples in the step, M micro-steps, b = B / M samples per
micro-step, T tokens per sample (prompt + completion), L MoE layers, K top-k,
S slots, D EP devices, U update epochs.
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
from foremoe_jax.transfer import engine as transfer_engine
from foremoe_jax.transfer import schedule


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
                   data_fields=['placement', 'transfer'],
                   meta_fields=['capacity'])
@dataclasses.dataclass(frozen=True)
class StepPlan:
  """What the update needs from the host: placements, moves, one capacity.

  placement: slot_expert [M, L, S] and slot_share [M, L, D, S].
  transfer: `transfer.engine.device_step_transfer` of the step's
    `schedule.StepTransfer`: the fill before micro-step 0, the moves issued
    during each micro-step for the next one, and the gradient flush.
  capacity: the scan over micro-steps needs one buffer shape, so this is the
    smallest bucket that drops nothing in *any* micro-step of the step.
  """
  placement: placement_lib.Placement
  transfer: dict
  capacity: int


def make_step_plan(placement: placement_lib.Placement, num_experts: int,
                   topo, budget, capacity: int | None = None) -> StepPlan:
  """Device StepPlan for stacked [M, ...] placements: builds their moves
  (`transfer.schedule`, raising BudgetExceeded past the budget)."""
  transfer = schedule.build_step_transfer(placement.slot_expert, num_experts,
                                          topo, budget)
  return StepPlan(jax.tree.map(jnp.asarray, placement),
                  transfer_engine.device_step_transfer(transfer), capacity)


# Dtype of the trained parameters, their gradient sums and the optimizer
# moments, whatever the model's param_dtype.
MASTER_DTYPE = GRAD_DTYPE = jnp.float32


def master_params(params):
  """`params` with every floating leaf in MASTER_DTYPE (shardings kept)."""
  def up(x):
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != MASTER_DTYPE:
      return x.astype(MASTER_DTYPE)
    return x
  return jax.tree.map(up, params)


def make_optimizer(learning_rate: float, grad_clip: float,
                   weight_decay: float = 0.0) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(learning_rate, weight_decay=weight_decay))


def init_train_state(graphdef, params, tx, mesh, *, with_ref: bool
                     ) -> TrainState:
  """A state whose every leaf already has the sharding the step returns.

  The parameters become the float32 master copy (`master_params`), so the
  optimizer moments `tx.init` builds are float32 too. Leaves created on one
  device (optimizer counters, the step) are replicated over the mesh up
  front; otherwise the second call of the jitted step would see new input
  shardings and compile again.
  """
  params = master_params(params)
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
               capacity, slot_weights_L=None, indexer_weight_bT=None):
  """Log-probs of tokens[:, 1:] given tokens[:, :-1], with replayed routes.

  routes_LbTK covers the T-1 input positions (None: route freshly).
  placement None: every device computes its canonical experts (no
  transfer); else slot_weights_L holds the weights the placement's slots
  need (the transfer engine's buffers).
  indexer_weight_bT: weights of the T-1 positions in the MSA indexer KL
  (see `Transformer.__call__`); None: the plain mean.
  Returns (logp_bT1, ModelAux).
  """
  model = nnx.merge(graphdef, params)
  inputs, targets = tokens_bT[:, :-1], tokens_bT[:, 1:]
  logits, aux, _ = model(inputs, valid_BT=valid_bT[:, :-1], placement=placement,
                         replay_routes_LBTK=routes_LbTK, capacity=capacity,
                         slot_weights_L=slot_weights_L,
                         indexer_weight_BT=indexer_weight_bT)
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0], aux


_EXPERT_LEAVES = ('w_gate', 'w_up', 'w_down')


def _moe_layers(graphdef, params):
  """(mesh, block indices of the MoE layers, slot dtype), read off the model.

  The slot dtype is the model's param_dtype: the engine moves expert copies
  in it (bf16 halves the bytes), while the master stays float32.
  """
  model = nnx.merge(graphdef, params)
  idxs = [i for i, b in enumerate(model.blocks) if b.is_moe]
  return (model.blocks[idxs[0]].ffn.mesh, idxs,
          jnp.dtype(model.cfg.param_dtype))


def canonical_experts(params, moe_blocks):
  """Per MoE layer, its canonical (w_gate, w_up, w_down) [E, ...] arrays."""
  return [tuple(params['blocks'][i]['ffn'][n][...] for n in _EXPERT_LEAVES)
          for i in moe_blocks]


def _path_keys(path):
  return tuple(getattr(p, 'key', getattr(p, 'idx', getattr(p, 'name', None)))
               for p in path)


def replace_experts(tree, moe_blocks, experts_L):
  """`tree` (params-shaped) with the MoE layers' expert leaves replaced."""
  table = {('blocks', i, 'ffn', n): experts_L[k][j]
           for k, i in enumerate(moe_blocks)
           for j, n in enumerate(_EXPERT_LEAVES)}

  def swap(path, x):
    keys = _path_keys(path)
    return table.get(keys[:4], x) if len(keys) >= 4 else x
  return jax.tree_util.tree_map_with_path(swap, tree)


def all_finite(tree) -> jax.Array:
  """True when every element of every leaf is finite."""
  return jnp.all(jnp.stack([jnp.isfinite(x).all()
                            for x in jax.tree.leaves(tree)]))


def _split_microbatches(x_B, microbatches_Mb):
  return jnp.take(x_B, microbatches_Mb, axis=0)


def _microbatched(batch):
  mb = batch['microbatches_Mb']
  split = lambda x: _split_microbatches(x, mb)
  routes_MLbTK = jnp.moveaxis(
      jnp.take(batch['routes_LBTK'].astype(jnp.int32), mb, axis=1), 1, 0)
  return (split(batch['tokens_BT']), split(batch['valid_BT']), routes_MLbTK,
          split(batch['loss_mask_BT']))


def recompute_logps(state: TrainState, batch: dict, capacity: int) -> dict:
  """Old (and reference) log-probs per micro-batch, routes replayed.

  Runs on the canonical layout (each device computes its home experts, no
  weight moves), so it depends on no plan: the host plans the update while
  this runs. capacity: the static-EP bucket for these loads.
  Returns {'old_logp_MbT', 'ref_logp_MbT' (absent without a reference),
  'rollout_vs_recompute_logp_max_abs' (when the batch has rollout_logp_BT)}.
  """
  toks_MbT, valid_MbT, routes_MLbTK, mask_MbT = _microbatched(batch)

  def recompute(params):
    def body(_, xs):
      toks, valid, routes = xs
      logp, _ = token_logp(state.graphdef, params, toks, valid, None, routes,
                           capacity)
      return None, logp
    return jax.lax.scan(body, None, (toks_MbT, valid_MbT, routes_MLbTK))[1]

  out = {'old_logp_MbT': jax.lax.stop_gradient(recompute(state.params))}
  if state.ref_params is not None:
    out['ref_logp_MbT'] = jax.lax.stop_gradient(recompute(state.ref_params))
  if 'rollout_logp_BT' in batch:
    rollout = _split_microbatches(batch['rollout_logp_BT'],
                                  batch['microbatches_Mb'])
    gap = jnp.where(mask_MbT > 0, out['old_logp_MbT'] - rollout, 0.0)
    out['rollout_vs_recompute_logp_max_abs'] = jnp.abs(gap).max()
  return out


def update_grads(state: TrainState, batch: dict, logps: dict, plan: StepPlan,
                 *, num_generations: int, eps_low: float, eps_high: float,
                 beta: float, indexer_loss_coef: float = 1.0,
                 balance_loss_coef: float = 0.0):
  """Advantages and the scan over micro-steps with moving slots; (grads, metrics).

  batch: dict with
    tokens_BT int32, valid_BT bool (real tokens), loss_mask_BT float32 over
    the T-1 target positions (completion tokens incl. EOS), routes_LBTK int
    (the routing record over the T-1 input positions), rewards_B float32,
    microbatches_Mb int32 (sample indices per micro-step).
  logps: `recompute_logps`' output.

  The slot buffers are filled for micro-step 0 from the canonical experts,
  then micro-step m computes with placement m while the moves into
  placement m+1 are issued in the same scan iteration from the buffers it
  reads (double buffer: nothing orders them after the compute, so XLA may
  overlap the two). A slot's gradient accumulates while it keeps its
  expert and goes home when the slot is refilled, or at the final flush;
  only canonical experts get gradients, and one optimizer update follows.

  Gradients are a plain float32 sum over micro-steps (the scan carry, the
  slot-gradient buffers and the returns are float32 whatever the compute
  dtype). The policy loss and the MSA indexer KL are per-sequence token
  means over the loss mask divided by the whole step's sequence count, so
  their sum does not depend on the composition; the balance loss is a
  per-micro-batch term and does (foresight/composition.py says when the
  full-batch gradient is reproduced).
  """
  mb = batch['microbatches_Mb']
  num_total = mb.size
  toks_MbT, valid_MbT, routes_MLbTK, mask_MbT = _microbatched(batch)
  adv_B = grpo.group_advantages(batch['rewards_B'], num_generations)
  adv_Mb = _split_microbatches(adv_B, mb)
  old_logp_MbT = logps['old_logp_MbT']
  has_ref = 'ref_logp_MbT' in logps
  ref_xs = logps['ref_logp_MbT'] if has_ref else old_logp_MbT  # Unused w/o ref.
  mesh, moe_blocks, slot_dtype = _moe_layers(state.graphdef, state.params)
  # Slot copies in the model's param dtype; gradients land in float32.
  canon_L = [tuple(w.astype(slot_dtype) for w in c)
             for c in canonical_experts(state.params, moe_blocks)]
  acc = lambda t: jax.tree.map(lambda x: jnp.zeros_like(x, GRAD_DTYPE), t)
  add = lambda a, b: jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)

  def micro_loss(params, slot_w_L, toks, valid, routes, placement, mask, adv,
                 old, ref):
    # The indexer KL over the loss's positions (completion tokens), each
    # sequence's token mean over num_total: aggregated like the policy loss.
    mask32 = mask.astype(jnp.float32)
    index_w = mask32 / (jnp.maximum(mask32.sum(axis=1, keepdims=True), 1.0)
                        * num_total)
    logp, aux = token_logp(state.graphdef, params, toks, valid, placement,
                           routes, plan.capacity, slot_weights_L=slot_w_L,
                           indexer_weight_bT=index_w)
    loss, metrics = grpo.policy_loss(
        logp, old, ref, adv, mask, eps_low=eps_low, eps_high=eps_high,
        beta=beta if ref is not None else 0.0, num_sequences_total=num_total)
    # MSA indexer KL (0 without MSA layers; already a share of the step) and
    # the MoE balance loss, weighted by this micro-batch's share of
    # sequences so that the sum over micro-steps is a step mean.
    index_loss = aux.indexer_loss
    balance = aux.balance_loss * (toks.shape[0] / num_total)
    metrics['indexer_loss'] = jax.lax.stop_gradient(index_loss)
    metrics['balance_loss'] = jax.lax.stop_gradient(balance)
    metrics['dropped'] = aux.dropped_L.sum()
    metrics['max_rows'] = aux.max_rows_L.max()
    return (loss + indexer_loss_coef * index_loss
            + balance_loss_coef * balance), metrics

  grad_fn = jax.grad(micro_loss, argnums=(0, 1), has_aux=True)

  def body(carry, xs):
    grads, slots_L, gslots_L, gcanon_L = carry
    toks, valid, routes, placement, mask, adv, old, ref, moves = xs
    (g, g_slots_L), metrics = grad_fn(
        state.params, [s[:3] for s in slots_L], toks, valid, routes,
        placement, mask, adv, old, ref if has_ref else None)
    # Which micro-step went non-finite, so the host can name it.
    metrics['nonfinite'] = (~(jnp.isfinite(metrics['loss'])
                              & all_finite((g, g_slots_L)))).astype(jnp.int32)
    # The ids travelled with the weights: every slot must hold the expert
    # the placement routes to it.
    metrics['transfer_id_errors'] = transfer_engine.id_errors(
        slots_L, placement.slot_expert, mesh=mesh)
    next_L = transfer_engine.fill_slots(slots_L, canon_L, moves, mesh=mesh)
    # A slot's gradient has its weights' dtype; it is summed in float32.
    gslots_L = add(gslots_L, [tuple(x) for x in g_slots_L])
    gslots_L, gcanon_L = transfer_engine.return_grads(gslots_L, gcanon_L,
                                                      moves, mesh=mesh)
    return (add(grads, g), next_L, gslots_L, gcanon_L), metrics

  slots_L = transfer_engine.fill_slots(None, canon_L, plan.transfer['fill'],
                                       mesh=mesh)
  carry = (acc(state.params), slots_L, [acc(s[:3]) for s in slots_L],
           acc(canon_L))
  (grads, _, gslots_L, gcanon_L), metrics_M = jax.lax.scan(
      body, carry, (toks_MbT, valid_MbT, routes_MLbTK, plan.placement,
                    mask_MbT, adv_Mb, old_logp_MbT, ref_xs,
                    plan.transfer['steps']))
  _, gcanon_L = transfer_engine.return_grads(gslots_L, gcanon_L,
                                             plan.transfer['flush'], mesh=mesh)
  # The canonical experts were not used directly (every MoE call read slot
  # buffers), so their autodiff gradients are zero: the returns are theirs.
  grads = replace_experts(grads, moe_blocks, gcanon_L)
  per_step = ('dropped', 'max_rows', 'transfer_id_errors',
              'nonfinite')  # Set below.
  metrics = {k: v.sum() for k, v in metrics_M.items() if k not in per_step}
  metrics.update(dropped=metrics_M['dropped'].sum(),
                 max_rows_M=metrics_M['max_rows'],
                 transfer_id_errors=metrics_M['transfer_id_errors'].sum(),
                 nonfinite_M=metrics_M['nonfinite'],
                 adv_abs_mean=jnp.abs(adv_B).mean())
  if 'rollout_vs_recompute_logp_max_abs' in logps:
    metrics['rollout_vs_recompute_logp_max_abs'] = logps[
        'rollout_vs_recompute_logp_max_abs']
  return grads, metrics


# Metrics of the update epochs: these are also kept per epoch (`<name>_U`);
# the step's value is the mean over epochs, except the ones below.
PER_EPOCH_METRICS = ('loss', 'pg_loss', 'kl', 'ratio_mean', 'clip_frac',
                     'grad_norm')
# Same in every epoch (routes, plan and advantages do not change): epoch 0's.
_FIRST_EPOCH_METRICS = ('dropped', 'max_rows_M', 'adv_abs_mean',
                        'rollout_vs_recompute_logp_max_abs')
# Summed over epochs: for nonfinite_M, the epochs in which each micro-step
# had a non-finite loss or gradient.
_SUMMED_METRICS = ('transfer_id_errors', 'nonfinite_M')


def _epoch_summary(metrics_U: dict) -> dict:
  """Step metrics from metrics stacked over the U update epochs."""
  out = {}
  for k, v in metrics_U.items():
    if k in _FIRST_EPOCH_METRICS:
      out[k] = v[0]
    elif k in _SUMMED_METRICS:
      out[k] = v.sum(axis=0)
    else:
      out[k] = v.mean(axis=0)
  out.update({f'{k}_U': metrics_U[k] for k in PER_EPOCH_METRICS})
  return out


class RLStep:
  """The two jitted halves of one RL step, and both in one call.

  `recompute(state, batch, capacity)` depends on no plan, so the host plans
  while it runs (JAX dispatch is asynchronous); `update(state, batch,
  logps, plan)` then runs `num_update_epochs` (GRPO's mu) optimizer updates
  on the same batch against the same old log-probs: each moves weights,
  runs the M micro-steps and applies one optimizer update (the state is
  donated). The plan is reused by every epoch: routes are replayed, so the
  loads it was made for do not change. From the second epoch on the policy
  differs from the old one, the ratio leaves 1 and the PPO clip acts.
  state.step counts RL steps (one per call), not optimizer updates.
  """

  def __init__(self, tx: optax.GradientTransformation, *,
               num_update_epochs: int = 1, **loss_kw):
    if num_update_epochs < 1:
      raise ValueError(f'num_update_epochs must be >= 1, got '
                       f'{num_update_epochs}.')
    self.tx = tx
    self.num_update_epochs = int(num_update_epochs)
    self.recompute = jax.jit(recompute_logps, static_argnums=2)

    def one_update(state: TrainState, batch, logps, plan):
      grads, metrics = update_grads(state, batch, logps, plan, **loss_kw)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      metrics['grad_norm'] = optax.tree.norm(grads)
      return dataclasses.replace(state, params=params,
                                 opt_state=opt_state), metrics

    def update(state: TrainState, batch: dict, logps: dict, plan: StepPlan):
      if self.num_update_epochs == 1:  # Exactly the single-update program.
        state, metrics = one_update(state, batch, logps, plan)
        metrics_U = jax.tree.map(lambda x: x[None], metrics)
      else:
        def epoch(s, _):
          return one_update(s, batch, logps, plan)
        state, metrics_U = jax.lax.scan(epoch, state, None,
                                        length=self.num_update_epochs)
      return (dataclasses.replace(state, step=state.step + 1),
              _epoch_summary(metrics_U))

    self.update = jax.jit(update, donate_argnums=0)

  def __call__(self, state: TrainState, batch: dict, plan: StepPlan,
               recompute_capacity: int | None = None):
    """recompute then update; recompute_capacity None: plan.capacity."""
    cap = plan.capacity if recompute_capacity is None else recompute_capacity
    logps = self.recompute(state, batch, cap)
    return self.update(state, batch, logps, plan)


def make_rl_step(tx: optax.GradientTransformation, *, num_generations: int,
                 eps_low: float, eps_high: float, beta: float,
                 indexer_loss_coef: float = 1.0,
                 balance_loss_coef: float = 0.0,
                 num_update_epochs: int = 1) -> RLStep:
  """Builds the jit-compiled pure RL step (see `RLStep`)."""
  return RLStep(tx, num_update_epochs=num_update_epochs,
                num_generations=num_generations, eps_low=eps_low,
                eps_high=eps_high, beta=beta,
                indexer_loss_coef=indexer_loss_coef,
                balance_loss_coef=balance_loss_coef)


def make_sft_step(tx: optax.GradientTransformation,
                  indexer_loss_coef: float = 1.0,
                  balance_loss_coef: float = 0.0):
  """Supervised warm start: next-token cross-entropy on masked positions."""

  def sft_step(state: TrainState, tokens_BT, loss_mask_BT, valid_BT=None):
    # valid_BT: False at a left-padded prompt's PADs (None: all real).
    def loss_fn(params):
      valid = (jnp.ones(tokens_BT.shape, bool) if valid_BT is None
               else valid_BT)
      mask = loss_mask_BT[:, 1:].astype(jnp.float32)
      # The indexer KL over the same positions as the loss (token mean).
      logp, aux = token_logp(state.graphdef, params, tokens_BT, valid, None,
                             None, None, indexer_weight_bT=mask / jnp.maximum(
                                 mask.sum(), 1.0))
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
