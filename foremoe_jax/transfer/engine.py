"""The transfer engine on device: slot buffers filled by rounds of ppermute.

Each EP device holds `s` slot buffers per MoE layer (the weights of the
experts its slots hold in the current micro-step) next to its `h = E / D`
canonical experts, which never move. A host-built `Transition`
(foremoe_jax/transfer/schedule.py) says how to go from one placement's slots
to the next:

* local copies first: a slot whose new expert already sits on this device
  (in another slot, or as a canonical home expert) copies it, no traffic;
* then the remote copies, in one of two ways (the Transition's type says
  which; `schedule.MODES`):

  - ``exact`` (ExactTransition, the default): one ragged all-to-all per
    layer. A device packs the experts it sends into a buffer grouped by
    destination, and `jax.lax.ragged_all_to_all` sends each destination
    exactly its items, with offsets and sizes from the schedule's [D, D]
    count matrix (data, so a new schedule never recompiles). The receiver
    writes the items it got into their slots. The buffers' widths are
    static and sized by role (`schedule.exchange_widths`): a fill receives
    at most a device's s slots, a return sends at most them.
    Only experts that move cross the wire. XLA:CPU has no ragged
    all-to-all; there the same contract runs as cyclic-shift ppermute
    rounds derived on device from the counts, idle rounds skipped
    (`EXCHANGES`), and a single-stage transition reads and writes the
    stacked buffers in place, item by item, so it costs what it moves
    (`_fill_inplace`).
  - ``rounds`` (Transition): R rounds, R static. In round r every device
    sends at most one expert to the device `shift[r]` places after it and
    receives at most one. A round is one `jax.lax.ppermute` whose cyclic
    shift is picked at run time (`lax.switch` over the D - 1 static shifts;
    shift 0 sends nothing). Every device sends in a round, useful or not.

Expert ids travel with the weights (an int32 leaf beside them), so the
device can check that each slot holds the expert the plan says.

Gradients go the other way. A slot accumulates the gradient of its weights
while it keeps its expert; when a transition evicts the expert (or at the
end of the step, the flush), the accumulated gradient goes to the expert's
home device and is added into the canonical gradient: locally when the slot
sits on the home device, else by rounds built like the fills. In ``exact``
mode a flush whose budget R is large against s + h runs as a reduction
tree instead (`schedule.flush_form`): a few exchanges one after another,
each adding partial sums into slots (or, at the root, the canonical
gradient), so a device's buffers hold s + (s + h) float32 experts, not
min(s, R) + R.

Overlap. The update issues micro-step m+1's fills in the same scan
iteration as micro-step m's compute, reading only the buffers m computes
with, so no data dependence orders them; with the exact exchanges each
layer's fill runs inside that layer's step of the model's forward scan
(`fill_layer_local`), in the computation of its matmuls, since a
collective in a loop of its own cannot be scheduled across another
loop's compute. Whether they then run concurrently
is the scheduler's choice: on GPU, XLA's latency-hiding scheduler with
asynchronous collectives (`--xla_gpu_enable_latency_hiding_scheduler=true`,
on by default in recent jaxlib; `--xla_gpu_enable_pipelined_collectives`
for loops); on TPU `--xla_tpu_enable_latency_hiding_scheduler=true` and
`--xla_enable_async_collective_permute=true`. In ``exact`` mode on GPU
and TPU the exchanges sit in the scan over layers and in no conditional (a
test reads the compiled 'a2a' stand-in to hold this), so the scheduler may
move them across the micro-step's compute. In ``rounds`` mode a round's ppermute sits
inside the `lax.switch` that picks its shift, and XLA schedules a
conditional's collectives inside the branch, so they overlap work in the
same branch only. On CPU collectives are synchronous anyway; the benchmark
reports the *exposed* transfer time directly (experiments/bench_rl_step.py).

Everything here runs per device under `jax.shard_map` over the ('data',
'expert') mesh; slot buffers and canonical experts are replicated over
'data', so every data row moves the same weights over its own 'expert' ring.
The MoE layers' buffers are stacked ([L, ...] leaves, as the model stores
its layers) and a transition runs as one scan over the layers, so compile
time does not grow with depth (nor, in the CPU emulation, with a tree's
stages: one loop runs them, `_stages`). The `*_local` functions are the
per-device bodies, for callers already inside a shard_map over the mesh.

Shape letters: L MoE layers, S slots (global), s slots per device, h
canonical experts per device, D EP devices, R rounds, X... any expert
leaf's trailing dims.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from foremoe_jax.model import dispatch_exact
from foremoe_jax.model.expert_parallel import EXPERT, vary, varying_axes
from foremoe_jax.transfer import schedule

# Fields of a schedule Transition the device reads (the rest is host
# bookkeeping for metrics).
DEVICE_FIELDS = ('local_src_LS', 'shift_LR', 'send_LRD', 'recv_LRD',
                 'evict_LS', 'ret_local_LS', 'ret_shift_LR', 'ret_send_LRD',
                 'ret_recv_LRD')
EXACT_DEVICE_FIELDS = ('local_src_LS', 'send_LPDR', 'recv_LPDR', 'evict_LS',
                       'ret_local_LS', 'ret_send_LPDR', 'ret_recv_LPDR')


def _exchange_fields(count_LPDD, prefix: str) -> dict:
  """What each device needs of a transition's staged exchanges, whose
  [L, P, src, dst] counts hold one exchange per stage, as rows it can
  hold alone: what it sends each device (`count_LPDD`, row c), what it
  receives from each (`recv_count_LPDD`, row d: column d of the counts),
  where its items land in each receiver's buffer (`out_off_LPDD`, row c:
  the items each receiver gets from the sources before c), and, for the
  CPU emulation only, each cyclic shift's busiest pair (`depth_LPK`,
  [L, P, K], whole on every device: it is L x P x D, not L x P x D x D).
  prefix: '' (fills) or 'ret_' (returns)."""
  c = np.asarray(count_LPDD, np.int32)
  return {
      f'{prefix}count_LPDD': c,
      f'{prefix}recv_count_LPDD': np.swapaxes(c, -1, -2).copy(),
      f'{prefix}out_off_LPDD': (np.cumsum(c, axis=-2) - c).astype(np.int32),
      f'{prefix}depth_LPK': schedule.shift_depths(c),
  }


def device_transition(transition, sharding=None) -> dict:
  """The device half of a schedule (Exact)Transition (numpy in, jnp arrays
  out), each field with a device or slot axis split over 'expert' so a
  device holds its own row only (`transition_specs`): a transition's
  [L, D, R] and [L, D, D] arrays per device would be D times larger.

  sharding: None (plain arrays; a shard_map splits them) or a function
  from a field's PartitionSpec to its Sharding (`jax.device_put` then
  sends each device its own row).
  """
  exact = isinstance(transition, schedule.ExactTransition)
  fields = EXACT_DEVICE_FIELDS if exact else DEVICE_FIELDS
  t = {f: np.asarray(getattr(transition, f)) for f in fields}
  if exact:
    t.update(_exchange_fields(transition.count_LPDD, ''))
    t.update(_exchange_fields(transition.ret_count_LPDD, 'ret_'))
  lead = np.ndim(t['local_src_LS']) - 2  # Stacked over micro-steps.
  specs = transition_specs(t, lead)
  if sharding is None:
    return {k: jnp.asarray(v) for k, v in t.items()}
  return {k: jax.device_put(v, sharding(specs[k])) for k, v in t.items()}


def _device_axis(field: str):
  """Where a device field's split axis sits (its first D or S), or None."""
  letters = field.rsplit('_', 1)[1]
  for i, c in enumerate(letters):
    if c in 'DS':
      return i
  return None


