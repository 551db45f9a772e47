"""Expert parallelism where the placement of experts is runtime data.

The MoE FFN's dispatch -> expert compute -> combine, under `jax.shard_map` over
a ('data', 'expert') mesh. Tokens are sharded over both axes (data-major);
canonical expert weights [E, ...] are sharded over 'expert'. Each EP device
holds `s` slots; a `Placement` (see foremoe_jax/placement.py) says which expert
sits in each slot and how each source device splits its tokens for an expert
across that expert's replicas. Placement arrays are ordinary jit inputs, so a
new placement never recompiles anything.

Dispatch is into per-(source device, slot) capacity buffers of static size C,
exchanged by `all_to_all` over 'expert'; every device computes D * s * C rows,
so C (picked from a few static buckets) is what balance buys back.

Shape letters: N tokens on this device, K top-k, A = N*K assignments,
E experts, D EP devices, S slots (= D * s), C capacity per cell,
M model dim, F expert hidden dim.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

DATA, EXPERT = 'data', 'expert'


class DispatchStats(NamedTuple):
  """Per-layer dispatch statistics, summed over all devices."""
  dropped: jax.Array  # int32 []: assignments over capacity (not computed).
  max_cell: jax.Array  # int32 []: largest (source, slot) count; <= C is dropless.
  slot_tokens_S: jax.Array  # int32 [S]: assignments each slot received.


def slot_assignment(e_A, valid_A, slot_expert_S, share_S, num_experts):
  """Slot and in-slot position of each assignment, by the placement split rule.

  Source-local: ranks each assignment among this device's assignments to the
  same expert, then gives slot i of that expert the rank range
  [round(lo_i n), round(hi_i n)) (see foremoe_jax/placement.py).
  Returns (slot_A, pos_A, found_A, count_S).
  """
  onehot_AE = (e_A[:, None] == jnp.arange(num_experts)[None, :]) & valid_A[:, None]
  onehot_AE = onehot_AE.astype(jnp.int32)
  rank_A = jnp.take_along_axis(jnp.cumsum(onehot_AE, axis=0) - 1,
                               e_A[:, None], axis=1)[:, 0]
  n_E = onehot_AE.sum(axis=0)
  num_slots = slot_expert_S.shape[0]
  same_SS = slot_expert_S[:, None] == slot_expert_S[None, :]
  before_SS = jnp.tril(jnp.ones((num_slots, num_slots), bool), k=-1)
  share_S = share_S.astype(jnp.float32)
  # lo[s] = sum of shares of earlier slots holding the same expert.
  lo_S = jnp.einsum('t,st->s', share_S, (same_SS & before_SS).astype(jnp.float32))
  hi_S = lo_S + share_S
  n_S = n_E[slot_expert_S].astype(jnp.float32)
  start_S = jnp.floor(lo_S * n_S + 0.5).astype(jnp.int32)
  stop_S = jnp.floor(hi_S * n_S + 0.5).astype(jnp.int32)
  r = rank_A[:, None]
  cand_AS = ((slot_expert_S[None, :] == e_A[:, None]) & (start_S[None, :] <= r)
             & (r < stop_S[None, :]))
  slot_A = jnp.argmax(cand_AS, axis=1).astype(jnp.int32)
  found_A = cand_AS.any(axis=1) & valid_A
  pos_A = rank_A - start_S[slot_A]
  return slot_A, pos_A, found_A, stop_S - start_S


def _swiglu_slots(x_DsCM, wg_sMF, wu_sMF, wd_sFM):
  dtype = x_DsCM.dtype
  g = jnp.einsum('dscm,smf->dscf', x_DsCM, wg_sMF.astype(dtype))
  u = jnp.einsum('dscm,smf->dscf', x_DsCM, wu_sMF.astype(dtype))
  return jnp.einsum('dscf,sfm->dscm', jax.nn.silu(g) * u, wd_sFM.astype(dtype))


def _ep_body(x_NM, ids_NK, gates_NK, valid_N, wg_sMF, wu_sMF, wd_sFM,
             slot_expert_S, slot_share_DS, *, capacity, num_experts):
  """Per-device body under shard_map; lower-case s: this device's slots."""
  num_ep = jax.lax.axis_size(EXPERT)
  me = jax.lax.axis_index(EXPERT)
  num_tokens, top_k = ids_NK.shape
  num_slots = slot_expert_S.shape[0]
  spd = num_slots // num_ep
  model_dim = x_NM.shape[-1]

  e_A = ids_NK.reshape(-1).astype(jnp.int32)
  valid_A = jnp.repeat(valid_N, top_k)
  token_A = jnp.repeat(jnp.arange(num_tokens), top_k)
  slot_A, pos_A, found_A, count_S = slot_assignment(
      e_A, valid_A, slot_expert_S, slot_share_DS[me], num_experts)
  keep_A = found_A & (pos_A < capacity)
  flat_A = jnp.where(keep_A, slot_A * capacity + pos_A, num_slots * capacity)

  send_XM = jnp.zeros((num_slots * capacity, model_dim), x_NM.dtype)
  send_XM = send_XM.at[flat_A].add(x_NM[token_A], mode='drop')
  send_DsCM = send_XM.reshape(num_ep, spd, capacity, model_dim)
  recv_DsCM = jax.lax.all_to_all(send_DsCM, EXPERT, 0, 0, tiled=True)
  out_DsCM = _swiglu_slots(recv_DsCM, wg_sMF, wu_sMF, wd_sFM)
  back_DsCM = jax.lax.all_to_all(out_DsCM, EXPERT, 0, 0, tiled=True)

  back_XM = back_DsCM.reshape(num_slots * capacity, model_dim)
  y_AM = jnp.take(back_XM, jnp.minimum(flat_A, num_slots * capacity - 1), axis=0)
  w_A = jnp.where(keep_A, gates_NK.reshape(-1), 0).astype(y_AM.dtype)
  y_NM = (y_AM * w_A[:, None]).reshape(num_tokens, top_k, model_dim).sum(axis=1)

  axes = (DATA, EXPERT)
  dropped = jax.lax.psum((found_A & ~keep_A).sum().astype(jnp.int32), axes)
  max_cell = jax.lax.pmax(count_S.max().astype(jnp.int32), axes)
  slot_tokens_S = jax.lax.psum(count_S.astype(jnp.int32), axes)
  return y_NM, DispatchStats(dropped, max_cell, slot_tokens_S)


