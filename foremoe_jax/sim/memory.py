"""Per-device memory of the RL update, counted from the shapes.

What one device holds while the update (`rl/step.py`) runs, component by
component, in bytes, for a model shape and a workload: the training state
(float32 master weights, AdamW's two float32 moments, the float32
gradient sums the step accumulates), the slot buffers of the transfer
engine (two copies in the moved dtype while a transition fills the next
placement from the current one, and their float32 gradients), the
activations the backward keeps, and the largest transient of one layer
(its attention scores, its expert dispatch buffers) and of the chunked
log-probs. `experiments/memory_report.py` checks this count against XLA's
own buffer assignment of the compiled step at reduced depth.

Assumptions, each a property of the code as built:
* the step is the per-device shard_map of rl/step.py: non-expert
  parameters replicated (or over 'data' with FSDP, gathered once per
  step), canonical experts sharded over 'expert';
* layers are scanned (§4.6 of docs/design.md); with `remat_policy='full'`
  the backward keeps one residual stream [tokens, M] per layer and
  recomputes each layer, so one layer's activations are live at a time;
* dense attention is the jnp einsum (no flash kernel): a layer's scores
  [b, H, T, T] exist in float32, with their softmax and its gradient;
* the exact dispatch's receive buffer holds `capacity_rows` rows, the
  grouped GEMM's tiled copy of them as many again, and its hidden
  activations [rows, F] three times (gate, up, product);
* target log-probs run `logp_chunk` tokens at a time (float32 logits and
  their gradient);
* the transfer engine's exchanges run one layer at a time (a scan), each
  with a send and a receive buffer sized by the budget's degree R
  (`transfer.schedule.TransferBudget`) and the device's role
  (`schedule.exchange_widths`, `schedule.flush_form`): the flush's
  gradient return in float32 (it sits in every micro-step's backward,
  switched off but allocated in all but the last), one stage of it live
  at a time: s + (s + h) experts as a reduction tree where R = step_rounds
  is large against s + h (`flush_form`), else min(s, R) + R; beside it
  the returns of the replicas the moves between micro-steps evict (in
  the same hook with the exact exchanges on GPU/TPU), float32, min(s, R)
  + R, R = microstep_rounds; and a fill between micro-steps in the moved
  dtype (R + min(s, R) experts), counted beside them though it runs in
  the forward (an upper bound).
  The step's first fill (one collective of R + min(s, R) experts, or a
  broadcast tree of (s + h) + s a stage: `fill_form`) runs before the
  update's first forward, or under the recompute, and is gone by the
  backward's peak, so it is not counted;
* each micro-step's backward writes its gradients of the non-expert
  parameters and of the slots afresh, in float32, and only then are they
  added into the step's sums (`update_grads`' scan body), so one
  micro-step's worth of them is live beside the sums at the backward's
  end; the canonical experts' sums are the backward's own output
  (`engine.returns_in_backward`), counted twice (carried and new);
* each device holds its own rows of the step's transitions
  (`engine.transition_specs`): per layer and transition, its sends and
  receives, count rows [D] and shift depths [D] per exchange (a flush
  tree has one per stage), slot fields [s].

Shape letters: L layers, E experts, D EP devices, s slots per device, T
tokens, M model dim, F expert hidden dim, V vocab.
"""
from __future__ import annotations

import dataclasses

from foremoe_jax.planner.topology import Topology
from foremoe_jax.sim.workload import ModelShape, Workload
from foremoe_jax.transfer import schedule as transfer_schedule

F32 = 4
# float32 master + AdamW's two float32 moments.
_STATE_BYTES_PER_PARAM = 3 * F32


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
  """Bytes per device, by what holds them."""

  nonexpert_state: float  # master + moments (FSDP-sharded when on)
  nonexpert_grads: float  # float32 gradient sums of the step
  nonexpert_gathered: float  # FSDP: the whole parameters, gathered per step
  expert_state: float  # canonical experts: master + moments
  expert_grads: float  # float32 canonical gradient sums, twice: the
  #                      carried sums and the new sums a micro-step's
  #                      backward writes (their cotangent,
  #                      `engine.returns_in_backward`)
  slot_weights: float  # two copies of the slot buffers (moved dtype); one
  # of the home experts on the canonical layout
  slot_grads: float  # float32 slot gradient sums
  microstep_grads: float  # one micro-step's float32 gradients of the
  #                         non-expert parameters and the slots, fresh
  #                         from its backward before they are added into
  #                         the sums
  saved_activations: float  # what the backward keeps, all layers
  layer_transient: float  # the largest layer's live intermediates
  logp_transient: float  # one chunk of float32 logits and their gradient
  batch: float  # the step's tokens, masks, routes, log-probs
  exchange_buffers: float  # one layer's transfer send/receive buffers
  transfer_schedule: float  # this device's rows of the step's transitions

  @property
  def total(self) -> float:
    return float(sum(dataclasses.asdict(self).values()))

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), total=self.total)