def transition_specs(t: dict, lead: int = 0) -> dict:
  """shard_map in_specs of a device transition (`lead` stacking axes in
  front): every field with a device (D) or slot (S) axis split over
  'expert' on its first one, so each device receives its own row; the
  rest (shifts, depths: [L, R], [L, K]) whole."""
  out = {}
  for k in t:
    ax = _device_axis(k)
    out[k] = P() if ax is None else P(*([None] * (lead + ax)), EXPERT)
  return out


def _is_exact(t: dict) -> bool:
  return 'count_LPDD' in t


def device_step_transfer(step_transfer, sharding=None) -> dict:
  """fill / steps (stacked over micro-steps) / flush, device fields only
  (`device_transition`)."""
  return {k: device_transition(getattr(step_transfer, k), sharding)
          for k in ('fill', 'steps', 'flush')}


def step_transfer_specs(st: dict) -> dict:
  """shard_map in_specs of `device_step_transfer`'s dict."""
  return {k: transition_specs(t, 1 if k == 'steps' else 0)
          for k, t in st.items()}


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


# How ``exact`` mode's exchange runs: 'ragged' (GPU/TPU), 'emulated' (CPU:
# shift rounds from the counts, idle ones skipped), 'a2a' (CPU: one
# all_to_all padded to R items per pair, the ragged collective's shape: no
# conditional, which is what the compiled-program test reads), 'footprint'
# (CPU, memory analysis only: wrong values in the ragged collective's
# buffers, `_footprint_exchange`).
EXCHANGES = ('ragged', 'emulated', 'a2a', 'footprint')

# The exchange programs traced inside `use_exchange` get (None: the
# backend's); read when a program is traced, as the backend is.
_EXCHANGE = contextvars.ContextVar('foremoe_engine_exchange', default=None)


def default_exchange() -> str:
  """The engine's exchange when a caller names none: `use_exchange`'s
  inside one, else the backend's (`dispatch_exact.default_exchange`:
  'emulated' on CPU, 'ragged' else)."""
  return _EXCHANGE.get() or dispatch_exact.default_exchange()


@contextlib.contextmanager
def use_exchange(exchange: str):
  """Programs traced in this block exchange experts with `exchange`
  (one of EXCHANGES): e.g. the memory report compiles the update as a GPU
  runs it, its moves inside the layers, on a CPU host ('footprint')."""
  if exchange not in EXCHANGES:
    raise ValueError(f'exchange must be one of {EXCHANGES}, got '
                     f'{exchange!r}.')
  token = _EXCHANGE.set(exchange)
  try:
    yield
  finally:
    _EXCHANGE.reset(token)


class _Counts(NamedTuple):
  """One layer's exchange as this device sees it (`_exchange_fields`):
  items it sends each device, items it receives from each, where its
  items land in each receiver's buffer; and each shift's busiest pair."""

  send_D: jax.Array
  recv_D: jax.Array
  out_off_D: jax.Array
  depth_K: jax.Array


def _my_counts(t_l, stage: int, pre: str = '') -> _Counts:
  """This device's rows of stage `stage` of one layer's fill exchanges
  (pre '') or return exchanges (pre 'ret_'); the split rows arrive as
  [1, D] blocks."""
  return _Counts(t_l[f'{pre}count_LPDD'][stage, 0],
                 t_l[f'{pre}recv_count_LPDD'][stage, 0],
                 t_l[f'{pre}out_off_LPDD'][stage, 0],
                 t_l[f'{pre}depth_LPK'][stage])


def _zero_rows(x, rows: int):
  """Zeros [rows, ...] shaped like x's rows, differing per device as what
  an exchange writes into them does."""
  z = jnp.zeros((rows,) + x.shape[1:], x.dtype)
  return vary(z, varying_axes(x) | {EXPERT})


def _exchange(pick, num_items: int, cnt: _Counts, me, exchange: str,
              out_rows: int):
  """One ragged all-to-all of expert-sized items: this device sends
  cnt.send_D[d] items to device d, packed by destination, and receives
  cnt.recv_D[c] from each c, sources laid out in ascending order.
  pick(index) gives the items at rows `index` ([n] int32) of this
  device's send list of `num_items` rows. Returns the received items,
  [out_rows, X...] (unused rows zero).

  The collectives read a whole send buffer, so it is gathered first; the
  CPU emulation picks each item as its round sends it, so the rows past
  what a device sends (most of a buffer sized by the budget) are never
  gathered."""
  in_off_D = jnp.cumsum(cnt.send_D) - cnt.send_D
  recv_off_D = jnp.cumsum(cnt.recv_D) - cnt.recv_D

  if exchange == 'emulated':
    return _exchange_by_rounds(pick, num_items, cnt, me, out_rows)

  def one(x):
    flat = x.reshape(x.shape[0], -1)
    out = _zero_rows(flat, out_rows)
    if exchange == 'ragged':
      got = jax.lax.ragged_all_to_all(flat, out, in_off_D, cnt.send_D,
                                      cnt.out_off_D, cnt.recv_D,
                                      axis_name=EXPERT)
    elif exchange == 'a2a':
      got = dispatch_exact.emulated_ragged_all_to_all(
          flat, out, in_off_D, cnt.send_D, cnt.out_off_D, cnt.recv_D,
          axis_name=EXPERT, chunk=min(x.shape[0], out_rows),
          recv_offsets=recv_off_D)
    elif exchange == 'footprint':
      got = _footprint_exchange(flat, out)
    else:
      raise ValueError(f'exchange must be one of {EXCHANGES}, got '
                       f'{exchange!r}.')
    return got.reshape((out_rows,) + x.shape[1:])
  return jax.tree.map(one, pick(jnp.arange(num_items, dtype=jnp.int32)))


