"""The pure-functional RL step: GRPO with rollout routing replay (R3).

Two pure jit-compiled functions of arrays: `recompute` (the reference
and, with several update epochs, the old policy's log-probs, routes
replayed, on a step-level placement the host makes at once, so the
micro-step plan is made while it runs) and `update` (group advantages,
then `num_update_epochs` optimizer updates on the same batch, each the M
micro-steps as a `lax.scan` that accumulates gradients -- micro-step m
computes with placement m on slot buffers that the transfer engine fills
while the previous micro-step computes -- followed by one optax update of
the canonical parameters). Both run per device, as one `jax.shard_map`
over the mesh: each device holds whole sequences of every micro-batch,
accumulates its own gradients, and the gradients are reduced once per
step (docs/design.md §4.7). The host (trainer.py) only prepares arrays and
plans.

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

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep_lib
from foremoe_jax.model import moe as moe_lib
from foremoe_jax.model import router as router_lib
from foremoe_jax.rl import grpo
from foremoe_jax.transfer import engine as transfer_engine
from foremoe_jax.transfer import schedule

DATA, EXPERT = ep_lib.DATA, ep_lib.EXPERT


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
                   meta_fields=['capacity', 'cell'])
@dataclasses.dataclass(frozen=True)
class StepPlan:
  """What the update needs from the host: placements, moves, one capacity.

  placement: slot_expert [M, L, S] and slot_share [M, L, D, S].
  transfer: `transfer.engine.device_step_transfer` of the step's
    `schedule.StepTransfer`: the fill before micro-step 0, the moves issued
    during each micro-step for the next one, and the gradient flush.
  capacity: the scan over micro-steps needs one buffer shape, so this is the
    smallest bucket that drops nothing in *any* micro-step of the step.
  cell: with the CPU's emulated exchange, the bucket of the largest (source,
    destination device) pair of any micro-step, which the emulation pads
    every pair to (`dispatch_exact.dispatch_body`); None: the bound that
    holds whatever the routing. GPU/TPU's ragged exchange ignores it.
  """
  placement: placement_lib.Placement
  transfer: dict
  capacity: int
  cell: int | None = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=['capacity', 'cell'])
@dataclasses.dataclass(frozen=True)
class CanonicalLayout:
  """The recompute's plan when experts stay home: no placement, no moves,
  capacity static (None: dropless), cell as `StepPlan.cell`."""
  capacity: int | None = None
  cell: int | None = None


def model_capacity(plan):
  """The model's static capacity for a StepPlan or CanonicalLayout: R, or
  (R, cell) when the plan bounds the pairs (`expert_parallel.split_capacity`)."""
  if plan.cell is None or plan.capacity is None:
    return plan.capacity
  return (plan.capacity, plan.cell)


def _as_layout(plan) -> CanonicalLayout:
  """A CanonicalLayout as given, or built from its capacity (None:
  dropless)."""
  return plan if isinstance(plan, CanonicalLayout) else CanonicalLayout(plan)


def _zero_sums(tree):
  """float32 zeros shaped as `tree`: gradient sums to accumulate into."""
  return jax.tree.map(lambda x: jnp.zeros_like(x, GRAD_DTYPE), tree)


def _add_sums(sums, grads):
  return jax.tree.map(lambda x, y: x + y.astype(x.dtype), sums, grads)


def make_step_plan(placement: placement_lib.Placement, num_experts: int,
                   topo, budget, capacity: int | None = None,
                   cell: int | None = None) -> StepPlan:
  """Device StepPlan for stacked [M, ...] placements: builds their moves
  (`transfer.schedule`, raising BudgetExceeded past the budget)."""
  transfer = schedule.build_step_transfer(placement.slot_expert, num_experts,
                                          topo, budget)
  return StepPlan(jax.tree.map(jnp.asarray, placement),
                  transfer_engine.device_step_transfer(transfer), capacity,
                  cell)


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


# Target log-probs are computed this many tokens at a time: each chunk's
# float32 logits [chunk, V] live only inside the chunk (recomputed in the
# backward), never the whole [tokens, V] (2.5 GB per 4,096 tokens at
# Qwen3's 151,936-token vocabulary).
LOGP_CHUNK_TOKENS = 2048


def target_logp(unembed, x_NM, targets_N, chunk: int = LOGP_CHUNK_TOKENS):
  """log softmax(unembed(x))[target] per row, float32 [N], in chunks."""
  num = x_NM.shape[0]
  if num <= chunk:
    logits = unembed(x_NM)
    return (jnp.take_along_axis(logits, targets_N[:, None], -1)[:, 0]
            - jax.nn.logsumexp(logits, axis=-1))
  pad = -num % chunk
  x_KcM = jnp.pad(x_NM, ((0, pad), (0, 0))).reshape(-1, chunk, x_NM.shape[1])
  t_Kc = jnp.pad(targets_N, (0, pad)).reshape(-1, chunk)

  @jax.checkpoint
  def one(xs):
    x_cM, t_c = xs
    logits = unembed(x_cM)
    return (jnp.take_along_axis(logits, t_c[:, None], -1)[:, 0]
            - jax.nn.logsumexp(logits, axis=-1))
  return jax.lax.map(one, (x_KcM, t_Kc)).reshape(-1)[:num]


def token_logp(graphdef, params, tokens_bT, valid_bT, placement, routes_LbTK,
               capacity, slot_weights=None, indexer_weight_bT=None,
               slot_returns=None, slot_fills=None):
  """Log-probs of tokens[:, 1:] given tokens[:, :-1], with replayed routes.

  routes_LbTK covers the T-1 input positions (None: route freshly).
  placement None: every device computes its canonical experts (no
  transfer); else slot_weights holds the weights the placement's slots
  need (the transfer engine's buffers, three [L, S, ...] arrays).
  indexer_weight_bT: weights of the T-1 positions in the MSA indexer KL
  (see `Transformer.__call__`); None: the plain mean. slot_returns: slot
  gradients sent home in each MoE layer's backward (`Transformer.__call__`).
  slot_fills: the next placement's slots filled in each MoE layer's
  forward (`Transformer.__call__`), returned as `ModelAux.next_slots`.
  The vocabulary's logits are never all materialised (`target_logp`).
  Returns (logp_bT1, ModelAux).
  """
  model = nnx.merge(graphdef, params)
  inputs, targets = tokens_bT[:, :-1], tokens_bT[:, 1:]
  hidden, aux, _ = model(inputs, valid_BT=valid_bT[:, :-1],
                         placement=placement, replay_routes_LBTK=routes_LbTK,
                         capacity=capacity, slot_weights=slot_weights,
                         indexer_weight_BT=indexer_weight_bT,
                         return_hidden=True, slot_returns=slot_returns,
                         slot_fills=slot_fills)
  b, t, m = hidden.shape
  logp = target_logp(model.unembed, hidden.reshape(b * t, m),
                     targets.reshape(b * t))
  return logp.reshape(b, t), aux


_EXPERT_LEAVES = ('w_gate', 'w_up', 'w_down')


def _moe_layers(graphdef, params):
  """(mesh, the MoE segments, slot dtype), read off the model.

  The slot dtype is the model's param_dtype: the engine moves expert copies
  in it (bf16 halves the bytes), while the master stays float32.
  """
  model = nnx.merge(graphdef, params)
  segs = [(k, seg) for k, seg in enumerate(model.layer_segments) if seg.moe]
  return (model.mesh, segs, jnp.dtype(model.cfg.param_dtype))


def canonical_experts(params, moe_segments):
  """The MoE layers' canonical (w_gate, w_up, w_down), each [L, E, ...]
  (the stacks of the MoE segments, concatenated in layer order)."""
  per_seg = [tuple(params['segments'][k]['ffn'][n][...] for n in _EXPERT_LEAVES)
             for k, _ in moe_segments]
  if len(per_seg) == 1:
    return per_seg[0]
  return tuple(jnp.concatenate(ws) for ws in zip(*per_seg))


def _path_keys(path):
  return tuple(getattr(p, 'key', getattr(p, 'idx', getattr(p, 'name', None)))
               for p in path)


def replace_experts(tree, moe_segments, experts):
  """`tree` (params-shaped) with the MoE layers' expert leaves replaced by
  `experts` ((w_gate, w_up, w_down), each [L, E, ...])."""
  table = {}
  for k, seg in moe_segments:
    lo, hi = seg.moe_start, seg.moe_start + seg.num_layers
    for j, n in enumerate(_EXPERT_LEAVES):
      table[('segments', k, 'ffn', n)] = experts[j][lo:hi]

  def swap(path, x):
    keys = _path_keys(path)
    return table.get(keys[:4], x) if len(keys) >= 4 else x
  return jax.tree_util.tree_map_with_path(swap, tree)


def all_finite(tree) -> jax.Array:
  """True when every element of every leaf is finite."""
  return jnp.all(jnp.stack([jnp.isfinite(x).all()
                            for x in jax.tree.leaves(tree)]))


# ------------------------------------------------------- the batch layout

# Keys of an RL batch (rl.trainer.rl_batch_from_rollout builds it): the
# samples are already grouped by micro-step, [M, b, ...], and the b axis is
# split over every device of the mesh (each device holds whole sequences
# of every micro-batch), so nothing is gathered on device.
#   tokens_MbT int32, valid_MbT bool (real tokens), loss_mask_MbT float32
#   over the T-1 target positions (completion tokens incl. EOS),
#   routes_MLbTK int (the routing record over the T-1 input positions),
#   rollout_logp_MbT float32 (the sampler's log-probs of the targets; 0 off
#   the completion), rewards_B float32 (original sample order, GRPO groups
#   consecutive), microbatches_Mb int32 (sample ids of each micro-batch).
_PER_SAMPLE_KEYS = ('tokens_MbT', 'valid_MbT', 'loss_mask_MbT',
                    'rollout_logp_MbT')


def _batch_specs(batch: dict) -> dict:
  """shard_map specs of a batch: per-sample arrays split over the devices
  along b, the rest replicated."""
  rows = (DATA, EXPERT)
  out = {}
  for k in batch:
    if k in _PER_SAMPLE_KEYS:
      out[k] = P(None, rows)
    elif k == 'routes_MLbTK':
      out[k] = P(None, None, rows)
    else:
      out[k] = P()
  return out


def _check_rows(batch: dict, mesh) -> None:
  b = batch['tokens_MbT'].shape[1]
  if b % mesh.size:
    raise ValueError(
        f'micro-batches of {b} sequences do not split over the {mesh.size} '
        f'devices of the mesh: each device holds whole sequences (pick '
        f'prompts_per_step * num_generations / num_microbatches divisible by '
        f'num_data * num_expert).')


# ------------------------------------------------------------ per device

def _split_params(params):
  """(canonical experts, everything else): two States."""
  return nnx.split_state(params, moe_lib.ExpertWeight, ...)


def _expert_state_specs(experts):
  return jax.tree.map(lambda _: P(None, EXPERT), experts)


def _replicated_specs(tree):
  return jax.tree.map(lambda _: P(), tree)


def _transfer_specs(transfer):
  """in_specs of a device step transfer: each device its own rows
  (`transfer.engine.step_transfer_specs`)."""
  return (None if transfer is None
          else transfer_engine.step_transfer_specs(transfer))


def placement_specs(placement):
  """in_specs of a stacked placement ([M, L, S], [M, L, D, S]) in the step's
  shard_maps: slot_expert whole, slot_share this device's source row only
  (the dispatch reads no other: `slot_assignment.own_share_row`)."""
  if placement is None:
    return None
  return type(placement)(P(), P(None, None, EXPERT, None))


def device_placement(placement, mesh):
  """A host (stacked) placement on the mesh as the step reads it: the
  shares split over 'expert' (each device gets its own row, not D x S
  floats per layer and micro-step), the slots replicated."""
  return type(placement)(*(
      jax.device_put(x, NamedSharding(mesh, spec))
      for x, spec in zip(placement, placement_specs(placement))))


def device_transfer(step_transfer, mesh):
  """A host StepTransfer on the mesh as the step reads it: every [.., D, R]
  and [.., D, D] array split over 'expert', each device sent its own row
  (at 256 devices a replicated transfer would send every device 256 times
  what it reads, every step)."""
  return transfer_engine.device_step_transfer(
      step_transfer, lambda spec: NamedSharding(mesh, spec))


def _slots_per_device(placement, mesh) -> int:
  return placement.slot_expert.shape[-1] // mesh.shape[EXPERT]


def _fill_local(canon, fill_t, spd: int, num_devices: int):
  """This device's slot buffers for the first placement, from home."""
  return transfer_engine.fill_slots_local(
      transfer_engine.empty_slots(canon, spd), canon, fill_t,
      num_devices=num_devices)


def _forward_local(graphdef, nonexp, experts, slot_dtype, moe_segments, batch,
                   placement, transfer, capacity, num_devices: int,
                   prefill=None):
  """Log-probs [M, b, T-1] of this device's sequences, micro-step by
  micro-step, forward only (per device, inside the shard_map), and the
  prefilled slots (None without `prefill`).

  prefill: the policy's canonical experts (an expert State), filled into
  the plan's slots for the update while this forward runs: one chunk of
  layers per micro-step, issued in the same scan iteration as that
  micro-step's forward and reading nothing it computes, so nothing orders
  the two (the engine's moves between micro-steps are issued the same
  way). The update then starts from them (`update_grads`).
  """
  params = nnx.merge_state(nonexp, experts)
  manual_plan = placement is not None
  if manual_plan:
    canon = tuple(w.astype(slot_dtype)
                  for w in canonical_experts(params, moe_segments))
    spd = placement.slot_expert.shape[-1] // num_devices
    slots = _fill_local(canon, transfer['fill'], spd, num_devices)
  num_micro = batch['tokens_MbT'].shape[0]
  pslots = None
  if prefill is not None:
    pcanon = tuple(w.astype(slot_dtype)
                   for w in canonical_experts(prefill, moe_segments))
    axes = ep_lib.varying_axes(pcanon[0]) | {EXPERT}
    pslots = tuple(ep_lib.vary(x, axes) for x in
                   transfer_engine.empty_slots(pcanon, spd))

  def body(pslots, xs):
    toks, valid, routes, pl, m = xs
    logp, _ = token_logp(graphdef, params, toks, valid, pl, routes, capacity,
                         slot_weights=slots[:3] if manual_plan else None)
    if pslots is not None:
      pslots = transfer_engine.fill_slots_local(
          pslots, pcanon, transfer['fill'], num_devices=num_devices,
          chunk=m, num_chunks=num_micro)
    return pslots, logp
  pslots, logp = jax.lax.scan(
      body, pslots, (batch['tokens_MbT'], batch['valid_MbT'],
                     batch['routes_MLbTK'], placement,
                     jnp.arange(num_micro, dtype=jnp.int32)))
  return logp, pslots


def recompute_logps(state: TrainState, batch: dict, plan=None, *,
                    old: bool = True, ref: bool = True,
                    prefill: bool = False) -> dict:
  """Old and/or reference log-probs per micro-batch, routes replayed.

  plan: a StepPlan whose placement is fixed over the micro-steps (the
  step-level plan the host makes at once from the exact loads, so this
  forward is balanced and never waits for the micro-step plan); its fill
  moves the weights in, nothing moves between micro-steps. A
  CanonicalLayout (or its capacity, an int; None: dropless): the home
  experts, no transfer.
  old / ref: which forwards to run (`RLStep.recompute_passes` says which
  the step needs; the reference needs state.ref_params).
  prefill: also fill the policy's (state.params') experts into the plan's
    slots while the first forward runs (a StepPlan only), for an update
    whose fill starts from them (`schedule.build_step_transfer(start_LS=)`
    with the plan's placement): the fill then hides under the recompute
    instead of opening the update.
  Returns {'old_logp_MbT', 'ref_logp_MbT' (each when asked),
  'rollout_vs_recompute_logp_max_abs' (with old, when the batch has
  rollout_logp_MbT), 'prefill_slots' (with prefill: the update's slot
  buffers (w_gate, w_up, w_down, ids), [L, S, ...] split over 'expert')}.
  """
  mesh, moe_segments, slot_dtype = _moe_layers(state.graphdef, state.params)
  _check_rows(batch, mesh)
  if isinstance(plan, StepPlan):
    placement, transfer = plan.placement, plan.transfer
  else:
    plan = _as_layout(plan)
    placement, transfer = None, None
  capacity = model_capacity(plan)
  if prefill and placement is None:
    raise ValueError('prefill fills the slots of a StepPlan; the canonical '
                     'layout has none.')
  fwd_batch = {k: batch[k] for k in ('tokens_MbT', 'valid_MbT',
                                     'routes_MLbTK')}
  todo = [('old_logp_MbT', state.params)] if old else []
  if ref:
    if state.ref_params is None:
      raise ValueError('the reference forward needs state.ref_params')
    todo.append(('ref_logp_MbT', state.ref_params))
  if not todo:
    raise ValueError('recompute_logps runs no forward (old and ref False).')
  out = {}
  for i, (name, params) in enumerate(todo):
    experts, nonexp = _split_params(params)
    # The first forward carries the prefill, the policy's experts.
    pexperts = _split_params(state.params)[0] if prefill and i == 0 else None
    fn = jax.shard_map(
        lambda ne, ex, bt, pl, tr, pe: _forward_local(
            state.graphdef, ne, ex, slot_dtype, moe_segments, bt, pl, tr,
            capacity, mesh.shape[EXPERT], prefill=pe),
        mesh=mesh,
        in_specs=(_replicated_specs(nonexp), _expert_state_specs(experts),
                  _batch_specs(fwd_batch), placement_specs(placement),
                  _transfer_specs(transfer),
                  _expert_state_specs(pexperts)),
        out_specs=(P(None, (DATA, EXPERT)),
                   None if pexperts is None else (P(None, EXPERT),) * 4))
    logp, pslots = fn(nonexp, experts, fwd_batch, placement, transfer,
                      pexperts)
    out[name] = jax.lax.stop_gradient(logp)
    if pslots is not None:
      out['prefill_slots'] = jax.lax.stop_gradient(pslots)
  if old and 'rollout_logp_MbT' in batch:
    gap = jnp.where(batch['loss_mask_MbT'] > 0,
                    out['old_logp_MbT'] - batch['rollout_logp_MbT'], 0.0)
    out['rollout_vs_recompute_logp_max_abs'] = jnp.abs(gap).max()
  return out


def update_grads(state: TrainState, batch: dict, logps: dict, plan,
                 *, num_generations: int, eps_low: float, eps_high: float,
                 beta: float, indexer_loss_coef: float = 1.0,
                 balance_loss_coef: float = 0.0,
                 loss_agg_mode: str = 'seq-mean-token-mean',
                 loss_scale_factor: float | None = None,
                 clip_ratio_c: float | None = None, kl_estimator: str = 'k3',
                 adv_std_ddof: int = 0, norm_adv_by_std: bool = True,
                 policy_loss_mode: str = 'ppo', gspo_eps_low: float = 3e-4,
                 gspo_eps_high: float = 4e-4):
  """Advantages and the scan over micro-steps with moving slots; (grads, metrics).

  batch: the RL batch (module comment above). logps: the recompute's
  output, optionally with 'old_logp_MbT' and 'ref_logp_MbT'; without old
  log-probs (one update epoch: the old policy is the current one), the
  update's own log-probs, detached, are the old ones, so the ratio is 1.
  With 'prefill_slots' (the recompute filled the policy's experts into its
  placement's slots, `recompute_logps(prefill=True)`), the update starts
  from them, and plan's fill must start from that placement
  (`schedule.build_step_transfer(start_LS=)`); the ids the slots carry are
  checked every micro-step (transfer_id_errors).

  plan: a StepPlan (slots, moves between micro-steps), or a
  CanonicalLayout (or its capacity, an int; None: dropless) for static EP
  with nothing moved: the experts compute at home, differentiated
  directly, with no slot buffers, fill, returns or flush.

  The whole scan runs per device inside one shard_map over the mesh: each
  device holds whole sequences of every micro-batch and accumulates its
  own float32 gradients, and the non-expert gradients are summed over the
  mesh once, after the last micro-step (one all-reduce per step, as a
  data-parallel trainer that accumulates locally does, instead of one per
  micro-step). The slot buffers are filled for micro-step 0 from the
  canonical experts, then micro-step m computes with placement m while the
  moves into placement m+1 are issued in the same scan iteration from the
  buffers it reads (double buffer: nothing orders them after the compute).
  A slot's gradient accumulates while it keeps its expert and goes home
  when the slot is refilled, or at the final flush; the canonical expert
  gradients are then summed over 'data' once. Only the non-expert
  parameters, the slot buffers and the canonical experts' gradient sums
  are differentiated: the sums' cotangent is the sums plus what the
  backward returned, so the canonical experts get exactly the returned
  sums, and no micro-step makes a zero-filled gradient of them.

  Gradients are float32 sums over micro-steps and devices whatever the
  compute dtype. The policy loss is aggregated by `loss_agg_mode` with
  the whole step's counts (its sequences, and its loss tokens counted
  here on the global mask: `grpo.loss_weights`), and the MSA indexer KL
  is a per-sequence token mean over the step's sequence count, so their
  sum does not depend on the composition in any mode; the balance loss
  is a per-micro-batch term and does (foresight/composition.py says when
  the full-batch gradient is reproduced). The objective's options
  (loss_agg_mode ... gspo_eps_high) are `grpo.policy_loss`'s, and
  adv_std_ddof / norm_adv_by_std `grpo.group_advantages`' ddof /
  scale_by_std.
  """
  _check_scale_factor(loss_agg_mode, loss_scale_factor)
  mesh, moe_segments, slot_dtype = _moe_layers(state.graphdef, state.params)
  _check_rows(batch, mesh)
  canonical = not isinstance(plan, StepPlan)
  if canonical:
    plan = _as_layout(plan)
    if 'prefill_slots' in logps:
      raise ValueError('the recompute prefilled slots for a StepPlan; the '
                       'canonical layout has none to start from.')
  num_devices = mesh.shape[EXPERT]
  mb = batch['microbatches_Mb']
  num_total = mb.size
  adv_B = grpo.group_advantages(batch['rewards_B'], num_generations,
                                 ddof=adv_std_ddof,
                                 scale_by_std=norm_adv_by_std)
  adv_Mb = jnp.take(adv_B, mb, axis=0)
  # The policy loss's step-level denominators: the step's sequences, and
  # its loss tokens counted on the global mask (every micro-batch, every
  # device), so that micro-step and device shares sum to the whole-batch
  # loss whatever the mode.
  denoms = {'num_tokens_total': jnp.sum(
      batch['loss_mask_MbT'].astype(jnp.float32))}
  loss_opts = dict(loss_agg_mode=loss_agg_mode,
                   loss_scale_factor=loss_scale_factor,
                   clip_ratio_c=clip_ratio_c, kl_estimator=kl_estimator,
                   policy_loss_mode=policy_loss_mode,
                   gspo_eps_low=gspo_eps_low, gspo_eps_high=gspo_eps_high)
  experts, nonexp = _split_params(state.params)
  rows = (DATA, EXPERT)
  fwd_keys = ('tokens_MbT', 'valid_MbT', 'routes_MLbTK', 'loss_mask_MbT',
              'rollout_logp_MbT')
  local_batch = {k: batch[k] for k in fwd_keys if k in batch}
  has_rollout = 'rollout_logp_MbT' in local_batch
  extra = {'adv_Mb': adv_Mb}
  if beta and 'ref_logp_MbT' not in logps:
    # The KL term would be dropped without a word.
    raise ValueError(f'beta = {beta} needs the reference log-probs '
                     "(logps['ref_logp_MbT'], `recompute_logps(ref=True)`).")
  extra.update({k: logps[k] for k in ('old_logp_MbT', 'ref_logp_MbT')
                if k in logps})
  extra_specs = {k: P(None, rows) for k in extra}

  def micro_loss(nonexp_l, experts_l, slot_w, home_acc, slot_returns, fills,
                 toks, valid, routes, placement, mask, adv, old, ref, rollout,
                 denoms):
    # With slots (a StepPlan), the canonical experts do not reach the loss
    # (the slots compute) and are not differentiated. Their gradient sums
    # so far, home_acc, are: the slots' returns in the backward
    # (`engine.returns_in_backward`) make home_acc's cotangent those sums
    # plus what arrived. On the canonical layout (slot_w None) the experts
    # compute at home and are differentiated themselves.
    params = nnx.merge_state(nonexp_l, experts_l)
    # The indexer KL over the loss's positions (completion tokens), each
    # sequence's token mean over num_total: aggregated like the policy loss.
    mask32 = mask.astype(jnp.float32)
    index_w = mask32 / (jnp.maximum(mask32.sum(axis=1, keepdims=True), 1.0)
                        * num_total)
    logp, aux = token_logp(state.graphdef, params, toks, valid, placement,
                           routes, model_capacity(plan), slot_weights=slot_w,
                           indexer_weight_bT=index_w,
                           slot_returns=(None if home_acc is None
                                         else (home_acc,) + slot_returns),
                           slot_fills=fills)
    if old is None:  # One epoch: the old policy is this one.
      old = jax.lax.stop_gradient(logp)
    loss, metrics = grpo.policy_loss(
        logp, old, ref, adv, mask, eps_low=eps_low, eps_high=eps_high,
        beta=beta if ref is not None else 0.0, num_sequences_total=num_total,
        **denoms, **loss_opts)
    # MSA indexer KL (0 without MSA layers; this device's share of the
    # step). The MoE balance loss is the micro-batch's, from the batch's
    # sums (reduced here only when it is trained, else with the other
    # statistics after the last micro-step), weighted by this
    # micro-batch's share of sequences so that the sum over micro-steps is
    # a step mean.
    index_loss = aux.indexer_loss
    if balance_loss_coef:
      aux = aux.reduced(rows)
    share = mb.shape[1] / num_total
    metrics['indexer_loss'] = jax.lax.stop_gradient(index_loss)
    if fills is not None:
      metrics['next_slots'] = aux.next_slots
    metrics['moe_sums'] = jax.lax.stop_gradient(
        (aux.counts_LE, aux.prob_sum_LE, aux.num_valid_L, aux.dropped_L,
         aux.max_rows_L))
    if rollout is not None:
      gap = jnp.where(mask > 0, jax.lax.stop_gradient(logp) - rollout, 0.0)
      metrics['rollout_gap'] = jnp.abs(gap).max()
    # Each device returns its share of the step's loss and the shares are
    # summed: the policy and indexer terms are already shares (sums over
    # its own sequences), the balance loss is the same on every device, so
    # each takes 1/devices of it (its gradient, through the sums over the
    # mesh inside it, then reaches every device's tokens exactly once).
    total = loss + indexer_loss_coef * index_loss
    if balance_loss_coef:
      total = total + (balance_loss_coef * aux.balance_loss * share
                       / mesh.size)
    return total, metrics

  # Slots: the non-expert parameters, the slot buffers and the canonical
  # experts' gradient sums; the canonical layout: the non-expert
  # parameters and the experts.
  grad_fn = jax.grad(micro_loss, argnums=(0, 2, 3), has_aux=True)
  canonical_grad_fn = jax.grad(micro_loss, argnums=(0, 1), has_aux=True)
  share_M = mb.shape[1] / num_total  # Each micro-batch's share of sequences.

  def reduce_step(g_acc, gcanon, metrics_M):
    # After the last micro-step, per device, on either layout. The one
    # reduction of the step: non-expert gradients over the mesh, the
    # experts' over 'data' (each data row moved, or computed with, its own
    # copies).
    g_acc = jax.lax.psum(g_acc, rows)
    gcanon = jax.lax.psum(gcanon, DATA)
    # Per-device sums of the losses, over the mesh; the rest is already
    # the same on every device.
    summed = ('loss', 'pg_loss', 'kl', 'ratio_mean', 'clip_frac',
              'dual_clip_frac', 'indexer_loss')
    metrics_M = {k: (jax.lax.psum(v, rows) if k in summed else v)
                 for k, v in metrics_M.items()}
    metrics_M['transfer_id_errors'] = jax.lax.psum(
        metrics_M['transfer_id_errors'], EXPERT)
    # The MoE statistics of every layer and micro-step, reduced at once
    # (unless the balance loss already reduced them in the loop).
    counts, probs, valid, dropped, max_rows = metrics_M.pop('moe_sums')
    if not balance_loss_coef:
      counts, probs, valid, dropped = jax.lax.psum(
          (counts, probs, valid, dropped), rows)
      max_rows = jax.lax.pmax(max_rows, rows)
    metrics_M['balance_loss'] = share_M * jnp.mean(
        router_lib.balance_loss_from_sums(probs, valid, counts), axis=-1)
    metrics_M['dropped'] = dropped.sum(axis=-1)
    metrics_M['max_rows'] = max_rows.max(axis=-1)
    for k in ('nonfinite', 'rollout_gap'):
      if k in metrics_M:
        metrics_M[k] = jax.lax.pmax(metrics_M[k], rows)
    return g_acc, gcanon, metrics_M

  def local(nonexp_l, experts_l, bt, ex, placement, transfer, denoms,
            prefilled):
    # Per-device gradients: the non-expert parameters and the slot buffers
    # differ per device from here on, so autodiff sums nothing over the
    # mesh inside the loop.
    nonexp_l = jax.tree.map(lambda x: ep_lib.vary(x, rows), nonexp_l)
    params = nnx.merge_state(nonexp_l, experts_l)
    canon = tuple(w.astype(slot_dtype)
                  for w in canonical_experts(params, moe_segments))
    spd = placement.slot_expert.shape[-1] // num_devices
    # From empty buffers, or from those the recompute filled (the fill
    # then moves only what micro-step 0 changes).
    start = (transfer_engine.empty_slots(canon, spd) if prefilled is None
             else prefilled)
    slots = transfer_engine.fill_slots_local(start, canon, transfer['fill'],
                                             num_devices=num_devices)
    slots = tuple(ep_lib.vary(w, (DATA,)) for w in slots[:3]) + slots[3:]

    num_micro = bt['tokens_MbT'].shape[0]
    # The exact exchanges fill micro-step m + 1's slots inside micro-step
    # m's forward, and return the replicas the move evicts inside its
    # backward, layer by layer, in the computation of the layer's matmuls,
    # so the scheduler may overlap them (in a scan of their own they could
    # only run before or after the forward and backward); the CPU
    # emulation fills and returns in place after the backward (its
    # collectives are synchronous anyway).
    in_layer = transfer_engine.moves_in_layers(transfer['steps'])

    def body(carry, xs):
      g_acc, slots, gslots, gcanon = carry
      (toks, valid, routes, mask, pl, moves, adv, old, ref,
       rollout, m) = xs
      # The flush: in the last micro-step every slot's gradient (the
      # earlier ones' sum plus its own) goes home inside its layer's
      # backward, in the computation of the layer's matmuls, where the
      # scheduler may overlap it. With the exact exchanges the replicas
      # the moves into m + 1 evict go home the same way, in m's backward.
      last = m == num_micro - 1
      returns = ((transfer['flush'], last),)
      if in_layer:
        returns += ((moves, ~last),)
      # gcanon's cotangent is gcanon with the returns' arrivals added
      # (nothing sent: gcanon, passed through).
      fills = (slots, canon, moves) if in_layer else None
      (g, g_slots, gcanon), metrics = grad_fn(
          nonexp_l, experts_l, slots[:3], gcanon, (tuple(gslots), returns),
          fills, toks, valid, routes, pl, mask, adv, old, ref, rollout,
          denoms)
      gcanon = tuple(gcanon)
      # Which micro-step went non-finite, so the host can name it.
      metrics['nonfinite'] = (~(jnp.isfinite(metrics['loss'])
                                & all_finite((g, g_slots)))).astype(jnp.int32)
      # The ids travelled with the weights: every slot must hold the expert
      # the placement routes to it.
      # (This device's count; summed over the mesh after the last step.)
      metrics['transfer_id_errors'] = transfer_engine.id_errors_local(
          slots[3], pl.slot_expert, reduce=False)
      if in_layer:
        next_slots = tuple(metrics.pop('next_slots'))
      else:
        next_slots = transfer_engine.fill_slots_local(
            slots, canon, moves, num_devices=num_devices)
      # A slot's gradient has its weights' dtype; it is summed in float32.
      gslots = _add_sums(gslots, tuple(g_slots))
      if in_layer:  # The evicted slots' sums went home in the backward.
        gslots = transfer_engine.zero_evicted_local(gslots, moves)
      else:
        gslots, gcanon = transfer_engine.return_grads_local(
            gslots, gcanon, moves, num_devices=num_devices)
      return (_add_sums(g_acc, g), next_slots, gslots, gcanon), metrics

    # Slot gradients are per data row until the end: so are their sums,
    # summed over 'data' once, after the last micro-step.
    gcanon0 = tuple(ep_lib.vary(g, (DATA,)) for g in _zero_sums(canon))
    carry = (_zero_sums(nonexp_l), slots, _zero_sums(slots[:3]), gcanon0)
    xs = (bt['tokens_MbT'], bt['valid_MbT'], bt['routes_MLbTK'],
          bt['loss_mask_MbT'], placement, transfer['steps'], ex['adv_Mb'],
          ex.get('old_logp_MbT'), ex.get('ref_logp_MbT'),
          bt.get('rollout_logp_MbT'), jnp.arange(num_micro, dtype=jnp.int32))
    # The last micro-step's backward flushed every slot (its gslots are
    # spent): nothing more to return.
    (g_acc, _, _, gcanon), metrics_M = jax.lax.scan(body, carry, xs)
    return reduce_step(g_acc, gcanon, metrics_M)

  def local_canonical(nonexp_l, experts_l, bt, ex, denoms):
    # Static EP as a trainer without slots runs it: every device computes
    # its home experts, nothing is filled, moved or returned. The experts
    # are cast to the compute copy's dtype once a step (as the slot path
    # fills its slots) and made per data row, so each row sums its own
    # gradients until the one reduction after the last micro-step.
    nonexp_l = jax.tree.map(lambda x: ep_lib.vary(x, rows), nonexp_l)
    canon = tuple(ep_lib.vary(w.astype(slot_dtype), (DATA,)) for w in
                  canonical_experts(experts_l, moe_segments))
    experts_c = replace_experts(experts_l, moe_segments, canon)

    def body(carry, xs):
      g_acc, g_exp = carry
      toks, valid, routes, mask, adv, old, ref, rollout = xs
      (g, g_e), metrics = canonical_grad_fn(
          nonexp_l, experts_c, None, None, None, None, toks, valid, routes,
          None, mask, adv, old, ref, rollout, denoms)
      metrics['nonfinite'] = (~(jnp.isfinite(metrics['loss'])
                                & all_finite((g, g_e)))).astype(jnp.int32)
      # Nothing travels: no slot can hold a wrong expert.
      metrics['transfer_id_errors'] = ep_lib.vary(
          jnp.zeros((), jnp.int32), (EXPERT,))
      return (_add_sums(g_acc, g), _add_sums(g_exp, g_e)), metrics

    xs = (bt['tokens_MbT'], bt['valid_MbT'], bt['routes_MLbTK'],
          bt['loss_mask_MbT'], ex['adv_Mb'], ex.get('old_logp_MbT'),
          ex.get('ref_logp_MbT'), bt.get('rollout_logp_MbT'))
    (g_acc, g_exp), metrics_M = jax.lax.scan(
        body, (_zero_sums(nonexp_l), _zero_sums(experts_c)), xs)
    return reduce_step(g_acc, canonical_experts(g_exp, moe_segments),
                       metrics_M)

  metric_keys = ['loss', 'pg_loss', 'kl', 'ratio_mean', 'clip_frac',
                 'dual_clip_frac', 'indexer_loss', 'balance_loss', 'dropped',
                 'max_rows', 'nonfinite', 'transfer_id_errors']
  if has_rollout:
    metric_keys.append('rollout_gap')
  prefilled = logps.get('prefill_slots')
  out_specs = (_replicated_specs(nonexp), (P(None, EXPERT),) * 3,
               {k: P() for k in metric_keys})
  if canonical:
    fn = jax.shard_map(
        local_canonical, mesh=mesh,
        in_specs=(_replicated_specs(nonexp), _expert_state_specs(experts),
                  _batch_specs(local_batch), extra_specs,
                  {k: P() for k in denoms}),
        out_specs=out_specs)
    g_nonexp, gcanon, metrics_M = fn(nonexp, experts, local_batch, extra,
                                     denoms)
  else:
    fn = jax.shard_map(
        local, mesh=mesh,
        in_specs=(_replicated_specs(nonexp), _expert_state_specs(experts),
                  _batch_specs(local_batch), extra_specs,
                  placement_specs(plan.placement),
                  _transfer_specs(plan.transfer), {k: P() for k in denoms},
                  None if prefilled is None else (P(None, EXPERT),) * 4),
        out_specs=out_specs)
    g_nonexp, gcanon, metrics_M = fn(nonexp, experts, local_batch, extra,
                                     plan.placement, plan.transfer, denoms,
                                     prefilled)
  g_experts = replace_experts(experts, moe_segments, gcanon)
  grads = nnx.merge_state(g_nonexp, g_experts)
  per_step = ('dropped', 'max_rows', 'transfer_id_errors', 'nonfinite',
              'rollout_gap')
  metrics = {k: v.sum() for k, v in metrics_M.items() if k not in per_step}
  metrics.update(dropped=metrics_M['dropped'].sum(),
                 max_rows_M=metrics_M['max_rows'],
                 transfer_id_errors=metrics_M['transfer_id_errors'].sum(),
                 nonfinite_M=metrics_M['nonfinite'],
                 adv_abs_mean=jnp.abs(adv_B).mean())
  if has_rollout:
    metrics['rollout_vs_update_logp_max_abs'] = metrics_M['rollout_gap'].max()
  if 'rollout_vs_recompute_logp_max_abs' in logps:
    metrics['rollout_vs_recompute_logp_max_abs'] = logps[
        'rollout_vs_recompute_logp_max_abs']
  return grads, metrics


# Metrics of the update epochs: these are also kept per epoch (`<name>_U`);
# the step's value is the mean over epochs, except the ones below.
PER_EPOCH_METRICS = ('loss', 'pg_loss', 'kl', 'ratio_mean', 'clip_frac',
                     'grad_norm')
# Same in every epoch (routes, plan and advantages do not change), or only
# meaningful at the policy that sampled: epoch 0's.
_FIRST_EPOCH_METRICS = ('dropped', 'max_rows_M', 'adv_abs_mean',
                        'rollout_vs_recompute_logp_max_abs',
                        'rollout_vs_update_logp_max_abs')
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


OLD_LOGP_SOURCES = ('recompute', 'rollout')
# The objective options `grpo.check_objective` validates when the step is
# built (rather than at its first trace).
_OBJECTIVE_CHECKED = ('loss_agg_mode', 'kl_estimator', 'policy_loss_mode',
                      'clip_ratio_c', 'loss_scale_factor')


class RLStep:
  """The two jitted halves of one RL step, and both in one call.

  `recompute(state, batch, plan)` runs only the forwards the step needs
  (`recompute_passes`): the reference policy's when beta > 0, and the old
  policy's only with more than one update epoch and old log-probs
  recomputed rather than taken from the rollout. At one epoch the old
  policy is the one being updated, so the update uses its own log-probs,
  detached (the ratio is 1), as TRL does at num_iterations = 1. Its plan
  is the step-level placement, known before the micro-step plan.
  `update(state, batch, logps, plan)` then runs `num_update_epochs`
  (GRPO's mu) optimizer updates on the same batch against the same old
  log-probs: each moves weights, runs the M micro-steps and applies one
  optimizer update (the state is donated). The plan is reused by every
  epoch: routes are replayed, so the loads it was made for do not change.
  From the second epoch on the policy differs from the old one, the ratio
  leaves 1 and the PPO clip acts. state.step counts RL steps (one per
  call), not optimizer updates.

  old_logp_source (used when num_update_epochs > 1): 'recompute' runs the
  old policy's forward; 'rollout' takes the sampler's log-probs, which are
  the same model with the same routes replayed (they differ from a
  recompute by float rounding only: `rollout_vs_update_logp_max_abs`
  measures it every step).
  """

  def __init__(self, tx: optax.GradientTransformation, *,
               num_update_epochs: int = 1, old_logp_source: str = 'recompute',
               **loss_kw):
    if num_update_epochs < 1:
      raise ValueError(f'num_update_epochs must be >= 1, got '
                       f'{num_update_epochs}.')
    if old_logp_source not in OLD_LOGP_SOURCES:
      raise ValueError(f'old_logp_source must be one of {OLD_LOGP_SOURCES}, '
                       f'got {old_logp_source!r}.')
    grpo.check_objective(**{k: loss_kw[k] for k in _OBJECTIVE_CHECKED
                            if k in loss_kw})
    self.tx = tx
    self.num_update_epochs = int(num_update_epochs)
    self.old_logp_source = old_logp_source
    self.beta = float(loss_kw.get('beta', 0.0))
    self.loss_kw = dict(loss_kw)  # update_grads' options, as given.
    self._recompute = jax.jit(recompute_logps,
                              static_argnames=('old', 'ref', 'prefill'))

    def one_update(state: TrainState, batch, logps, plan):
      grads, metrics = update_grads(state, batch, logps, plan, **loss_kw)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      metrics['grad_norm'] = optax.tree.norm(grads)
      return dataclasses.replace(state, params=params,
                                 opt_state=opt_state), metrics

    def update(state: TrainState, batch: dict, logps: dict, plan: StepPlan):
      if 'prefill_slots' in logps and self.num_update_epochs > 1:
        raise ValueError(
            'prefilled slots hold the weights before the first epoch; '
            f'{self.num_update_epochs} update epochs refill from home.')
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

  def recompute_passes(self, has_ref: bool = True) -> dict:
    """{'old': bool, 'ref': bool}: the forwards `recompute` runs."""
    return dict(old=(self.num_update_epochs > 1
                     and self.old_logp_source == 'recompute'),
                ref=self.beta > 0 and has_ref)

  def recompute_forward_passes(self, has_ref: bool = True) -> int:
    return sum(self.recompute_passes(has_ref).values())

  def can_prefill(self, plan, has_ref: bool = True) -> bool:
    """Whether the recompute on `plan` can fill the update's slots: it
    runs a forward, on a StepPlan (slots to fill), and the update has one
    epoch (a later epoch's weights are not known before the first)."""
    return (isinstance(plan, StepPlan) and self.num_update_epochs == 1
            and self.recompute_forward_passes(has_ref) > 0)

  def recompute(self, state: TrainState, batch: dict, plan=None,
                prefill: bool = False) -> dict:
    """The log-probs the update needs besides its own (asynchronous; an
    empty dict when it needs none: no device work at all). prefill: also
    fill the update's slots for the plan's placement under the forward
    (`recompute_logps`; only where `can_prefill`)."""
    passes = self.recompute_passes(state.ref_params is not None)
    if prefill and not self.can_prefill(plan, state.ref_params is not None):
      raise ValueError(
          'the recompute can prefill the update\'s slots only on a StepPlan, '
          'with a forward to run and one update epoch.')
    if not isinstance(plan, StepPlan):
      plan = _as_layout(plan)
    out = {}
    if passes['old'] or passes['ref']:
      out = dict(self._recompute(state, batch, plan, prefill=prefill,
                                 **passes))
    if self.num_update_epochs > 1 and self.old_logp_source == 'rollout':
      out['old_logp_MbT'] = batch['rollout_logp_MbT']
    return out

  def __call__(self, state: TrainState, batch: dict, plan: StepPlan,
               recompute_plan=None):
    """recompute (plan: `recompute_plan`; None, the canonical layout) then
    update."""
    logps = self.recompute(state, batch, recompute_plan)
    return self.update(state, batch, logps, plan)


def make_rl_step(tx: optax.GradientTransformation, *, num_generations: int,
                 eps_low: float, eps_high: float, beta: float,
                 indexer_loss_coef: float = 1.0,
                 balance_loss_coef: float = 0.0,
                 num_update_epochs: int = 1,
                 old_logp_source: str = 'recompute',
                 **objective) -> RLStep:
  """Builds the jit-compiled pure RL step (see `RLStep`).

  objective: the objective's options, as `update_grads` takes them
  (loss_agg_mode, loss_scale_factor, clip_ratio_c, kl_estimator,
  adv_std_ddof, norm_adv_by_std, policy_loss_mode, gspo_eps_low,
  gspo_eps_high; `objective_options` reads them from a config); absent
  ones keep their defaults.
  """
  unknown = set(objective) - set(OBJECTIVE_OPTIONS)
  if unknown:
    raise ValueError(f'unknown objective options {sorted(unknown)}; known: '
                     f"{', '.join(OBJECTIVE_OPTIONS)}.")
  _check_scale_factor(objective.get('loss_agg_mode'),
                      objective.get('loss_scale_factor'))
  return RLStep(tx, num_update_epochs=num_update_epochs,
                old_logp_source=old_logp_source,
                num_generations=num_generations, eps_low=eps_low,
                eps_high=eps_high, beta=beta,
                indexer_loss_coef=indexer_loss_coef,
                balance_loss_coef=balance_loss_coef, **objective)


def _check_scale_factor(loss_agg_mode, loss_scale_factor) -> None:
  """Dr.GRPO's constant must be given to the step: `grpo.loss_weights`
  falls back to the mask's width, which here spans the prompt's positions
  too (the loss mask covers all T - 1 targets), not the completion's."""
  if loss_agg_mode == 'seq-mean-token-sum-norm' and not loss_scale_factor:
    raise ValueError(
        "loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor "
        '(the longest completion, as `objective_options` sets it): the RL '
        "step's loss mask spans prompt and completion, so its width is not "
        "Dr.GRPO's constant.")


OBJECTIVE_OPTIONS = ('loss_agg_mode', 'loss_scale_factor', 'clip_ratio_c',
                     'kl_estimator', 'adv_std_ddof', 'norm_adv_by_std',
                     'policy_loss_mode', 'gspo_eps_low', 'gspo_eps_high')


def objective_options(rl_config, completion_len: int) -> dict:
  """`make_rl_step`'s objective options from config.rl (absent fields take
  `config.rl_objective_defaults()`, so old configs and checkpoints run as
  before). loss_scale_factor 0 (or None) becomes the task's completion
  length: Dr.GRPO's constant is the longest completion the sampler can
  write (TRL's max_completion_length; verl's response length)."""
  o = config_lib.rl_objective(rl_config)
  return dict(loss_agg_mode=o['loss_agg_mode'],
              loss_scale_factor=float(o['loss_scale_factor']
                                      or completion_len),
              clip_ratio_c=float(o['clip_ratio_c'] or 0.0) or None,
              kl_estimator=o['kl_estimator'],
              adv_std_ddof=int(o['adv_std_ddof']),
              norm_adv_by_std=bool(o['norm_adv_by_std']),
              policy_loss_mode=o['policy_loss'],
              gspo_eps_low=float(o['gspo_eps_low']),
              gspo_eps_high=float(o['gspo_eps_high']))


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