def update_memory(model: ModelShape, work: Workload, *, ep: int,
                  slots_per_device: int, capacity_rows: int,
                  remat_policy: str = 'full', fsdp_shards: int = 1,
                  logp_chunk: int = 2048,
                  compute_bytes: int | None = None,
                  step_rounds: int | None = None,
                  microstep_rounds: int = 2,
                  flush: str = 'auto',
                  canonical: bool = False) -> MemoryBreakdown:
  """Per-device bytes of the update (module docstring).

  ep: EP devices (experts per device E / ep). capacity_rows: the exact
  dispatch's receive bucket R (or D * C for padded cells). fsdp_shards:
  the 'data' axis size when FSDP shards the non-expert state (1: off).
  compute_bytes: the compute dtype's size (default: the model's param
  dtype, bf16 in the real configs). step_rounds, microstep_rounds, flush:
  the transfer budget (default: the trainer's, step_rounds = ep) and the
  flush's form (`transfer.schedule.flush_form`). canonical: static EP's
  update on the canonical layout (`rl.step.CanonicalLayout`): one compute
  copy of the home experts in place of the slots (and no slot gradients
  beside the home sums, no exchange buffers, no transfer schedule).
  """
  cb = model.bytes_per_param if compute_bytes is None else compute_bytes
  tokens = work.tokens_per_device
  seqs, seq_len = work.seqs_per_microbatch, work.tokens_per_seq
  nonexp = model.nonexpert_params()
  nonexpert_state = nonexp * _STATE_BYTES_PER_PARAM / fsdp_shards
  nonexpert_grads = nonexp * F32
  gathered = nonexp * F32 if fsdp_shards > 1 else 0.0
  experts_here = model.num_moe_layers * (model.num_experts // ep)
  expert_params = experts_here * model.params_per_expert
  slot_params = model.num_moe_layers * (
      model.num_experts // ep if canonical else slots_per_device
  ) * model.params_per_expert
  # Backward keeps: per layer its input residual ('full' remat) or, without
  # remat, the block's activations too (attention q, k, v, output, the FFN
  # input and the expert rows' g, u and product).
  per_layer_saved = tokens * model.d_model * cb
  if remat_policy == 'none':
    attn = tokens * model.head_dim * (2 * model.num_heads
                                      + 2 * model.num_kv_heads) * cb
    scores = seqs * model.num_heads * seq_len * seq_len * F32
    ffn = capacity_rows * (model.d_model + 3 * model.moe_d_ff) * cb
    per_layer_saved += attn + scores + ffn
  saved = model.num_layers * per_layer_saved
  # One layer live at a time: its attention (scores, probabilities and
  # their gradient) or its expert compute, whichever is larger, plus the
  # layer's own inputs and outputs.
  attention_transient = 3 * seqs * model.num_heads * seq_len * seq_len * F32
  moe_transient = (2 * capacity_rows * model.d_model * cb
                   + 3 * capacity_rows * model.moe_d_ff * cb
                   + 4 * tokens * model.top_k * model.d_model * cb)
  layer_transient = (max(attention_transient, moe_transient)
                     + 4 * tokens * model.d_model * cb)
  chunk = min(logp_chunk, tokens)
  logp_transient = 2 * chunk * model.vocab_size * F32
  m = work.num_microsteps
  batch = m * tokens * (4 + 1 + 4 + 4) + (
      m * model.num_moe_layers * tokens * model.top_k * 2)
  r_step = ep if step_rounds is None else step_rounds
  topo = Topology(1, ep, slots_per_device)
  stages, flush_send, flush_recv = transfer_schedule.flush_form(
      r_step, model.num_experts, topo, flush)
  move = transfer_schedule.exchange_widths(microstep_rounds, topo)
  exchange = model.params_per_expert * (
      (flush_send + flush_recv + move['ret_send'] + move['ret_recv']) * F32
      + (move['send'] + move['recv']) * model.bytes_per_param)

  # Per layer and transition (int32): the fills' sends and receives and
  # the returns', per stage, per exchange the count rows [D] (sent,
  # received, output offsets) and the shift depths [K = D], and the slot
  # fields [s] (two int32, one bool). The first fill's stages follow
  # `fill_form` (a broadcast tree or one collective), the flush's
  # `flush_form`; every other exchange is one collective.
  def rows(r, kind='move'):
    w = transfer_schedule.exchange_widths(r, topo)
    f = ((1, w['send'], w['recv']) if kind != 'fill' else
         transfer_schedule.fill_form(r, model.num_experts, topo, flush))
    g = ((stages, flush_send, flush_recv) if kind == 'flush'
         else (1, w['ret_send'], w['ret_recv']))
    return (4 * (f[0] * (f[1] + f[2]) + g[0] * (g[1] + g[2]))
            + 4 * 4 * ep * (f[0] + g[0]) + 9 * slots_per_device)
  schedule = model.num_moe_layers * (rows(r_step, 'fill')
                                     + rows(r_step, 'flush')
                                     + m * rows(microstep_rounds))
  if canonical:
    exchange = schedule = 0
  return MemoryBreakdown(
      nonexpert_state=nonexpert_state, nonexpert_grads=nonexpert_grads,
      nonexpert_gathered=gathered,
      expert_state=expert_params * _STATE_BYTES_PER_PARAM,
      expert_grads=2 * expert_params * F32,
      # Two buffers (double-buffered moves); the canonical layout's one copy.
      slot_weights=(1 if canonical else 2) * slot_params
      * model.bytes_per_param,
      slot_grads=0 if canonical else slot_params * F32,
      microstep_grads=(nonexp + slot_params) * F32,
      saved_activations=saved, layer_transient=layer_transient,
      logp_transient=logp_transient, batch=batch, exchange_buffers=exchange,
      transfer_schedule=schedule)