def _footprint_exchange(send, out):
  """Wrong values, the ragged collective's buffers: for memory analysis.

  The ragged all-to-all holds the packed send buffer and the receive
  buffer it writes into. XLA:CPU compiles no such op, and the 'a2a'
  stand-in pads every pair to the send buffer's rows (D x more); the
  dispatch's stand-in (`dispatch_exact.footprint_exchange`) all-to-alls
  whole rows per device, which a send list shorter than D does not have.
  Here the send buffer goes to the next device by one collective-permute
  (its received copy is one send buffer more than the real op holds: a
  few experts) and is written into the receive buffer's first rows.
  """
  num_ep = jax.lax.axis_size(EXPERT)
  moved = jax.lax.ppermute(send, EXPERT,
                           [(d, (d + 1) % num_ep) for d in range(num_ep)])
  take = min(send.shape[0], out.shape[0])
  return jax.lax.dynamic_update_slice(out, moved[:take].astype(out.dtype),
                                      (0,) * out.ndim)


def _exchange_by_rounds(pick, num_items: int, cnt: _Counts, me,
                        out_rows: int):
  """`_exchange` on CPU: the same result by cyclic-shift ppermute rounds,
  idle rounds skipped. Shift k takes as many rounds as its busiest pair
  (c, c + k) has items (cnt.depth_K), each carrying one expert per device
  and picking it from the sources then; so a step without moves costs
  nothing and one with few moves little, where an all_to_all padded to R
  items per pair would copy D x R experts per device every layer. (The
  rounds sit in conditionals, which on CPU costs nothing: its collectives
  are synchronous anyway.) The rounds are `_rounds_inplace`'s, into a
  receive buffer."""
  def send_item(_, row):
    return jax.tree.map(lambda x: x[0], pick(row[None]))

  def receive(out, q, got):
    at = jnp.where(q >= 0, q, out_rows)
    return jax.tree.map(lambda o, g: o.at[at].set(g, mode='drop'), out, got)
  # The receive buffer, shaped (and varying) like the items; the one-row
  # pick is only read for its type, so it is never computed.
  like = pick(jnp.zeros((1,), jnp.int32))
  out = jax.tree.map(lambda x: _zero_rows(x, out_rows), like)
  return _rounds_inplace(send_item, receive, out, cnt, me, num_items)


def _local_copies(slots, canon, t, spd: int):
  """Slots filled from this device's own buffers (no traffic)."""
  local_s = t['local_src_LS']  # This device's slots only: [s].
  # Slot by slot, and only the slots that take a local copy: a transition
  # between micro-steps changes a few slots, and rewriting all of them
  # would copy every slot's weights every micro-step.
  new = slots
  for j in range(spd):
    new = jax.lax.cond(
        local_s[j] >= 0,
        lambda n, j=j: _write(n, jnp.int32(j), _pick(slots, canon,
                                                     local_s[j])),
        lambda n: n, new)
  return new


def _layer_fill_exact(slots, canon, t, me, spd: int, exchange: str):
  """One layer's fills on this device: local copies, then one exchange per
  stage. With one stage every source is read as the buffers were before
  the transition. A first fill's broadcast tree (several stages) sends on
  what the stages before filled, and its local copies run last (a second
  slot of an expert is copied from the first)."""
  stages = t['send_LPDR'].shape[0]
  tree = stages > 1
  new = slots if tree else _local_copies(slots, canon, t, spd)

  def stage(p, new):
    src = new if tree else slots
    dst_R = t['recv_LPDR'][p, 0]
    send_R = t['send_LPDR'][p, 0]
    got = _exchange(lambda i: _pick(src, canon, send_R[i]),
                    send_R.shape[0], _my_counts(t, p), me, exchange,
                    dst_R.shape[0])
    at_R = jnp.where(dst_R >= 0, dst_R, spd)  # Unused rows: dropped.
    return jax.tree.map(lambda x, v: x.at[at_R].set(v, mode='drop'), new,
                        got)
  new = _stages(stages, stage, new, exchange)
  return _local_copies(new, canon, t, spd) if tree else new


def _stages(num_stages: int, stage, carry, exchange: str):
  """stage(p, carry) for p in range(num_stages), in order. The CPU
  emulation runs them as one loop: a tree's stages are the same program
  on other rows, and unrolled (ceil(log2(R + 1)) of them, each a loop of
  shift rounds) they made most of the RL update's compile. The exchanges
  a scheduler may overlap with compute ('ragged', and the stand-ins that
  show its program) stay unrolled, outside any loop of their own."""
  if exchange == 'emulated' and num_stages > 1:
    return jax.lax.fori_loop(0, num_stages, stage, carry)
  for p in range(num_stages):
    carry = stage(p, carry)
  return carry


def _add_into(gslots, gcanon, index, value, into_slots: bool = True):
  """gslots[index] += value where index < s, gcanon[index - s] += value
  where index >= s (the local list's indexing), nothing where index < 0;
  index scalar or [n] (value [n, X...] then). into_slots False: the
  targets are homes only (every return but a flush tree's), and the slots
  are not touched."""
  spd = jax.tree.leaves(gslots)[0].shape[0]
  num_home = jax.tree.leaves(gcanon)[0].shape[0]
  at_home = jnp.where(index >= spd, index - spd, num_home)
  gcanon = jax.tree.map(lambda c, v: c.at[at_home].add(v, mode='drop'),
                        gcanon, value)
  if into_slots:
    at_slot = jnp.where((index >= 0) & (index < spd), index, spd)
    gslots = jax.tree.map(lambda g, v: g.at[at_slot].add(v, mode='drop'),
                          gslots, value)
  return gslots, gcanon


