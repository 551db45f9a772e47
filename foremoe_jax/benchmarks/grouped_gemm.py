"""The expert compute alone: grouped SwiGLU kinds on one device, forward+backward.

An expert-parallel MoE layer spends its FLOPs in `grouped_swiglu`: the rows
a device received, each through its slot's expert. Which kind runs them
decides whether those FLOPs run at tensor-core speed. This times each kind
(grouped_swiglu.KINDS) on one device's share of a layer: a buffer of R
rows of which `live_rows` hold routed tokens, spread over s slots by a
shuffled Zipf law (a planned device still has uneven slots), the rest
empty (-1). The call is what training runs: the gradient of a weighted
sum of the live outputs w.r.t. the rows and the three weight stacks.

The baseline is what a dense batched GEMM of the same useful rows costs:
the live rows split evenly over the s slots, one `einsum` per matmul
(cuBLAS on a GPU). No grouped kernel can do less work, so the ratio to it
is an efficiency, not a speedup.

Before timing, every kind's output and gradients are compared with a
float32 reference over the same rows (each slot's rows gathered into a
slot-padded batch, the einsum in float32): a kind whose error is over
`tolerance` (relative to the reference's largest value) is reported and
left out of the timing, so a wrong kernel never posts a time.

Defaults are one device of a Qwen3-30B-A3B layer at expert parallelism 8
on a GPU (4,096 tokens x top-8 = 32,768 routed rows in a buffer of 65,536;
16 experts + 2 redundant slots; model dim 2,048, expert dim 768); on CPU
shapes 16x smaller in each dim (`CPU`).

Shape letters: R rows, M model dim, F expert hidden dim, s slots, g rows
per slot of the even split.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from foremoe_jax.model import grouped_swiglu
from pallas_kernels.msa import benchmark as msa_benchmark


@dataclasses.dataclass(frozen=True)
class GroupedGemmBench:
  rows: int = 65536          # R: the receive buffer
  live_rows: int = 32768     # routed rows in it (the rest empty)
  slots: int = 18            # s: local slots
  model_dim: int = 2048      # M
  hidden_dim: int = 768      # F
  zipf_alpha: float = 1.0    # rows per slot ~ 1 / rank^alpha, shuffled
  dtype: str = 'bfloat16'
  kinds: tuple[str, ...] = ('pallas', 'ragged_dot')
  tile: int = grouped_swiglu.PALLAS_TILE  # rows per tile of the tile kinds
  tolerance: float = 2e-2    # max error / max |reference|, bf16 rounding
  repeats: int = 5
  seed: int = 0


# A CPU run: the CPU's kinds, 16x smaller dims (the tile kinds' loop and
# the pallas kind's jnp reference are all a CPU has).
CPU = dict(rows=4096, live_rows=2048, slots=6, model_dim=128, hidden_dim=64,
           kinds=('tiles_lockstep', 'ragged_dot', 'pallas'), tile=32,
           dtype='float32', tolerance=1e-4)


def slot_counts(cfg: GroupedGemmBench, rng) -> np.ndarray:
  """Rows per slot [s]: live_rows split by a shuffled Zipf law."""
  p = rng.permutation(1.0 / np.arange(1, cfg.slots + 1) ** cfg.zipf_alpha)
  c = np.floor(p / p.sum() * cfg.live_rows).astype(np.int64)
  c[np.argmax(p)] += cfg.live_rows - c.sum()
  return c


def inputs(cfg: GroupedGemmBench):
  """(x_RM, label_R, wg_sMF, wu_sMF, wd_sFM, ct_RM): rows in random order,
  empty rows labelled -1, and a cotangent for the live rows."""
  if not 0 < cfg.live_rows <= cfg.rows:
    raise ValueError(f'live_rows must be in (0, rows={cfg.rows}], got '
                     f'{cfg.live_rows}.')
  rng = np.random.default_rng(cfg.seed)
  count_s = slot_counts(cfg, rng)
  label_R = np.full((cfg.rows,), -1, np.int32)
  label_R[:cfg.live_rows] = np.repeat(np.arange(cfg.slots), count_s)
  label_R = rng.permutation(label_R)
  dt = jnp.dtype(cfg.dtype)
  ks = jax.random.split(jax.random.key(cfg.seed), 5)
  m, f, s = cfg.model_dim, cfg.hidden_dim, cfg.slots
  n = jax.random.normal
  x = n(ks[0], (cfg.rows, m), dt)
  wg = (n(ks[1], (s, m, f)) / m ** 0.5).astype(dt)
  wu = (n(ks[2], (s, m, f)) / m ** 0.5).astype(dt)
  wd = (n(ks[3], (s, f, m)) / f ** 0.5).astype(dt)
  ct = jnp.where(jnp.asarray(label_R >= 0)[:, None],
                 n(ks[4], (cfg.rows, m), dt), 0).astype(dt)
  return x, jnp.asarray(label_R), wg, wu, wd, ct


def useful_flops(cfg: GroupedGemmBench) -> float:
  """Forward+backward FLOPs of the live rows: three matmuls of 2*M*F per
  row forward, twice that backward."""
  return 3 * 3 * 2 * cfg.live_rows * cfg.model_dim * cfg.hidden_dim


def kind_step(cfg: GroupedGemmBench, kind: str):
  """(x, label, wg, wu, wd, ct) -> (y, (dx, dwg, dwu, dwd)) by `kind`."""
  def loss(x, wg, wu, wd, label, ct):
    y = grouped_swiglu.grouped_swiglu(x, label, wg, wu, wd, tile=cfg.tile,
                                      kind=kind)
    # Empty rows' outputs are unspecified: only live rows count.
    y = jnp.where((label >= 0)[:, None], y, 0)
    return jnp.sum((y * ct).astype(jnp.float32)), y

  def step(x, label, wg, wu, wd, ct):
    grads, y = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        x, wg, wu, wd, label, ct)
    return y, grads
  return step


def reference_step(x, label, wg, wu, wd, ct, num_slots: int,
                   per_slot: int):
  """kind_step in float32 by a slot-padded batch: each slot's rows
  gathered into [s, per_slot, M] (per_slot >= the largest slot), one
  einsum per matmul, scattered back."""
  f32 = lambda a: a.astype(jnp.float32)
  key = jnp.where(label >= 0, label, num_slots)
  order = jnp.argsort(key, stable=True)
  count = jnp.zeros((num_slots + 1,), jnp.int32).at[key].add(1)[:num_slots]
  first = jnp.cumsum(count) - count
  rank = jnp.arange(label.shape[0]) - first[jnp.minimum(key[order],
                                                        num_slots - 1)]
  live = key[order] < num_slots
  slot_o = jnp.where(live, key[order], num_slots)  # dropped when empty
  pos_o = jnp.where(live, rank, 0)

  # Full float32 products (a GPU's default f32 dot may use TF32).
  mm = lambda eq, a, b: jnp.einsum(eq, a, b,
                                   precision=jax.lax.Precision.HIGHEST)

  def loss(x, wg, wu, wd):
    x_sgM = jnp.zeros((num_slots, per_slot, x.shape[1]), jnp.float32).at[
        slot_o, pos_o].set(f32(x[order]), mode='drop')
    h = (jax.nn.silu(mm('sgm,smf->sgf', x_sgM, f32(wg)))
         * mm('sgm,smf->sgf', x_sgM, f32(wu)))
    y_sgM = mm('sgf,sfm->sgm', h, f32(wd))
    y_o = y_sgM.at[slot_o, pos_o].get(mode='fill', fill_value=0)
    y = jnp.zeros((label.shape[0], x.shape[1]), jnp.float32).at[order].set(
        y_o)
    return jnp.sum(y * f32(ct)), y

  grads, y = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
      f32(x), f32(wg), f32(wu), f32(wd))
  return y, grads


def batched_step(cfg: GroupedGemmBench):
  """The baseline: the live rows split evenly over the slots ([s, g, M]),
  a dense batched einsum per matmul, forward+backward."""
  def loss(x_sgM, wg, wu, wd, ct_sgM):
    dt = x_sgM.dtype
    mm = lambda eq, a, w: jnp.einsum(
        eq, a, w.astype(dt), preferred_element_type=jnp.float32).astype(dt)
    h = (jax.nn.silu(mm('sgm,smf->sgf', x_sgM, wg))
         * mm('sgm,smf->sgf', x_sgM, wu))
    y = mm('sgf,sfm->sgm', h, wd)
    return jnp.sum((y * ct_sgM).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2, 3))


def rel_error(got, want) -> float:
  """max |got - want| / max |want| over a pytree (float32)."""
  errs = jax.tree.map(
      lambda g, w: float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))
                         / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30)),
      got, want)
  return max(jax.tree.leaves(errs))


def run(cfg: GroupedGemmBench, log=print, deadline: float | None = None
        ) -> dict:
  """Check every kind against the float32 reference, then time those that
  pass beside the batched baseline (interleaved). deadline
  (time.monotonic()): no phase starts past it; the rest reads skipped."""
  left = lambda: (float('inf') if deadline is None
                  else deadline - time.monotonic())
  for kind in cfg.kinds:
    if kind not in grouped_swiglu.KINDS:
      raise ValueError(f'kinds must be among {grouped_swiglu.KINDS}, got '
                       f'{kind!r}.')
  args = inputs(cfg)
  x, label, wg, wu, wd, ct = args
  count_s = np.bincount(np.asarray(label)[np.asarray(label) >= 0],
                        minlength=cfg.slots)
  out = {'bench': 'grouped_gemm', 'backend': jax.default_backend(),
         'shape': {k: getattr(cfg, k) for k in (
             'rows', 'live_rows', 'slots', 'model_dim', 'hidden_dim',
             'dtype')},
         'rows_per_slot': count_s.tolist(),
         'useful_gflop': useful_flops(cfg) / 1e9, 'check': {}, 'errors': {}}
  if left() <= 0:
    return {**out, 'skipped': 'deadline', 'complete': False}
  ref = jax.jit(reference_step, static_argnums=(6, 7))(
      *args, cfg.slots, int(count_s.max()))
  ok = []
  for kind in cfg.kinds:
    if left() <= 0:
      out['errors'][kind] = 'skipped: deadline'
      continue
    try:
      got = jax.jit(kind_step(cfg, kind))(*args)
      err = rel_error(got, ref)
    except Exception as e:  # pylint: disable=broad-except
      out['errors'][kind] = msa_benchmark.error_text(e)
      continue
    out['check'][kind] = err
    log(f'# check {kind}: max error / max |reference| {err:.2e}')
    if err <= cfg.tolerance:
      ok.append(kind)
    else:
      out['errors'][kind] = (f'error {err:.3g} over tolerance '
                             f'{cfg.tolerance:g}: not timed')
  del ref
  g = -(-cfg.live_rows // cfg.slots)
  x_sgM = x[:cfg.slots * g].reshape(cfg.slots, g, -1) if (
      cfg.slots * g <= cfg.rows) else jnp.resize(x, (cfg.slots, g, x.shape[1]))
  fns = {'batched': (batched_step(cfg),
                     (x_sgM, wg, wu, wd, jnp.ones_like(x_sgM)))}
  fns.update({kind: (kind_step(cfg, kind), args) for kind in ok})
  if left() <= 0:
    return {**out, 'skipped': 'deadline', 'complete': False}
  spread, compile_s, errors = {}, {}, {}
  med = msa_benchmark.measure(fns, cfg.repeats, spread=spread, errors=errors,
                              compile_s=compile_s)
  out['errors'].update(errors)
  flops = useful_flops(cfg)
  out.update({
      'seconds': med, 'spread': spread, 'compile_s': compile_s,
      'tflops': {k: flops / v / 1e12 for k, v in med.items()},
      # The batched GEMM's time over each kind's: 1 is dense-GEMM speed.
      'efficiency_vs_batched': {k: med['batched'] / v for k, v in med.items()
                                if k != 'batched' and 'batched' in med},
  })
  for k, v in med.items():
    log(f'{k:>16}: {v * 1e3:8.3f} ms  {flops / v / 1e12:7.1f} TFLOP/s')
  if 'pallas' in med and 'ragged_dot' in med:
    out['pallas_speedup_vs_ragged_dot'] = med['ragged_dot'] / med['pallas']
  out['complete'] = not out['errors'] and all(k in med for k in cfg.kinds)
  return out
