"""Does load balance turn into wall-clock? The EP MoE layer, static vs balanced.

Skewed (Zipf-like) micro-batch-sized routing is dispatched through
`expert_parallel_ffn` with the identity (static EP) placement and with the
ForeMoE planner's placement for these loads, under both dispatches, each
at its smallest dropless bucket: 'exact' (the default: a device computes
the rows it receives, the simulated devices in lockstep, so time follows
the busiest device) and 'padded' (every cell padded to the bucket, so time
follows the worst (source, destination) cell). Repetitions are interleaved
so the ratios are fair on a shared machine.

The balanced layer is also reported with its moves: the transfer engine's
fill of the slots from the canonical experts (home layout -> the plan:
only replicas and relocated experts cross devices, by ppermute rounds), in
bytes and seconds, beside the all-gather of every expert that it replaces.

Shape letters: N tokens, K top-k, E experts, D EP devices, M model dim,
F expert hidden dim.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax import planner
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model.moe_reference import reference_moe_ffn
from foremoe_jax.transfer import engine, schedule


@dataclasses.dataclass(frozen=True)
class MoELayerBench:
  tokens: int = 4096  # One micro-step: e.g. 8 sequences of 512 tokens.
  experts: int = 64
  top_k: int = 2
  # Large enough that expert compute, not dispatch, dominates the layer.
  model_dim: int = 512
  hidden_dim: int = 1024
  redundant_slots_per_device: int = 2
  zipf_alpha: float = 1.0  # Expert popularity ~ 1 / rank^alpha, shuffled.
  repeats: int = 7
  seed: int = 0


def zipf_routing(rng, num_tokens, num_experts, top_k, alpha):
  """Top-k ids without replacement from a shuffled Zipf popularity."""
  pop_E = 1.0 / np.arange(1, num_experts + 1) ** alpha
  pop_E = rng.permutation(pop_E / pop_E.sum())
  # Gumbel top-k = sampling k distinct experts with probability ~ popularity.
  g = rng.gumbel(size=(num_tokens, num_experts)) + np.log(pop_E)
  return np.argsort(-g, axis=1)[:, :top_k].astype(np.int32)


def source_counts(ids_NK, num_devices, num_experts):
  per = ids_NK.shape[0] // num_devices
  src_N = np.arange(ids_NK.shape[0]) // per
  c = np.zeros((1, num_devices, num_experts), np.int64)
  np.add.at(c[0], (np.repeat(src_N, ids_NK.shape[1]), ids_NK.reshape(-1)), 1)
  return c


def run(cfg: MoELayerBench, mesh) -> dict:
  rng = np.random.default_rng(cfg.seed)
  num_dev = mesh.shape[ep.EXPERT]
  spd = cfg.experts // num_dev + cfg.redundant_slots_per_device
  ids = zipf_routing(rng, cfg.tokens, cfg.experts, cfg.top_k, cfg.zipf_alpha)
  counts = source_counts(ids, num_dev, cfg.experts)
  x = jnp.asarray(rng.normal(size=(cfg.tokens, cfg.model_dim)), jnp.float32)
  gates = jnp.asarray(rng.random(ids.shape), jnp.float32)
  valid = jnp.ones((cfg.tokens,), bool)
  scale = cfg.model_dim ** -0.5
  w = [jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for s in
       [(cfg.experts, cfg.model_dim, cfg.hidden_dim)] * 2
       + [(cfg.experts, cfg.hidden_dim, cfg.model_dim)]]
  identity = placement_lib.identity_placement(1, cfg.experts, num_dev, spd)
  # Copies are priced apart (transfer_s), so the planner is told they are
  # free: it balances the loads as far as it can, keeping experts home (the
  # engine refills slots from home, so only replicas move).
  topo = planner.Topology(1, num_dev, spd)
  plan = planner.plan_step(counts[None], topo,
                           planner.CostModel(bytes_per_expert=0.0),
                           current=identity,
                           config=planner.ForeMoEConfig(home_anchor=True))
  placements = {'static': identity, 'balanced': plan.microstep(0)}
  buckets = {d: config_lib.capacity_buckets(cfg.tokens // num_dev, cfg.top_k,
                                            num_dev, spd, dispatch=d)
             for d in ep.DISPATCHES}
  traces = []

  # Reference transfer: every device all-gathers every expert, then indexes.
  gather = jax.jit(lambda se: [ep.gather_slot_weights(a, se, mesh=mesh)
                               for a in w])
  fills = {}
  for name, p in placements.items():
    se_LS = p.slot_expert
    rounds = int(max(1, schedule.rounds_needed(None, se_LS, cfg.experts,
                                               topo).max()))
    fills[name] = schedule.transition(None, se_LS, cfg.experts, topo, rounds)
  fill_fn = jax.jit(lambda t: tuple(s[0] for s in engine.fill_slots(
      None, tuple(a[None] for a in w), t, mesh=mesh)[:3]))

  def fwd(tokens, slot_w, se, share, capacity, dispatch):
    traces.append((capacity, dispatch))
    return ep.expert_parallel_ffn(*tokens, *slot_w, se, share, mesh=mesh,
                                  capacity=capacity, num_experts=cfg.experts,
                                  dispatch=dispatch)
  f = jax.jit(fwd, static_argnums=(4, 5))
  ref = reference_moe_ffn(x, jnp.asarray(ids), gates, valid, *w)
  # Tokens already sharded as the model's layers hand them over, so the
  # timing is the layer's, not a reshard of its inputs.
  tokens = jax.device_put((x, jnp.asarray(ids), gates, valid), NamedSharding(
      mesh, P((ep.DATA, ep.EXPERT))))
  out = {}
  for name, p in placements.items():
    se = jnp.asarray(p.slot_expert[0])
    t_dev = engine.device_transition(fills[name])
    slot_w = jax.block_until_ready(fill_fn(t_dev))
    gathered = jax.block_until_ready(gather(se))
    for a, g in zip(slot_w, gathered):  # The engine's slots are the gather's.
      np.testing.assert_array_equal(np.asarray(a), np.asarray(g))
    fill_times, gather_times = [], []
    for _ in range(3):
      t0 = time.perf_counter()
      jax.block_until_ready(fill_fn(t_dev))
      fill_times.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      jax.block_until_ready(gather(se))
      gather_times.append(time.perf_counter() - t0)
    bytes_per_expert = sum(a[0].size * a.dtype.itemsize for a in w)
    out[name] = dict(transfer_s=float(np.median(fill_times)),
                     allgather_s=float(np.median(gather_times)),
                     rounds=int(fills[name].rounds_used_L.max()),
                     move_bytes_per_device=float(
                         fills[name].remote_fills_L.sum() * bytes_per_expert
                         / num_dev),
                     allgather_bytes_per_device=float(
                         (cfg.experts - cfg.experts // num_dev)
                         * bytes_per_expert),
                     max_over_mean=float(placement_lib.max_over_mean(
                         placement_lib.device_loads(counts, p))[0]))
    for d in ep.DISPATCHES:
      demand = placement_lib.capacity_demand(counts[None], p, d)
      cap = config_lib.pick_bucket(demand, buckets[d])
      args = (tokens, slot_w, se, jnp.asarray(p.slot_share[0]), cap, d)
      y, stats = f(*args)
      assert int(stats.dropped) == 0, (name, d, int(stats.dropped))
      out[name][d] = dict(args=args, capacity=cap, demand=demand,
                          err=float(jnp.abs(y - ref).max()), times=[])
  for _ in range(cfg.repeats):  # Interleaved repetitions.
    for name in placements:
      for d in ep.DISPATCHES:
        r = out[name][d]
        t0 = time.perf_counter()
        jax.block_until_ready(f(*r['args']))
        r['times'].append(time.perf_counter() - t0)
  s, b = out['static'], out['balanced']
  med = lambda r, d: float(np.median(r[d]['times']))
  res = dict(
      devices=num_dev, tokens=cfg.tokens, experts=cfg.experts,
      top_k=cfg.top_k, slots_per_device=spd,
      buckets={d: list(v) for d, v in buckets.items()},
      static_max_over_mean=s['max_over_mean'],
      balanced_max_over_mean=b['max_over_mean'],
      target_speedup=0.8 * s['max_over_mean'] / b['max_over_mean'],
      # The balanced layer's moves: the engine's fill (rounds of ppermute)
      # against the all-gather it replaces.
      transfer_s=b['transfer_s'], transfer_rounds=b['rounds'],
      move_bytes_per_device=b['move_bytes_per_device'],
      allgather_transfer_s=b['allgather_s'],
      allgather_bytes_per_device=b['allgather_bytes_per_device'],
      max_abs_err_vs_reference=max(r[d]['err'] for r in (s, b)
                                   for d in ep.DISPATCHES),
      compiles=f._cache_size(), traces=len(traces))
  for d in ep.DISPATCHES:
    sfx = '' if d == 'exact' else f'_{d}'
    res.update({
        f'static_capacity{sfx}': s[d]['capacity'],
        f'balanced_capacity{sfx}': b[d]['capacity'],
        f'static_demand{sfx}': s[d]['demand'],
        f'balanced_demand{sfx}': b[d]['demand'],
        f'static_s{sfx}': med(s, d), f'balanced_s{sfx}': med(b, d),
        f'speedup{sfx}': med(s, d) / med(b, d),
        f'speedup_with_moves{sfx}': med(s, d) / (med(b, d) + b['transfer_s'])})
  res['exact_vs_padded_balanced'] = med(b, 'padded') / med(b, 'exact')
  return res