def _layer_returns_exact(gslots, gcanon, t, me, spd: int, exchange: str):
  """`_layer_returns` by exchanges of the evicted slots' gradients, one per
  stage (a flush's reduction tree passes partial sums on through slots:
  stage p sends what stages before it added in)."""
  stages = t['ret_send_LPDR'].shape[0]
  tree = stages > 1  # Only a tree adds into slots.
  gslots, gcanon = _local_returns(gslots, gcanon, t, spd, into_slots=tree)

  def stage(p, carry):
    gslots, gcanon = carry
    send_R = t['ret_send_LPDR'][p, 0]
    dst_R = t['ret_recv_LPDR'][p, 0]
    got = _exchange(lambda i: jax.tree.map(lambda g: g[send_R[i]], gslots),
                    send_R.shape[0], _my_counts(t, p, 'ret_'), me, exchange,
                    dst_R.shape[0])
    return _add_into(gslots, gcanon, dst_R, got, into_slots=tree)
  gslots, gcanon = _stages(stages, stage, (gslots, gcanon), exchange)
  return _zero_evicted(gslots, t, spd), gcanon


def _layer_fill(slots, canon, t, me, spd: int, num_devices: int):
  """One layer's fills on this device: local copies, then the rounds.

  Every source is read from the buffers as they were before the transition
  (within a step all copies of an expert are equal, so order is free). The
  rounds are a fori_loop, so compile time does not grow with the budget.
  """
  new = _local_copies(slots, canon, t, spd)

  def one_round(r, new):
    item = _pick(slots, canon, t['send_LRD'][r, 0])
    got = _shifted(item, t['shift_LR'][r], num_devices)
    return _write(new, t['recv_LRD'][r, 0], got)
  return _rounds(t['shift_LR'], one_round, new)


def _local_returns(gslots, gcanon, t, spd: int, into_slots: bool = False):
  """Evicted slots' gradients added in on this device: into the canonical
  gradient where it is their home, or (a flush tree's duplicate copy,
  into_slots True) into the slot of the device's first copy. Returns
  (gslots, gcanon)."""
  local_s = t['ret_local_LS']  # [s], this device's.
  src = gslots  # No slot that is added into adds itself anywhere.

  def add(carry, j):
    gs, gc = carry if into_slots else (gslots, carry)
    out = _add_into(gs, gc, local_s[j], jax.tree.map(lambda g: g[j], src),
                    into_slots)
    return out if into_slots else out[1]
  # Slot by slot, only the evicted slots that return locally: most slots
  # keep accumulating, and touching them would copy every slot's gradient
  # every micro-step. Without a tree only the canonical gradient passes
  # through the conditionals.
  carry = (gslots, gcanon) if into_slots else gcanon
  for j in range(spd):
    carry = jax.lax.cond(local_s[j] >= 0, lambda c, j=j: add(c, j),
                         lambda c: c, carry)
  return carry if into_slots else (gslots, carry)


def _zero_evicted(gslots, t, spd: int):
  """Evicted slots' gradients zeroed: the slot starts accumulating for its
  new expert."""
  evict_s = t['evict_LS']  # [s], this device's.
  for j in range(spd):
    gslots = jax.lax.cond(
        evict_s[j],
        lambda g, j=j: jax.tree.map(lambda x: x.at[j].set(jnp.zeros_like(x[j])),
                                    g),
        lambda g: g, gslots)
  return gslots


def _layer_returns(gslots, gcanon, t, me, spd: int, num_devices: int):
  """Evicted slots' gradients added into their home's canonical gradient,
  then zeroed (the slot starts accumulating for its new expert)."""
  gslots, gcanon = _local_returns(gslots, gcanon, t, spd)

  def one_round(r, gcanon):
    item = jax.tree.map(lambda g: g[t['ret_send_LRD'][r, 0]], gslots)
    got = _shifted(item, t['ret_shift_LR'][r], num_devices)
    dst = t['ret_recv_LRD'][r, 0]  # s + the home index; -1 discard.
    return _add_into(gslots, gcanon, dst, got, into_slots=False)[1]
  gcanon = _rounds(t['ret_shift_LR'], one_round, gcanon)
  return _zero_evicted(gslots, t, spd), gcanon


# ---------------------------------------------------------- in place (CPU)
#
# On CPU the exchange is emulated by rounds and every collective is
# synchronous, so what a transition costs is the memory it touches. The
# per-layer form above slices each layer's slots and canonical experts out
# of the stacked buffers, zeroes a receive buffer, scatters it back and
# restacks every layer (a scan's outputs are fresh buffers): every slot's
# weights copied several times per transition whether it changes or not.
# For the single-stage transitions (the moves between micro-steps, and a
# fill or flush with one stage) the functions below read and write the
# stacked buffers item by item, in place: a transition costs the items it
# moves. Sources are read before anything is written (received items and
# local copies are staged first), so a slot that sends its old expert and
# takes a new one in the same transition reads as it was, as the
# per-layer form guarantees by reading its input.


def _item(x, at):
  """x[at] for a tuple of scalar indices into x's leading axes."""
  return jax.lax.dynamic_slice(
      x, tuple(at) + (0,) * (x.ndim - len(at)),
      (1,) * len(at) + x.shape[len(at):]).reshape(x.shape[len(at):])


def _put(x, at, v):
  """x with x[at] = v (in place where x is a loop's carry)."""
  return jax.lax.dynamic_update_slice(
      x, v.reshape((1,) * len(at) + v.shape).astype(x.dtype),
      tuple(at) + (0,) * (x.ndim - len(at)))


def _valid_first(mask):
  """(indices with mask first, in order; how many): a loop over the first
  n entries visits exactly the True ones."""
  order = jnp.argsort(~mask, stable=True).astype(jnp.int32)
  return order, mask.sum().astype(jnp.int32)


