"""Expert parallelism where the placement of experts is runtime data.

The MoE FFN's dispatch -> expert compute -> combine, under `jax.shard_map` over
a ('data', 'expert') mesh, read as MaxText's MoE layer reads: permute, route,
unpermute. Tokens are sharded over both axes (data-major); canonical expert
weights [E, ...] are sharded over 'expert'. Each EP device holds `s` slots; a
`Placement` (foremoe_jax/placement.py) says which expert sits in each slot and
how each source device splits its tokens for an expert across that expert's
replicas. Placement arrays are ordinary jit inputs, so a new placement never
recompiles anything.

This module is the thin layer that picks a dispatch strategy and runs it:

* 'exact' (dispatch_exact.py, the default): each device receives exactly
  the rows routed to it (a ragged all-to-all; emulated on CPU), in a buffer
  of R rows bounded by a bucket of the rows a device receives, and computes
  only those rows.
* 'padded' (dispatch_padded.py, for comparison): every (source,
  destination) cell padded to a capacity C, all D * C rows computed.

Both share the slot assignment (slot_assignment.py, the split rule as
sorts) and the grouped SwiGLU (grouped_swiglu.py). Each 'data' row
dispatches its own tokens over its own 'expert' ring with the same
placement, so capacities are per data group (`placement.max_received`,
`placement.max_cell`).

Shape letters: N tokens, K top-k, E experts, D EP devices, S slots
(= D * s), M model dim, F expert hidden dim, X and Y any expert weight's
two matrix dims.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from foremoe_jax.model import dispatch_exact, dispatch_padded, grouped_swiglu
from foremoe_jax.model.vma import vary, varying_axes  # pylint: disable=unused-import

DATA, EXPERT = 'data', 'expert'
DISPATCHES = ('exact', 'padded')
default_tile = grouped_swiglu.default_tile


class DispatchStats(NamedTuple):
  """Per-layer dispatch statistics, summed over all devices."""
  dropped: jax.Array  # int32 []: valid assignments not computed (over
  # capacity, or, with a placement the host would refuse, in no slot).
  # int32 []: the largest row count the capacity must hold, over all
  # devices and data groups: a device's received rows ('exact') or a
  # (source, destination device) cell ('padded'). <= capacity is dropless.
  max_rows: jax.Array
  slot_tokens_S: jax.Array  # int32 [S]: assignments each slot received.


def is_manual() -> bool:
  """Whether the caller runs per device, inside a shard_map over the mesh
  (the RL step's update and recompute), rather than on global arrays."""
  return EXPERT in jax.sharding.get_abstract_mesh().manual_axes


def _ep_body(x_NM, ids_NK, gates_NK, valid_N, wg_sMF, wu_sMF, wd_sFM,
             slot_expert_S, slot_share_DS, *, dispatch, reduce_stats=True,
             **kw):
  """Per-device body under shard_map; lower-case s: this device's slots."""
  # The slot weights are the same on every 'data' shard, the rows are not;
  # saying so up front gives the grouped matmul's hand-written VJP one type,
  # and its transpose sums the weight gradients over 'data' (unless the
  # caller already made them per-device, to sum them once per step).
  wg_sMF, wu_sMF, wd_sFM = (vary(w, (DATA,)) for w in (wg_sMF, wu_sMF, wd_sFM))
  body = (dispatch_exact.dispatch_body if dispatch == 'exact'
          else dispatch_padded.dispatch_body)
  y_NM, (count_S, dropped, demand) = body(
      x_NM, ids_NK, gates_NK, valid_N, wg_sMF, wu_sMF, wd_sFM,
      slot_expert_S, slot_share_DS, **kw)
  if not reduce_stats:  # The caller sums all layers' at once.
    return y_NM, DispatchStats(dropped.astype(jnp.int32),
                               demand.astype(jnp.int32),
                               count_S.astype(jnp.int32))
  axes = (DATA, EXPERT)
  # One psum for both sums: on CPU each collective is a rendezvous of all
  # devices, a fixed cost per layer call.
  sums = jax.lax.psum(jnp.append(count_S, dropped).astype(jnp.int32), axes)
  max_rows = jax.lax.pmax(demand.astype(jnp.int32), axes)
  return y_NM, DispatchStats(sums[-1], max_rows, sums[:-1])


def _gather_body(w_eXY, slot_expert_S):
  num_ep = jax.lax.axis_size(EXPERT)
  spd = slot_expert_S.shape[0] // num_ep
  local_experts_s = jax.lax.dynamic_slice_in_dim(
      slot_expert_S, jax.lax.axis_index(EXPERT) * spd, spd)
  return jax.lax.all_gather(w_eXY, EXPERT, tiled=True)[local_experts_s]


def gather_slot_weights(w_EXY, slot_expert_S, *, mesh):
  """Slot weights [S, ...] (sharded over 'expert') from canonical [E, ...].

  This is the weight transfer of a placement; its transpose sums the slot
  gradients of a replicated expert onto the canonical weights
  (docs/design.md §4.5).
  Computed once per placement, apart from the token path, so the transfer
  can be scheduled (and overlapped) independently of dispatch.
  """
  return jax.shard_map(_gather_body, mesh=mesh,
                       in_specs=(P(EXPERT), P()), out_specs=P(EXPERT))(
                           w_EXY, slot_expert_S)


def split_capacity(capacity) -> tuple[int, int | None]:
  """(rows, cell) of a static capacity: an int, or for 'exact' a pair
  (R, cell) whose cell bounds the rows one source sends one destination
  (`dispatch_exact.dispatch_body`; None: no bound but R's)."""
  if isinstance(capacity, tuple):
    rows, cell = capacity
    return int(rows), None if cell is None else int(cell)
  return int(capacity), None


def _body_kwargs(dispatch, capacity, num_experts, num_ep, spd, tile, gemm,
                 exchange) -> dict:
  rows, cell = split_capacity(capacity)
  received = rows * (num_ep if dispatch == 'padded' else 1)
  if dispatch == 'padded':
    gemm = 'tiles_static' if gemm is None else gemm
  else:
    gemm = grouped_swiglu.default_kind() if gemm is None else gemm
  if tile is None:
    tile = (grouped_swiglu.PALLAS_TILE if gemm == 'pallas'
            else default_tile(received, spd))
  kw = dict(dispatch=dispatch, capacity=rows, num_experts=num_experts,
            tile=int(tile), gemm=gemm)
  if dispatch != 'padded':
    kw['exchange'] = (dispatch_exact.default_exchange() if exchange is None
                      else exchange)
    # Only the emulation pads pairs; the ragged collective moves exact
    # counts, so a bound there could only drop rows.
    if kw['exchange'] == 'emulated':
      kw['cell'] = cell
  return kw


def local_expert_ffn(x_NM, ids_NK, gates_NK, valid_N, wg_sMF, wu_sMF, wd_sFM,
                     slot_expert_S, slot_share_DS, *, capacity: int,
                     num_experts: int, dispatch: str = 'exact',
                     tile: int | None = None, gemm: str | None = None,
                     exchange: str | None = None, reduce_stats: bool = True):
  """`expert_parallel_ffn` for a caller already inside a shard_map over
  the mesh: this device's tokens and its slots' weights ([s, ...]) in,
  (y_NM, DispatchStats) out. reduce_stats False: the stats are this
  device's (dropped, its own demand, its slot counts) for the caller to
  sum or max over the mesh once for many layers."""
  if dispatch not in DISPATCHES:
    raise ValueError(f'dispatch must be one of {DISPATCHES}, got '
                     f'{dispatch!r}.')
  num_ep = jax.lax.axis_size(EXPERT)
  kw = _body_kwargs(dispatch, capacity, num_experts, num_ep,
                    wg_sMF.shape[0], tile, gemm, exchange)
  return _ep_body(x_NM, ids_NK, gates_NK, valid_N, wg_sMF, wu_sMF, wd_sFM,
                  slot_expert_S, slot_share_DS, reduce_stats=reduce_stats,
                  **kw)


def expert_parallel_ffn(x_NM, ids_NK, gates_NK, valid_N, wg_SMF, wu_SMF,
                        wd_SFM, slot_expert_S, slot_share_DS, *, mesh,
                        capacity: int, num_experts: int,
                        dispatch: str = 'exact', tile: int | None = None,
                        gemm: str | None = None, exchange: str | None = None):
  """SwiGLU experts under expert parallelism with a runtime placement.

  Args:
    x_NM: all tokens (global view), sharded over ('data', 'expert').
    ids_NK, gates_NK: routed expert ids and gate weights per token.
    valid_N: bool; invalid tokens (padding) are not dispatched.
    wg_SMF, wu_SMF, wd_SFM: slot weights (`gather_slot_weights` of the
      canonical experts for this placement), sharded over 'expert'.
    slot_expert_S, slot_share_DS: one layer of a Placement.
    mesh: a mesh with 'data' and 'expert' axes.
    capacity: static; 'exact': R, the rows a device can receive, or
      (R, cell) with a bound on one (source, destination device) pair that
      the CPU emulation of the exchange pads to (`split_capacity`);
      'padded': C, the rows of one (source, destination device) cell.
      `config.dropless_capacity` is the bound that never drops.
    num_experts: E, the number of canonical experts.
    dispatch: 'exact' or 'padded' (module docstring).
    tile: rows per tile of the grouped GEMM (static); None picks
      `default_tile` of the rows a device can receive.
    gemm: the grouped GEMM (`grouped_swiglu.KINDS`); None: 'tiles_static'
      for 'padded', else the backend's (`grouped_swiglu.default_kind`).
    exchange: 'exact' only: 'ragged' (`jax.lax.ragged_all_to_all`) or
      'emulated'; None: the backend's (`dispatch_exact.default_exchange`).
  Returns:
    (y_NM, DispatchStats).
  """
  num_ep = mesh.shape[EXPERT]
  num_shards = mesh.shape[DATA] * num_ep
  if dispatch not in DISPATCHES:
    raise ValueError(f'dispatch must be one of {DISPATCHES}, got '
                     f'{dispatch!r}.')
  if x_NM.shape[0] % num_shards:
    raise ValueError(
        f'{x_NM.shape[0]} tokens do not split evenly over the {num_shards} '
        f'devices of the ({DATA}, {EXPERT}) mesh; pad the batch.')
  if slot_share_DS.shape[0] != num_ep:
    raise ValueError(f'placement has {slot_share_DS.shape[0]} source devices '
                     f'but the expert axis has {num_ep}.')
  if slot_expert_S.shape[0] % num_ep:
    raise ValueError(f'{slot_expert_S.shape[0]} slots do not split over '
                     f'{num_ep} EP devices.')
  rows, cell = split_capacity(capacity)
  if rows < 1 or (cell is not None and cell < 1):
    raise ValueError(f'capacity must be >= 1, got {capacity}.')
  kw = _body_kwargs(dispatch, capacity, num_experts, num_ep,
                    slot_expert_S.shape[0] // num_ep, tile, gemm, exchange)
  tok = P((DATA, EXPERT))
  fn = jax.shard_map(
      lambda *a: _ep_body(*a, **kw),
      mesh=mesh,
      in_specs=(tok, tok, tok, tok, P(EXPERT), P(EXPERT), P(EXPERT), P(), P()),
      out_specs=(tok, DispatchStats(P(), P(), P())),
  )
  return fn(x_NM, ids_NK, gates_NK, valid_N, wg_SMF, wu_SMF, wd_SFM,
            slot_expert_S, slot_share_DS)


def routed_experts(x_NM, ids_NK, gates_NK, valid_N, wg_EMF, wu_EMF, wd_EFM,
                   slot_expert_S, slot_share_DS, *, mesh, capacity: int,
                   **kw):
  """Canonical weights in, routed-expert output out: transfer, then dispatch
  (kw: `expert_parallel_ffn`'s dispatch, tile, gemm, exchange)."""
  slot_w = [gather_slot_weights(w, slot_expert_S, mesh=mesh)
            for w in (wg_EMF, wu_EMF, wd_EFM)]
  return expert_parallel_ffn(x_NM, ids_NK, gates_NK, valid_N, *slot_w,
                             slot_expert_S, slot_share_DS, mesh=mesh,
                             capacity=capacity, num_experts=wg_EMF.shape[0],
                             **kw)


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
