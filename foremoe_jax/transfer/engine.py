"""The transfer engine on device: slot buffers filled by rounds of ppermute.

Each EP device holds `s` slot buffers per MoE layer (the weights of the
experts its slots hold in the current micro-step) next to its `h = E / D`
canonical experts, which never move. A host-built `Transition`
(foremoe_jax/transfer/schedule.py) says how to go from one placement's slots
to the next:

* local copies first: a slot whose new expert already sits on this device
  (in another slot, or as a canonical home expert) copies it, no traffic;
* then R rounds (R static): in round r every device sends at most one
  expert to the device `shift[r]` places after it and receives at most one.
  A round is one `jax.lax.ppermute` whose cyclic shift is picked at run time
  (`lax.switch` over the D - 1 static shifts; shift 0 sends nothing), so a
  new schedule never recompiles and the bytes on the wire are bounded by
  R experts per device, whatever E is.

Expert ids travel with the weights (an int32 leaf beside them), so the
device can check that each slot holds the expert the plan says.

Gradients go the other way. A slot accumulates the gradient of its weights
while it keeps its expert; when a transition evicts the expert (or at the
end of the step, the flush), the accumulated gradient goes to the expert's
home device and is added into the canonical gradient: locally when the slot
sits on the home device, else by rounds built like the fills.

Overlap. The update issues micro-step m+1's fills in the same scan
iteration as micro-step m's compute, reading only the buffers m computes
with, so no data dependence orders them. Whether they then run concurrently
is the scheduler's choice: on GPU, XLA's latency-hiding scheduler with
asynchronous collectives (`--xla_gpu_enable_latency_hiding_scheduler=true`,
on by default in recent jaxlib; `--xla_gpu_enable_pipelined_collectives`
for loops); on TPU `--xla_tpu_enable_latency_hiding_scheduler=true` and
`--xla_enable_async_collective_permute=true`. One caveat: a round's
ppermute sits inside the `lax.switch` that picks its shift, and XLA
schedules a conditional's collectives inside the branch, so they overlap
work in the same branch only; on CPU collectives are synchronous anyway.
The benchmark therefore reports the *exposed* transfer time directly
(experiments/bench_rl_step.py).

Everything here runs per device under `jax.shard_map` over the ('data',
'expert') mesh; slot buffers and canonical experts are replicated over
'data', so every data row moves the same weights over its own 'expert' ring.

Shape letters: L MoE layers, S slots (global), s slots per device, h
canonical experts per device, D EP devices, R rounds, X... any expert
leaf's trailing dims.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from foremoe_jax.model.expert_parallel import EXPERT

# Fields of a schedule Transition the device reads (the rest is host
# bookkeeping for metrics).
DEVICE_FIELDS = ('local_src_LS', 'shift_LR', 'send_LRD', 'recv_LRD',
                 'evict_LS', 'ret_local_LS', 'ret_shift_LR', 'ret_send_LRD',
                 'ret_recv_LRD')


def device_transition(transition) -> dict:
  """The device half of a schedule Transition (numpy in, jnp arrays out)."""
  return {f: jnp.asarray(getattr(transition, f)) for f in DEVICE_FIELDS}


def device_step_transfer(step_transfer) -> dict:
  """fill / steps (stacked over micro-steps) / flush, device fields only."""
  return {k: device_transition(getattr(step_transfer, k))
          for k in ('fill', 'steps', 'flush')}


def _shifted(tree, shift, num_devices: int):
  """`tree` sent `shift` devices along the 'expert' ring (0: zeros, no send)."""
  def send(k):
    perm = [(d, (d + k) % num_devices) for d in range(num_devices)]
    return lambda t: jax.tree.map(
        lambda x: jax.lax.ppermute(x, EXPERT, perm), t)
  branches = [lambda t: jax.tree.map(jnp.zeros_like, t)]
  branches += [send(k) for k in range(1, num_devices)]
  if num_devices == 1:
    return branches[0](tree)
  return jax.lax.switch(shift, branches, tree)


def _pick(slots, canon, index):
  """Entries `index` (scalar or [n]) of this device's source list
  [slots..., canon...] (one tree of leaves [s, X...] and one of [h, X...])."""
  num_slots = jax.tree.leaves(slots)[0].shape[0]
  num_home = jax.tree.leaves(canon)[0].shape[0]
  in_slots = index < num_slots
  i_slot = jnp.clip(index, 0, num_slots - 1)
  i_canon = jnp.clip(index - num_slots, 0, num_home - 1)

  def one(a, b):
    cond = jnp.reshape(in_slots, jnp.shape(in_slots) + (1,) * (a.ndim - 1))
    return jnp.where(cond, a[i_slot], b[i_canon])
  return jax.tree.map(one, slots, canon)


def _write(buf, slot, value):
  """buf[slot] = value where slot >= 0 (else unchanged)."""
  def one(x, v):
    j = jnp.maximum(slot, 0)
    return x.at[j].set(jnp.where(slot >= 0, v, x[j]))
  return jax.tree.map(one, buf, value)


def _rounds(shift_R, one_round, init):
  """fori_loop over the budget's rounds, skipping idle ones (shift 0): an
  idle round would still pick and write a whole expert for nothing."""
  def step(r, carry):
    return jax.lax.cond(shift_R[r] != 0, lambda c: one_round(r, c),
                        lambda c: c, carry)
  return jax.lax.fori_loop(0, shift_R.shape[0], step, init)


def _where_rows(mask_s, a, b):
  return jax.tree.map(lambda x, y: jnp.where(
      mask_s.reshape((-1,) + (1,) * (x.ndim - 1)), x, y), a, b)


def _layer_fill(slots, canon, t, me, spd: int, num_devices: int):
  """One layer's fills on this device: local copies, then the rounds.

  Every source is read from the buffers as they were before the transition
  (within a step all copies of an expert are equal, so order is free). The
  rounds are a fori_loop, so compile time does not grow with the budget.
  """
  local_s = jax.lax.dynamic_slice_in_dim(t['local_src_LS'], me * spd, spd)
  new = _where_rows(local_s >= 0, _pick(slots, canon, local_s), slots)

  def one_round(r, new):
    item = _pick(slots, canon, t['send_LRD'][r, me])
    got = _shifted(item, t['shift_LR'][r], num_devices)
    return _write(new, t['recv_LRD'][r, me], got)
  return _rounds(t['shift_LR'], one_round, new)


def _layer_returns(gslots, gcanon, t, me, spd: int, num_devices: int):
  """Evicted slots' gradients added into their home's canonical gradient,
  then zeroed (the slot starts accumulating for its new expert)."""
  evict_s = jax.lax.dynamic_slice_in_dim(t['evict_LS'], me * spd, spd)
  local_s = jax.lax.dynamic_slice_in_dim(t['ret_local_LS'], me * spd, spd)
  num_home = jax.tree.leaves(gcanon)[0].shape[0]
  # -1 (nothing to add here) becomes an out-of-range index that 'drop' skips.
  target_s = jnp.where(local_s >= 0, local_s, num_home)
  gcanon = jax.tree.map(lambda c, g: c.at[target_s].add(g, mode='drop'),
                        gcanon, gslots)

  def one_round(r, gcanon):
    item = jax.tree.map(lambda g: g[t['ret_send_LRD'][r, me]], gslots)
    got = _shifted(item, t['ret_shift_LR'][r], num_devices)
    dst = t['ret_recv_LRD'][r, me]
    return jax.tree.map(
        lambda c, v: c.at[jnp.where(dst >= 0, dst, num_home)].add(
            v, mode='drop'), gcanon, got)
  gcanon = _rounds(t['ret_shift_LR'], one_round, gcanon)
  gslots = _where_rows(evict_s, jax.tree.map(jnp.zeros_like, gslots), gslots)
  return gslots, gcanon


def _specs(tree):
  return jax.tree.map(lambda _: P(EXPERT), tree)


def _replicated(tree):
  return jax.tree.map(lambda _: P(), tree)


def _layer_args(transition, l):
  return {k: v[l] for k, v in transition.items()}


def fill_slots(slots_L: Sequence[Any] | None, canon_L: Sequence[Any],
               transition: dict, *, mesh):
  """Slot buffers after one transition.

  Args:
    slots_L: per MoE layer, a tuple (weight buffers..., ids): each weight
      buffer [S, X...] and the int32 ids [S] of the experts they hold, all
      sharded over 'expert' (the previous micro-step's), or None for empty
      buffers (the step's first fill).
    canon_L: per MoE layer, a tuple of the matching canonical experts
      [E, X...] sharded over 'expert'.
    transition: `device_transition(...)` of a schedule Transition.
  Returns:
    slots_L in the same layout. The ids travelled with the weights: compare
    them with the placement's slot_expert to check the transfer.
  """
  num_devices = mesh.shape[EXPERT]
  num_slots = transition['local_src_LS'].shape[1]
  spd = num_slots // num_devices
  canon_L = [tuple(c) for c in canon_L]
  if slots_L is None:
    # Empty buffers: zeros that the schedule never reads (it only sends
    # canonical experts when there is no previous placement).
    slots_L = [tuple(jnp.zeros((num_slots,) + w.shape[1:], w.dtype)
                     for w in c) + (jnp.full((num_slots,), -1, jnp.int32),)
               for c in canon_L]
  slots_L = [tuple(s) for s in slots_L]

  def body(slots_L, canon_L, t):
    me = jax.lax.axis_index(EXPERT)
    out = []
    for l, (slots, canon) in enumerate(zip(slots_L, canon_L)):
      num_home = canon[0].shape[0]
      ids_h = me * num_home + jnp.arange(num_home, dtype=jnp.int32)
      out.append(tuple(_layer_fill(slots, canon + (ids_h,),
                                   _layer_args(t, l), me, spd, num_devices)))
    return out

  fn = jax.shard_map(body, mesh=mesh,
                     in_specs=(_specs(slots_L), _specs(canon_L),
                               _replicated(transition)),
                     out_specs=_specs(slots_L))
  return fn(slots_L, canon_L, transition)


def return_grads(gslots_L: Sequence[Any], gcanon_L: Sequence[Any],
                 transition: dict, *, mesh):
  """Sends the gradients of the slots a transition evicts to their homes.

  Args:
    gslots_L: per MoE layer, a tuple of accumulated slot gradients [S, X...].
    gcanon_L: per MoE layer, the canonical gradients [E, X...] so far.
    transition: `device_transition(...)`; a flush evicts every slot.
  Returns:
    (gslots_L with evicted slots zeroed, gcanon_L with their gradients added).
  """
  num_devices = mesh.shape[EXPERT]
  num_slots = transition['evict_LS'].shape[1]
  spd = num_slots // num_devices
  gslots_L = [tuple(g) for g in gslots_L]
  gcanon_L = [tuple(g) for g in gcanon_L]

  def body(gslots_L, gcanon_L, t):
    me = jax.lax.axis_index(EXPERT)
    out_s, out_c = [], []
    for l, (gs, gc) in enumerate(zip(gslots_L, gcanon_L)):
      gs, gc = _layer_returns(gs, gc, _layer_args(t, l), me, spd, num_devices)
      out_s.append(gs)
      out_c.append(gc)
    return out_s, out_c

  fn = jax.shard_map(body, mesh=mesh,
                     in_specs=(_specs(gslots_L), _specs(gcanon_L),
                               _replicated(transition)),
                     out_specs=(_specs(gslots_L), _specs(gcanon_L)))
  return fn(gslots_L, gcanon_L, transition)


def id_errors(slots_L: Sequence[Any], slot_expert_LS, *, mesh):
  """Slots whose travelled expert id differs from the plan's: int32 [].

  Compared where the slots live (one psum of a scalar), so checking the
  transfer adds no gather of the ids.
  """
  ids_L = [s[-1] for s in slots_L]

  def body(ids_L, se_LS):
    me = jax.lax.axis_index(EXPERT)
    spd = ids_L[0].shape[0]
    bad = sum((ids != jax.lax.dynamic_slice_in_dim(se_LS[l], me * spd, spd)
               ).sum() for l, ids in enumerate(ids_L))
    return jax.lax.psum(bad.astype(jnp.int32), EXPERT)

  return jax.shard_map(body, mesh=mesh, in_specs=(_specs(ids_L), P()),
                       out_specs=P())(ids_L, slot_expert_LS)