def _rounds_inplace(send_item, receive, carry, cnt: _Counts, me,
                    num_items: int):
  """One single-stage exchange by cyclic-shift rounds, idle rounds skipped
  (`_exchange_by_rounds`' rounds): in shift k's round r this device sends
  send_item(carry, row), its r-th item for device me + k (a clipped row
  when it has none: the receiver ignores it), and receive(carry, q, got)
  takes what device me - k sent, q its row in this device's receive
  order (-1: nothing was sent). The buffers the items are read from
  may travel in the carry (send_item reads them from it)."""
  num_devices = cnt.send_D.shape[0]
  in_off_D = jnp.cumsum(cnt.send_D) - cnt.send_D
  recv_off_D = jnp.cumsum(cnt.recv_D) - cnt.recv_D

  def one_round(k, r, carry):
    dst, src = (me + k) % num_devices, (me - k) % num_devices
    row = jnp.clip(in_off_D[dst] + r, 0, num_items - 1)
    got = _shifted(send_item(carry, row), k, num_devices)
    q = jnp.where(r < cnt.recv_D[src], recv_off_D[src] + r, -1)
    return receive(carry, q, got)

  def shift(k, carry):
    return jax.lax.fori_loop(0, cnt.depth_K[k],
                             lambda r, c: one_round(k, r, c), carry)
  return jax.lax.fori_loop(1, num_devices, shift, carry)


def _single_stage(t: dict, pre: str = '') -> bool:
  """Whether an ``exact`` transition's fills (pre '') or returns (pre
  'ret_') run as one exchange (no broadcast or reduction tree)."""
  return _is_exact(t) and t[f'{pre}send_LPDR'].shape[-3] == 1


def _fill_inplace(slots, canon, ids_h, t, me, spd: int, layers=None):
  """`fill_slots_local` of a single-stage ``exact`` transition with the
  emulated exchange, on the stacked buffers in place (comment above).

  slots: (weights [L, s, X...]..., ids [L, s]); canon: weights [L, h,
  X...]; ids_h: the home experts' ids [h]; layers: None (all) or the
  (first, end) layers to fill (traced is fine; the others are left as
  they are). Per layer: the rounds stage what this device receives, the
  local copies stage their sources, then both are written into their
  slots."""
  weights, ids = tuple(slots[:-1]), slots[-1]
  num_layers = ids.shape[0]
  recv_w = t['recv_LPDR'].shape[-1]
  send_w = t['send_LPDR'].shape[-1]
  # Staging rows: [received items (recv_w), local copies (s), one row that
  # takes what is not kept]. Carried from layer to layer: a layer reads
  # only the rows it wrote, so the buffer is zeroed once per transition.
  rows = recv_w + spd + 1
  stage = (tuple(_zero_rows(w[0], rows) for w in weights),
           vary(jnp.zeros((rows,), jnp.int32), varying_axes(ids) | {EXPERT}))

  def source(bufs, l, index):
    """Entry `index` of layer l's local list [slots..., homes...]."""
    weights, ids = bufs
    in_slot = index < spd
    i_s = jnp.clip(index, 0, spd - 1)
    i_h = jnp.clip(index - spd, 0, ids_h.shape[0] - 1)
    w = tuple(jnp.where(in_slot, _item(a, (l, i_s)), _item(b, (l, i_h)))
              for a, b in zip(weights, canon))
    return w, jnp.where(in_slot, _item(ids, (l, i_s)), ids_h[i_h])

  def stage_put(stage, q, item):
    w, i = item
    return (tuple(_put(x, (q,), v) for x, v in zip(stage[0], w)),
            _put(stage[1], (q,), i))

  def layer(l, carry):
    bufs, stage = carry
    t_l = jax.tree.map(lambda x: _item(x, (l,)), t)
    send_R, dst_R = t_l['send_LPDR'][0, 0], t_l['recv_LPDR'][0, 0]
    cnt = _my_counts(t_l, 0)
    # Reads: what this device receives and its local copies' sources.
    bufs, stage = _rounds_inplace(
        lambda c, row: source(c[0], l, send_R[row]),
        lambda c, q, got: (c[0], stage_put(c[1], jnp.where(q >= 0, q,
                                                           rows - 1), got)),
        (bufs, stage), cnt, me, send_w)
    local_s = t_l['local_src_LS']
    order_s, num_local = _valid_first(local_s >= 0)
    bufs, stage = jax.lax.fori_loop(
        0, num_local, lambda i, c: (c[0], stage_put(
            c[1], recv_w + i, source(c[0], l, local_s[order_s[i]]))),
        (bufs, stage))

    # Then the writes (they read the staged rows, so XLA orders them after
    # every read of the buffers and updates these in place).
    def write(bufs, j, q, keep=False):
      """Slot j of layer l takes staged row q (keep: stays as it is)."""
      w, i = bufs
      jc = jnp.maximum(j, 0)
      pick = lambda x, v: jnp.where(keep, _item(x, (l, jc)), _item(v, (q,)))
      return (tuple(_put(x, (l, jc), pick(x, v)) for x, v in zip(w, stage[0])),
              _put(i, (l, jc), pick(i, stage[1])))
    # A received row the schedule gives no slot (never, as built) writes
    # its slot back unchanged.
    bufs = jax.lax.fori_loop(
        0, cnt.recv_D.sum(),
        lambda q, b: write(b, dst_R[q], q, keep=dst_R[q] < 0), bufs)
    bufs = jax.lax.fori_loop(
        0, num_local, lambda i, b: write(b, order_s[i], recv_w + i), bufs)
    return bufs, stage

  first, end = (0, num_layers) if layers is None else layers
  (weights, ids), _ = jax.lax.fori_loop(first, end, layer,
                                        ((weights, ids), stage))
  return weights + (ids,)


