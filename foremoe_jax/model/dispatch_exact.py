"""Exact-count dispatch: each device receives exactly the rows routed to it.

The default expert-parallel dispatch (`parallel.dispatch = 'exact'`), as
MaxText (ragged all-to-all + grouped GEMM), Megatron (alltoallv) and DeepEP
do it at scale:

1. Each source sorts its token-assignments by destination slot (a sort,
   `slot_assignment.assign_slots`), so the rows for device d are one
   contiguous run, slot-major inside it.
2. One small all-gather of the int counts: every device learns how many
   rows each source sends each slot, lays the sources out one after
   another in its receive buffer of R rows, and knows where its own rows
   land on every destination and how many fit (as MaxText all-gathers its
   group sizes).
3. One ragged all-to-all moves exactly those rows (`exchange`): on GPU/TPU
   `jax.lax.ragged_all_to_all`; on CPU, where XLA has no such op, an
   emulation with the same arguments (`emulated_ragged_all_to_all`; a
   stand-in with the real op's buffers, `footprint_exchange`, lets the
   memory report read XLA's buffer assignment of the step on CPU).
4. The receiver runs only the rows that arrived through the grouped SwiGLU
   (`grouped_swiglu`: a tile loop over the non-empty tiles on CPU, as
   many as the busiest device has so that simulated devices sharing the
   host's cores keep the straggler's wall-clock; the Triton grouped
   matmul on GPU, `ragged_dot` on TPU).
5. A second ragged all-to-all with the sizes and offsets swapped brings the
   outputs back; the source un-sorts them and sums them with the gates.

R, the static receive capacity, bounds *the rows a device receives*, which
is what the planner balances, so balance shrinks the buffer; it comes from
a ladder of buckets (`config.capacity_buckets`) and the host picks the
smallest that holds the busiest device (`placement.max_received`). Rows past
R are dropped, counted, and contribute zero (as in the padded path).

Runs per device under `jax.shard_map` (expert_parallel.py builds it).

Shape letters: N tokens on this device, K top-k, A = N * K assignments,
D EP devices, S slots (= D * s), R receive capacity, C rows one source can
send one destination (the emulation's chunk), M model dim, F expert hidden.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from foremoe_jax.model import grouped_swiglu
from foremoe_jax.model.vma import vary, varying_axes
from foremoe_jax.model.slot_assignment import (assign_slots, own_share_row,
                                               search_sorted)

DATA, EXPERT = 'data', 'expert'
EXCHANGES = ('ragged', 'emulated', 'footprint')


def default_exchange(backend: str | None = None) -> str:
  """'emulated' on CPU (XLA:CPU has no ragged-all-to-all), else 'ragged'."""
  backend = jax.default_backend() if backend is None else backend
  return 'emulated' if backend == 'cpu' else 'ragged'


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                               output_offsets, recv_sizes, *, axis_name: str,
                               chunk: int, recv_offsets):
  """`jax.lax.ragged_all_to_all` from an `all_to_all` of fixed chunks.

  Same arguments and result as the real collective: this device sends
  operand[input_offsets[d] : + send_sizes[d]] to device d, which writes it
  at its output[output_offsets[d] : ...]; it receives recv_sizes[s] rows
  from each device s. Two additions, both static or known to the caller:
  `chunk` bounds every send_sizes entry (the all_to_all moves D * chunk
  rows per device, so the emulation's traffic is padded while the compute
  after it is not), and `recv_offsets[s]` is where device s's rows land
  here, i.e. the senders' output_offsets seen from the receiver (the real
  collective reads them off the senders; the dispatch computed them here
  in the first place, so passing them saves a collective). Rows a device
  does not receive keep `output`'s values.
  """
  del output_offsets  # The receiver's view, recv_offsets, places the rows.
  i_C = jnp.arange(chunk, dtype=jnp.int32)
  src_DC = input_offsets[:, None] + i_C[None, :]
  ok_DC = i_C[None, :] < send_sizes[:, None]
  rows = operand.shape[0]
  send_DCM = jnp.where(ok_DC[..., None],
                       operand[jnp.clip(src_DC, 0, rows - 1)], 0)
  recv_DCM = jax.lax.all_to_all(send_DCM, axis_name, 0, 0, tiled=True)
  out_rows = output.shape[0]
  dst_DC = jnp.where(i_C[None, :] < recv_sizes[:, None],
                     recv_offsets[:, None] + i_C[None, :], out_rows)
  return output.at[dst_DC.reshape(-1)].set(
      recv_DCM.reshape((-1,) + recv_DCM.shape[2:]), mode='drop')


def _exchange(kind: str, chunk: int):
  if kind == 'ragged':
    def ragged(operand, output, in_off, send, out_off, recv, recv_off):
      del recv_off
      # The collective's result takes `output`'s type. A zeros buffer is
      # typed as the same on every device, so what arrives would be too,
      # and autodiff would psum its cotangent over the mesh (every
      # device's row gradients summed into every other's). Typed as
      # differing per device, the transpose is the ragged exchange back.
      output = vary(output, varying_axes(operand) | {EXPERT})
      return jax.lax.ragged_all_to_all(operand, output, in_off, send, out_off,
                                       recv, axis_name=EXPERT)
    return ragged
  if kind == 'emulated':
    def emulated(operand, output, in_off, send, out_off, recv, recv_off):
      return emulated_ragged_all_to_all(operand, output, in_off, send,
                                        out_off, recv, axis_name=EXPERT,
                                        chunk=chunk, recv_offsets=recv_off)
    return emulated
  if kind == 'footprint':
    def footprint(operand, output, in_off, send, out_off, recv, recv_off):
      del in_off, send, out_off, recv, recv_off
      return footprint_exchange(operand, output, axis_name=EXPERT)
    return footprint
  raise ValueError(f'exchange must be one of {EXCHANGES}, got {kind!r}.')


def footprint_exchange(operand, output, *, axis_name: str):
  """Wrong values, the real collective's buffers: for memory analysis only.

  XLA:CPU can compile neither `ragged_all_to_all` nor an emulation whose
  buffers look like it (the emulation pads every pair to a static bound,
  D x C rows). To read XLA's buffer assignment of the step as a GPU or TPU
  would run it, the memory report compiles it with this stand-in: one
  all_to_all of the operand's rows (its A x M send buffer, which the ragged
  collective also holds) written into the R x M output.
  """
  num_ep = jax.lax.axis_size(axis_name)
  rows = operand.shape[0] // num_ep * num_ep
  moved = jax.lax.all_to_all(operand[:rows], axis_name, 0, 0, tiled=True)
  take = min(rows, output.shape[0])
  # An update-slice, not `.at[:take].set`: that scatter of an all-to-all's
  # result crashes XLA:CPU in jaxlib 0.11.2 (a segfault while compiling).
  return jax.lax.dynamic_update_slice(
      output, moved[:take].astype(output.dtype), (0,) * output.ndim)


def dispatch_body(x_NM, ids_NK, gates_NK, valid_N, wg_sMF, wu_sMF, wd_sFM,
                  slot_expert_S, slot_share_DS, *, capacity: int,
                  num_experts: int, tile: int, gemm: str, exchange: str,
                  cell: int | None = None):
  """(y_NM, counts) on one device; counts = (count_S, dropped, demand) for
  the stats: `demand` is the rows this device was sent, which R must hold.

  cell: a bound on the rows one source sends one destination device (the
  host's `placement.max_cell` of the step's foresight, bucketed), which
  the emulated exchange pads every pair to instead of the bound that holds
  whatever the routing (N * min(K, s)); rows past it are dropped and
  counted like rows past R. The real ragged collective moves exact counts,
  so only the emulation's traffic changes. None: that safe bound."""
  num_ep = jax.lax.axis_size(EXPERT)
  num_tokens, top_k = ids_NK.shape
  num_slots = slot_expert_S.shape[0]
  spd = num_slots // num_ep
  model_dim = x_NM.shape[-1]
  num_assign = num_tokens * top_k
  me = jax.lax.axis_index(EXPERT)
  i32 = jnp.int32

  e_A = ids_NK.reshape(-1).astype(i32)
  valid_A = jnp.repeat(valid_N, top_k)
  sa = assign_slots(e_A, valid_A, slot_expert_S,
                    own_share_row(slot_share_DS), num_experts)
  # 1. Rows sorted by destination slot: device d's rows are one run.
  send_Ds = sa.count_S.reshape(num_ep, spd)
  send_D = send_Ds.sum(axis=1)
  in_off_D = jnp.cumsum(send_D) - send_D
  token_sorted = sa.order_A // top_k
  send_AM = x_NM[token_sorted]

  # 2. One all-gather of every source's counts per slot [D, S]: from it
  # each device lays out its own receive buffer (sources one after another,
  # rows past R dropped), knows where its rows land on every destination
  # and how many fit, where its returned rows come from, and how many tiles
  # the busiest device will run, all without another collective.
  counts_DS = jax.lax.all_gather(sa.count_S.astype(i32), EXPERT)
  # A source never sends one destination more than N * min(K, s) rows.
  chunk = min(num_tokens * min(top_k, spd), capacity, num_assign)
  sent_DD = counts_DS.reshape(num_ep, num_ep, spd).sum(axis=2)  # [src, dst]
  if cell is not None and cell < chunk:
    # Each (source, destination) run keeps its first `cell` rows: the
    # earlier slots' rows first, as they lie in the sorted send buffer.
    chunk = cell
    c_DDs = counts_DS.reshape(num_ep, num_ep, spd)
    before_DDs = jnp.cumsum(c_DDs, axis=2) - c_DDs
    counts_DS = jnp.clip(chunk - before_DDs, 0, c_DDs).reshape(num_ep, -1)
  rows_DD = counts_DS.reshape(num_ep, num_ep, spd).sum(axis=2)  # Kept rows.
  start_DD = jnp.cumsum(rows_DD, axis=0) - rows_DD  # Offset of src at dst.
  fit_DD = jnp.clip(capacity - start_DD, 0, rows_DD).astype(i32)
  recv_Ds = jax.lax.dynamic_slice_in_dim(counts_DS, me * spd, spd, axis=1)
  start_D, fit_D = start_DD[:, me], fit_DD[:, me]
  out_off_D, send_fit_D = start_DD[me], fit_DD[me]
  # Where each source's rows to me sit in its own sorted send buffer.
  src_in_off_D = (jnp.cumsum(sent_DD, axis=1) - sent_DD)[:, me]
  # 3. Exactly the routed rows (those that fit) move.
  move = _exchange(exchange, chunk)
  recv_RM = move(send_AM, jnp.zeros((capacity, model_dim), x_NM.dtype),
                 in_off_D, send_fit_D, out_off_D, fit_D, start_D)

  # 4. Row i's slot: its (source, slot) run in the source-major layout.
  bounds = jnp.cumsum(recv_Ds.reshape(-1))
  i_R = jnp.arange(capacity, dtype=i32)
  run_R = search_sorted(bounds, i_R)
  used = fit_D.sum()
  label_R = jnp.where(i_R < used, run_R % spd, -1).astype(i32)
  num_tiles = None
  if gemm == 'tiles_lockstep':
    # The busiest device's tile count, read off the gathered counts (the
    # other data rows' busiest by one small max).
    per_slot_Ds = counts_DS.sum(axis=0).reshape(num_ep, spd)
    num_tiles = ((per_slot_Ds + tile - 1) // tile).sum(axis=1).max()
    if jax.lax.axis_size(DATA) > 1:
      num_tiles = jax.lax.pmax(num_tiles, DATA)
  out_RM = grouped_swiglu.grouped_swiglu(recv_RM, label_R, wg_sMF, wu_sMF,
                                         wd_sFM, tile=tile, kind=gemm,
                                         num_tiles=num_tiles)

  # 5. Back to the sources, into the sorted layout they sent from.
  back_AM = move(out_RM, jnp.zeros((num_assign, model_dim), out_RM.dtype),
                 start_D, fit_D, src_in_off_D, send_fit_D, in_off_D)
  i_A = jnp.arange(num_assign, dtype=i32)
  slot_sorted = jnp.minimum(sa.slot_A[sa.order_A], num_slots - 1)
  dev_sorted = slot_sorted // spd
  keep_sorted = (sa.found_A[sa.order_A]
                 & (i_A - in_off_D[dev_sorted] < send_fit_D[dev_sorted]))
  # Un-sort by a gather (its transpose is the cheap direction).
  unsort_A = jnp.zeros((num_assign,), i32).at[sa.order_A].set(i_A)
  keep_A, y_AM = keep_sorted[unsort_A], back_AM[unsort_A]
  w_A = jnp.where(keep_A, gates_NK.reshape(-1), 0).astype(y_AM.dtype)
  y_NM = (y_AM * w_A[:, None]).reshape(num_tokens, top_k, model_dim).sum(axis=1)
  dropped = (valid_A & ~keep_A).sum()  # Over capacity or in no slot.
  return y_NM, (sa.count_S, dropped, sent_DD[:, me].sum())