def _gather_body(w_eXY, slot_expert_S):
  num_ep = jax.lax.axis_size(EXPERT)
  spd = slot_expert_S.shape[0] // num_ep
  local_experts_s = jax.lax.dynamic_slice_in_dim(
      slot_expert_S, jax.lax.axis_index(EXPERT) * spd, spd)
  return jax.lax.all_gather(w_eXY, EXPERT, tiled=True)[local_experts_s]


def gather_slot_weights(w_EXY, slot_expert_S, *, mesh):
  """Slot weights [S, ...] (sharded over 'expert') from canonical [E, ...].

  This is the weight transfer of a placement; its transpose sums the slot
  gradients of a replicated expert onto the canonical weights (DESIGN.md §4).
  Computed once per placement, apart from the token path, so the transfer
  can be scheduled (and overlapped) independently of dispatch.
  """
  return jax.shard_map(_gather_body, mesh=mesh,
                       in_specs=(P(EXPERT), P()), out_specs=P(EXPERT))(
                           w_EXY, slot_expert_S)


def expert_parallel_ffn(x_NM, ids_NK, gates_NK, valid_N, wg_SMF, wu_SMF,
                        wd_SFM, slot_expert_S, slot_share_DS, *, mesh,
                        capacity: int, num_experts: int):
  """SwiGLU experts under expert parallelism with a runtime placement.

  Args:
    x_NM: all tokens (global view), sharded over ('data', 'expert').
    ids_NK, gates_NK: routed expert ids and gate weights per token.
    valid_N: bool; invalid tokens (padding) are not dispatched.
    wg_SMF, wu_SMF, wd_SFM: slot weights (`gather_slot_weights` of the
      canonical experts for this placement), sharded over 'expert'.
    slot_expert_S, slot_share_DS: one layer of a Placement.
    mesh: a mesh with 'data' and 'expert' axes.
    capacity: static per-(source device, slot) capacity C.
    num_experts: E, the number of canonical experts.
  Returns:
    (y_NM, DispatchStats).
  """
  num_shards = mesh.shape[DATA] * mesh.shape[EXPERT]
  if x_NM.shape[0] % num_shards:
    raise ValueError(
        f'{x_NM.shape[0]} tokens do not split evenly over the {num_shards} '
        f'devices of the ({DATA}, {EXPERT}) mesh; pad the batch.')
  if slot_share_DS.shape[0] != mesh.shape[EXPERT]:
    raise ValueError(f'placement has {slot_share_DS.shape[0]} source devices '
                     f'but the expert axis has {mesh.shape[EXPERT]}.')
  if slot_expert_S.shape[0] % mesh.shape[EXPERT]:
    raise ValueError(f'{slot_expert_S.shape[0]} slots do not split over '
                     f'{mesh.shape[EXPERT]} EP devices.')
  tok = P((DATA, EXPERT))
  fn = jax.shard_map(
      lambda *a: _ep_body(*a, capacity=int(capacity), num_experts=num_experts),
      mesh=mesh,
      in_specs=(tok, tok, tok, tok, P(EXPERT), P(EXPERT), P(EXPERT), P(), P()),
      out_specs=(tok, DispatchStats(P(), P(), P())),
  )
  return fn(x_NM, ids_NK, gates_NK, valid_N, wg_SMF, wu_SMF, wd_SFM,
            slot_expert_S, slot_share_DS)


def routed_experts(x_NM, ids_NK, gates_NK, valid_N, wg_EMF, wu_EMF, wd_EFM,
                   slot_expert_S, slot_share_DS, *, mesh, capacity: int):
  """Canonical weights in, routed-expert output out: transfer, then dispatch."""
  slot_w = [gather_slot_weights(w, slot_expert_S, mesh=mesh)
            for w in (wg_EMF, wu_EMF, wd_EFM)]
  return expert_parallel_ffn(x_NM, ids_NK, gates_NK, valid_N, *slot_w,
                             slot_expert_S, slot_share_DS, mesh=mesh,
                             capacity=capacity, num_experts=wg_EMF.shape[0])


def make_mesh(num_data: int = 1, num_expert: int = 1, devices=None):
  """A ('data', 'expert') mesh with Auto axes, so shard_map reshards inputs."""
  devices = jax.devices() if devices is None else devices
  need = num_data * num_expert
  if len(devices) < need:
    raise ValueError(
        f'mesh ({num_data} data x {num_expert} expert) needs {need} devices, '
        f'found {len(devices)}; on CPU set XLA_FLAGS='
        f'--xla_force_host_platform_device_count={need} before importing jax.')
  return jax.make_mesh((num_data, num_expert), (DATA, EXPERT),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=devices[:need])