def _returns_inplace(get, add_home, carry, t_l, me, spd: int,
                     count_rounds: bool = False):
  """One layer's single-stage returns onto the homes, item by item: the
  local returns, then the rounds. get(carry, j): slot j's gradient (a
  tree of [X...]); add_home(carry, i, v): the carry with home i's
  gradient plus v (v zero where nothing arrived). Reads only slots and
  writes only homes, so nothing is staged. count_rounds: returns (carry,
  the number of rounds run)."""
  local_s = t_l['ret_local_LS']  # [s]: s + home index, or -1.
  order_s, num_local = _valid_first(local_s >= spd)
  carry = jax.lax.fori_loop(
      0, num_local, lambda i, c: add_home(
          c, local_s[order_s[i]] - spd, get(c, order_s[i])), carry)
  send_R, dst_R = t_l['ret_send_LPDR'][0, 0], t_l['ret_recv_LPDR'][0, 0]

  def receive(c, q, got):
    c, n = c
    home = jnp.where(q >= 0, dst_R[jnp.maximum(q, 0)], -1) - spd
    keep = home >= 0
    got = jax.tree.map(lambda g: jnp.where(keep, g, jnp.zeros_like(g)), got)
    return add_home(c, jnp.maximum(home, 0), got), n + 1
  carry, n = _rounds_inplace(
      lambda c, row: get(c[0], jnp.clip(send_R[row], 0, spd - 1)), receive,
      (carry, jnp.int32(0)), _my_counts(t_l, 0, 'ret_'), me, send_R.shape[0])
  return (carry, n) if count_rounds else carry


def _return_grads_inplace(gslots, gcanon, t, me, spd: int):
  """`return_grads_local` of a single-stage ``exact`` transition with the
  emulated exchange, in place: evicted slots' gradients added into their
  homes', then zeroed; untouched slots cost nothing."""
  num_layers = gslots[0].shape[0]

  def layer(l, bufs):
    t_l = jax.tree.map(lambda x: _item(x, (l,)), t)
    get = lambda c, j: tuple(_item(x, (l, j)) for x in c[0])
    add = lambda c, i, v: (c[0], tuple(_put(x, (l, i), _item(x, (l, i)) + g)
                                       for x, g in zip(c[1], v)))
    (gs, gc), rounds = _returns_inplace(get, add, bufs, t_l, me, spd,
                                        count_rounds=True)
    order_s, num_evict = _valid_first(t_l['evict_LS'])
    # The zeroing would read nothing the returns computed, and XLA, free to
    # run it first, would copy the slots' buffers for the returns to read
    # (every layer, every transition). A trip count that waits for the
    # rounds (min(rounds, 0) is 0) orders it after them: in place.
    num_evict = num_evict + jnp.minimum(rounds, 0)
    gs = jax.lax.fori_loop(
        0, num_evict, lambda i, g: tuple(
            _put(x, (l, order_s[i]), jnp.zeros(x.shape[2:], x.dtype))
            for x in g), gs)
    return gs, gc
  return jax.lax.fori_loop(0, num_layers, layer,
                           (tuple(gslots), tuple(gcanon)))


@jax.custom_vjp
def returns_in_backward(slot_w, home_acc, acc, returns):
  """Identity on one layer's slot weights (a tuple of [s, X...]), whose
  backward sends the slots' gradients home: per device, inside the layer's
  step of the model's scan, so the return of layer l is issued in the
  backward of layer l, in the computation of its matmuls, where the
  scheduler may overlap it with the rest of that step (the final flush in
  the last micro-step's backward, and the evicted replicas' returns of
  the moves into micro-step m + 1 in micro-step m's, instead of in scans
  of their own after them).

  home_acc: this device's float32 gradient sums of its canonical experts
  of the layer so far ([h, X...]); its cotangent is those sums plus the
  gradients that arrive, so the caller, differentiating it, gets the new
  sums: when nothing is sent they pass through, and no zero-filled
  gradient of the canonical experts is made or added. (The canonical
  weights themselves are not an input: with slot weights they do not
  reach the loss, so nothing differentiates them.)
  acc: the slots' float32 gradients accumulated over the earlier
  micro-steps; returns: ((t_l, active), ...), one layer of each device
  transition whose returns may run (`device_transition` of the flush, of
  a move), applied in order, each with a traced bool, False: it sends
  nothing. A slot a return evicts sends acc + its gradient home, and its
  own cotangent flows on either way (the caller drops it, or zeroes the
  evicted slots' sums: `zero_evicted_local`).
  """
  del home_acc, acc, returns
  return slot_w


def _returns_fwd(slot_w, home_acc, acc, returns):
  return slot_w, (home_acc, acc, returns)


def _returns_bwd(res, ct_w):
  home_acc, acc, returns = res  # The homes' sums so far.
  me = jax.lax.axis_index(EXPERT)
  spd = acc[0].shape[0]
  returns = tuple(_only_where(t_l, active, 'returns')
                  for t_l, active in returns)
  if default_exchange() == 'emulated' and all(
      _single_stage(t_l, 'ret_') for t_l in returns):
    # In place (CPU): each returned item is its slot's sum read as it is
    # sent and added to its home's sum, so a switched-off flush (every
    # micro-step but the last) passes the homes' sums through untouched.
    got = tuple(vary(c.astype(a.dtype),
                     varying_axes(a) | varying_axes(c) | {EXPERT})
                for c, a in zip(home_acc, acc))
    get = lambda _, j: tuple(_item(a, (j,)) + _item(c, (j,)).astype(a.dtype)
                             for a, c in zip(acc, ct_w))
    add = lambda g, i, v: tuple(_put(x, (i,), _item(x, (i,)) + u)
                                for x, u in zip(g, v))
    for t_l in returns:
      got = _returns_inplace(get, add, got, t_l, me, spd)
    return (ct_w, tuple(g.astype(c.dtype) for g, c in zip(got, home_acc)),
            None, None)
  total = tuple(a + c.astype(a.dtype) for a, c in zip(acc, ct_w))
  got = tuple(vary(c.astype(a.dtype), varying_axes(a) | varying_axes(c))
              for c, a in zip(home_acc, total))
  # Switched off by the masks, so the exchanges stay outside any
  # conditional, where the scheduler may overlap them. (A lax.cond around
  # the CPU emulation's return made tracing the bf16 update's backward
  # run for tens of minutes.) Each return reads the slots' sums as the
  # backward made them (a flush tree's partial sums stay its own).
  for t_l in returns:
    if _is_exact(t_l):
      _, got = _layer_returns_exact(total, got, t_l, me, spd,
                                    default_exchange())
    else:
      _, got = _layer_returns(total, got, t_l, me, spd,
                              jax.lax.axis_size(EXPERT))
  ct_homes = tuple(g.astype(c.dtype) for g, c in zip(got, home_acc))
  return (ct_w, ct_homes, None, None)


returns_in_backward.defvjp(_returns_fwd, _returns_bwd)


def _specs(tree):
  return jax.tree.map(lambda _: P(None, EXPERT), tree)


def empty_slots(canon, num_slots: int):
  """Zero slot buffers [L, S, X...] and ids -1, like `canon`'s leaves
  (global or per device: num_slots is the leading slot count wanted)."""
  return tuple(jnp.zeros((w.shape[0], num_slots) + w.shape[2:], w.dtype)
               for w in canon) + (
                   jnp.full((canon[0].shape[0], num_slots), -1, jnp.int32),)


# The fields that switch off each half of a transition on device, and
# their "nothing" value (both modes' names; a transition has one mode's).
_OFF = {
    'fills': (('local_src_LS', -1), ('count_LPDD', 0),
              ('recv_count_LPDD', 0), ('depth_LPK', 0), ('recv_LPDR', -1),
              ('shift_LR', 0), ('recv_LRD', -1)),
    'returns': (('evict_LS', False), ('ret_local_LS', -1),
                ('ret_count_LPDD', 0), ('ret_recv_count_LPDD', 0),
                ('ret_depth_LPK', 0), ('ret_recv_LPDR', -1),
                ('ret_shift_LR', 0), ('ret_recv_LRD', -1)),
}


def _only_where(t_l, active, half: str):
  """One layer's transition with its fills or its returns (`half`)
  switched off unless `active` (a traced bool): no local copy or return,
  nothing sent, received or added. Masked on device, so one schedule
  serves every chunk of layers and every micro-step."""
  t_l = dict(t_l)
  for k, off in _OFF[half]:
    if k in t_l:
      t_l[k] = jnp.where(active, t_l[k], off)
  return t_l


def layer_chunks(num_layers: int, num_chunks: int):
  """int32 [L]: the chunk (0..num_chunks-1) each layer's fill runs in
  when a fill is spread over `num_chunks` steps of a scan, contiguous and
  as even as the counts allow."""
  return jnp.asarray((jnp.arange(num_layers) * num_chunks) // num_layers,
                     jnp.int32)


def _chunk_layers(chunk, num_layers: int, num_chunks: int):
  """(first, end) layer of chunk `chunk` (traced is fine) as `layer_chunks`
  assigns them: the layers l with l * num_chunks // num_layers == chunk."""
  first = (chunk * num_layers + num_chunks - 1) // num_chunks
  end = ((chunk + 1) * num_layers + num_chunks - 1) // num_chunks
  return first, end


def fill_slots_local(slots, canon, t, *, num_devices: int,
                     exchange: str | None = None, chunk=None,
                     num_chunks: int = 1):
  """Per device (inside a shard_map over 'expert'): the slots after one
  transition.

  slots: (weight buffers [L, s, X...]..., ids [L, s]); canon: the home
  experts [L, h, X...]; t: `device_transition(...)` (this device's rows:
  `transition_specs`);
  exchange: ``exact`` mode's collective, 'ragged' or 'emulated' (default:
  the backend's, `default_exchange`);
  chunk: None fills every layer (one scan over them); else the index
  (traced is fine) of the chunk of layers to fill, of `num_chunks`
  (`layer_chunks`), for a fill spread over the iterations of a scan. Only
  that chunk's layers are read and written back (dynamic slices of the
  buffers, updated in place), so a scan carrying the slots does not copy
  every layer's weights on every iteration; the other layers are left as
  they are.
  """
  exchange = exchange or default_exchange()
  me, ids_h, slots = _fill_setup(slots, canon[0].shape[1], canon[0])
  spd = slots[0].shape[1]
  num_layers = canon[0].shape[0]

  def fill(slots_l, canon_l, t_l):
    if _is_exact(t_l):
      return tuple(_layer_fill_exact(slots_l, canon_l, t_l, me, spd,
                                     exchange))
    return tuple(_layer_fill(slots_l, canon_l, t_l, me, spd, num_devices))

  if chunk is None:
    if exchange == 'emulated' and _single_stage(t):
      return _fill_inplace(slots, canon, ids_h, t, me, spd)

    def layer(_, xs):
      slots_l, canon_l, t_l = xs
      return None, fill(tuple(slots_l), tuple(canon_l) + (ids_h,), t_l)
    return jax.lax.scan(layer, None, (tuple(slots), tuple(canon), t))[1]

  # The CPU emulation's and the rounds engine's collectives sit in
  # conditionals anyway: there a switched-off layer skips its fill, send
  # buffer included; else the masks switch it off outside any conditional.
  first, end = _chunk_layers(chunk, num_layers, num_chunks)
  if exchange == 'emulated' and _single_stage(t):
    return _fill_inplace(slots, canon, ids_h, t, me, spd, (first, end))
  skip = exchange == 'emulated' or not _is_exact(t)
  for j in range(-(-num_layers // num_chunks)):  # The largest chunk.
    l = jnp.minimum(first + j, num_layers - 1)
    active = first + j < end
    at = lambda x, l=l: jax.lax.dynamic_index_in_dim(x, l, 0, keepdims=False)
    slots_l = tuple(at(x) for x in slots)
    canon_l = tuple(at(x) for x in canon) + (ids_h,)
    t_l = _only_where(jax.tree.map(at, t), active, 'fills')
    if skip:
      new_l = jax.lax.cond(active, fill, lambda s, c, t: tuple(s),
                           slots_l, canon_l, t_l)
    else:
      new_l = fill(slots_l, canon_l, t_l)
    slots = tuple(jax.lax.dynamic_update_index_in_dim(x, n, l, 0)
                  for x, n in zip(slots, new_l))
  return slots


def _fill_setup(slots, num_home: int, canon_like):
  """(this device's index, the ids of its home experts [h], the slots
  marked varying as what a fill writes into them is)."""
  me = jax.lax.axis_index(EXPERT)
  ids_h = me * num_home + jnp.arange(num_home, dtype=jnp.int32)
  # Fresh (empty) buffers differ per device once written: say so up front.
  axes = varying_axes(canon_like) | {EXPERT}
  return me, ids_h, tuple(vary(x, axes | varying_axes(x)) for x in slots)


def fill_layer_local(slots_l, canon_l, t_l, *, exchange: str | None = None):
  """Per device: one layer's slots after one transition, for a caller that
  runs inside the layer's own step of a scan (the model's, so that the
  exchange sits in the same computation as the layer's compute and the
  scheduler may overlap the two: `MoE.__call__`'s `slot_fills`).

  slots_l: (weight buffers [s, X...]..., ids [s]); canon_l: the home
  experts [h, X...]; t_l: one layer of `device_transition(...)`, this
  device's rows. The ``exact`` exchanges only (not 'emulated'): the CPU
  emulation fills every layer in place (`fill_slots_local`)."""
  exchange = exchange or default_exchange()
  if exchange == 'emulated' or not _is_exact(t_l):
    raise ValueError('fill_layer_local runs the exact exchanges (ragged, '
                     f'a2a, footprint) only, got {exchange!r}.')
  me, ids_h, slots_l = _fill_setup(slots_l, canon_l[0].shape[0], canon_l[0])
  spd = slots_l[0].shape[0]
  return tuple(_layer_fill_exact(slots_l, tuple(canon_l) + (ids_h,), t_l,
                                 me, spd, exchange))


def moves_in_layers(t) -> bool:
  """Whether the moves between micro-steps run inside the model's layer
  scan, their fills in each layer's forward step (`fill_layer_local`) and
  their returns in its backward step (`returns_in_backward`): the exact
  exchanges ('ragged' on GPU/TPU, the 'a2a' stand-in); the CPU emulation
  fills and returns in place, apart."""
  return default_exchange() != 'emulated' and _is_exact(t)


def fill_slots(slots, canon, transition: dict, *, mesh,
               exchange: str | None = None):
  """Slot buffers after one transition.

  Args:
    slots: (weight buffers..., ids): each weight buffer [L, S, X...] and
      the int32 ids [L, S] of the experts they hold, sharded over 'expert'
      on S (the previous micro-step's), or None for empty buffers (the
      step's first fill).
    canon: the matching canonical experts, a tuple of [L, E, X...] sharded
      over 'expert' on E.
    transition: `device_transition(...)` of a schedule Transition.
  Returns:
    slots in the same layout. The ids travelled with the weights: compare
    them with the placement's slot_expert to check the transfer.
  """
  num_devices = mesh.shape[EXPERT]
  num_slots = transition['local_src_LS'].shape[1]
  canon = tuple(canon)
  if slots is None:
    # Empty buffers: zeros that the schedule never reads (it only sends
    # canonical experts when there is no previous placement).
    slots = empty_slots(canon, num_slots)
  slots = tuple(slots)
  fn = jax.shard_map(
      lambda sl, ca, t: fill_slots_local(sl, ca, t, num_devices=num_devices,
                                         exchange=exchange),
      mesh=mesh, in_specs=(_specs(slots), _specs(canon),
                           transition_specs(transition)),
      out_specs=_specs(slots))
  return fn(slots, canon, transition)


def return_grads_local(gslots, gcanon, t, *, num_devices: int,
                       exchange: str | None = None):
  """Per device: `return_grads`, one scan over the layers."""
  exchange = exchange or default_exchange()
  me = jax.lax.axis_index(EXPERT)
  spd = gslots[0].shape[1]
  if exchange == 'emulated' and _single_stage(t, 'ret_'):
    return _return_grads_inplace(gslots, gcanon, t, me, spd)

  def layer(_, xs):
    gs, gc, t_l = xs
    if _is_exact(t_l):
      return None, _layer_returns_exact(gs, gc, t_l, me, spd, exchange)
    return None, _layer_returns(gs, gc, t_l, me, spd, num_devices)
  return jax.lax.scan(layer, None, (tuple(gslots), tuple(gcanon), t))[1]


def zero_evicted_local(gslots, t):
  """Per device: the slots' gradient sums [L, s, X...] with the slots that
  transition t evicts zeroed (their gradients went home in the backward:
  `returns_in_backward`), so each starts accumulating for its new expert.
  A select XLA fuses into the sum that produced gslots: no pass of its own.
  """
  evict_Ls = t['evict_LS']
  return tuple(jnp.where(evict_Ls.reshape(evict_Ls.shape + (1,) * (g.ndim - 2)),
                         jnp.zeros((), g.dtype), g) for g in gslots)


def return_grads(gslots, gcanon, transition: dict, *, mesh,
                 exchange: str | None = None):
  """Sends the gradients of the slots a transition evicts to their homes.

  Args:
    gslots: a tuple of accumulated slot gradients [L, S, X...].
    gcanon: the canonical gradients [L, E, X...] so far.
    transition: `device_transition(...)`; a flush evicts every slot.
  Returns:
    (gslots with evicted slots zeroed, gcanon with their gradients added).
  """
  num_devices = mesh.shape[EXPERT]
  gslots, gcanon = tuple(gslots), tuple(gcanon)
  fn = jax.shard_map(
      lambda gs, gc, t: return_grads_local(gs, gc, t, num_devices=num_devices,
                                           exchange=exchange),
      mesh=mesh, in_specs=(_specs(gslots), _specs(gcanon),
                           transition_specs(transition)),
      out_specs=(_specs(gslots), _specs(gcanon)))
  return fn(gslots, gcanon, transition)


def id_errors_local(ids_Ls, slot_expert_LS, reduce: bool = True):
  """Per device: slots whose travelled id differs from the plan's, summed
  over the 'expert' axis (reduce False: this device's count)."""
  me = jax.lax.axis_index(EXPERT)
  spd = ids_Ls.shape[1]
  want = jax.lax.dynamic_slice_in_dim(slot_expert_LS, me * spd, spd, axis=1)
  bad = (ids_Ls != want).sum().astype(jnp.int32)
  return jax.lax.psum(bad, EXPERT) if reduce else bad


def id_errors(slots, slot_expert_LS, *, mesh):
  """Slots whose travelled expert id differs from the plan's: int32 [].

  Compared where the slots live (one psum of a scalar), so checking the
  transfer adds no gather of the ids.
  """
  ids = slots[-1]
  return jax.shard_map(id_errors_local, mesh=mesh,
                       in_specs=(P(None, EXPERT), P()),
                       out_specs=P())(ids, slot_expert_LS)
