"""A hardware profile of this machine, measured rather than assumed.

Runs small programs on the local devices (on CPU, the simulated devices of
`--xla_force_host_platform_device_count`) with the repository's own
kernels and fits the profile's constants:

* all-to-all: the EP layer's token exchange at three sizes -> bandwidth
  and latency (one tier: every simulated device shares one memory);
* expert copies: the transfer engine's own fill and return rounds at the
  model's expert size (`engine_round_times`);
* memory: an elementwise pass over a large array on every device;
* compute: the model's forward and backward on one micro-batch (canonical
  layout, exact dispatch, routes replayed, no planner, no moves) at five
  routing skews that raise the busiest device's rows, fitted as `fixed +
  rows * slope` (the simulated devices run the busiest device's tiles in
  lockstep, so the busiest device's rows set the time). The slope gives
  the expert GEMM rate F; the fixed part, less the emulated exchange and
  the non-expert FLOPs at F, gives the per-layer overhead. At these tiny
  shapes per-op overheads dominate, so the profile is fitted on the
  benchmark's model shapes; it knows nothing of the methods, their plans,
  their moves or their timings.

Timings are medians over interleaved repetitions, as the benchmark reports. Collectives on the XLA CPU backend are synchronous,
so nothing overlaps (`transfer_overlap = 0`).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel, sharding, transformer
from foremoe_jax.planner.topology import Topology
from foremoe_jax.rl import step as step_lib
from foremoe_jax.sim import costs
from foremoe_jax.sim.hardware import HardwareProfile
from foremoe_jax.sim.workload import ModelShape
from foremoe_jax.transfer import engine, schedule

EXPERT = expert_parallel.EXPERT


def _median_times(programs: dict, repeats: int = 9) -> dict:
  """{key: (fn, args)} -> {key: seconds}: the median over repetitions (the
  statistic the benchmark it is checked against reports), the programs
  interleaved so that a burst of load hits all of them."""
  for fn, args in programs.values():
    jax.block_until_ready(fn(*args))  # Compile and warm up.
  times = {k: [] for k in programs}
  for _ in range(repeats):
    for k, (fn, args) in programs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[k].append(time.perf_counter() - t0)
  return {k: float(np.median(v)) for k, v in times.items()}


def _fit_line(x, y):
  """(intercept, slope) of a least-squares line, slope kept > 0."""
  slope, icpt = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
  return float(icpt), float(max(slope, 1e-30))


def all_to_all_times(mesh, rows_list, width: int) -> dict:
  """Seconds of one all-to-all of [D, rows, width] f32 per device."""
  num_dev = mesh.shape[EXPERT]
  fn = jax.jit(jax.shard_map(
      lambda a: jax.lax.all_to_all(a, EXPERT, 0, 0, tiled=True), mesh=mesh,
      in_specs=P(EXPERT), out_specs=P(EXPERT)))
  return _median_times({
      int(rows * width * 4 * num_dev): (
          fn, (jnp.ones((num_dev * num_dev, rows, width), jnp.float32),))
      for rows in rows_list})


def engine_round_times(mesh, model: ModelShape, slots_per_device: int,
                       num_rounds: int | None = None) -> dict:
  """Seconds per round of the transfer engine itself, in place: fills
  (`engine.fill_slots`) and gradient returns (`engine.return_grads`) of one
  layer, with `num_rounds` rounds against none under the same budget.

  Device k (k = 1..n) puts expert 0 (home: device 0) in its redundant slot:
  one sender, n distinct shifts, so exactly n fill rounds; evicting those
  replicas gives n return rounds.
  """
  num_dev = mesh.shape[EXPERT]
  e, d, f = model.num_experts, model.d_model, model.moe_d_ff
  n = num_dev - 1 if num_rounds is None else num_rounds
  topo = Topology(1, num_dev, slots_per_device)
  home_LS = np.asarray(placement_lib.identity_placement(
      1, e, num_dev, slots_per_device).slot_expert, np.int64)
  busy_LS = home_LS.copy()
  for k in range(1, n + 1):
    busy_LS[0, (k + 1) * slots_per_device - 1] = 0  # Device k's last slot.
  rng = np.random.default_rng(0)
  shard = jax.sharding.NamedSharding(mesh, P(None, EXPERT))
  canon = tuple(jax.device_put(jnp.asarray(rng.standard_normal(sh),
                                           jnp.float32), shard)
                for sh in ((1, e, d, f), (1, e, d, f), (1, e, f, d)))

  def trans(prev, nxt):
    return engine.device_transition(schedule.transition(prev, nxt, e, topo, n))
  slots0 = engine.fill_slots(None, canon, trans(None, home_LS), mesh=mesh)
  fill = jax.jit(lambda s, t: engine.fill_slots(s, canon, t, mesh=mesh))
  grads = tuple(slots0[:3])
  ret = jax.jit(lambda g, t: engine.return_grads(g, canon, t, mesh=mesh))
  t = _median_times({
      'fill_0': (fill, (slots0, trans(home_LS, home_LS))),
      'fill_n': (fill, (slots0, trans(home_LS, busy_LS))),
      'ret_0': (ret, (grads, trans(home_LS, home_LS))),
      'ret_n': (ret, (grads, trans(busy_LS, home_LS))),
  })
  return {'fill_round_s': max(t['fill_n'] - t['fill_0'], 1e-9) / n,
          'return_round_s': max(t['ret_n'] - t['ret_0'], 1e-9) / n,
          'rounds': n, 'item_bytes': model.params_per_expert * 4}


def memory_bandwidth(mesh, elems_per_device: int = 1 << 22) -> float:
  """Bytes/s of one device reading and writing, all devices at once."""
  num_dev = mesh.shape[EXPERT]
  x = jax.device_put(jnp.ones((num_dev, elems_per_device), jnp.float32),
                     jax.sharding.NamedSharding(mesh, P(EXPERT)))
  fn = jax.jit(lambda a: a * 1.0001 + 0.5)
  return 2 * 4 * elems_per_device / _median_times({0: (fn, (x,))})[0]


def skewed_routes(rng, num_layers: int, num_tokens: int, num_experts: int,
                  top_k: int, hot_experts, skew: float) -> np.ndarray:
  """int32 routes [L, N, K]: each token picks `top_k` distinct experts;
  with probability `skew` the first ones are the `hot_experts` (those
  homed on one device), else uniformly at random. Raises the busiest
  device's rows from the uniform share to about skew * all rows."""
  keys = rng.random((num_layers, num_tokens, num_experts))
  hot = np.zeros(num_experts, bool)
  hot[np.asarray(hot_experts)] = True
  chosen = rng.random((num_layers, num_tokens, 1)) < skew
  keys = np.where(chosen & hot, keys + 2.0, keys)
  return np.argsort(-keys, axis=-1)[..., :top_k].astype(np.int32)


def busiest_device_rows(routes_LNK, num_experts: int, num_devices: int,
                        num_data: int = 1) -> int:
  """Rows the busiest device receives over layers (home layout; tokens
  split over the devices in order, as the model lays them out)."""
  num_layers, num_tokens, _ = routes_LNK.shape
  homes = num_experts // num_devices
  per_group = num_tokens // num_data
  most = 0
  for g in range(num_data):
    ids = routes_LNK[:, g * per_group:(g + 1) * per_group]
    for l in range(num_layers):
      most = max(most, int(np.bincount(ids[l].reshape(-1) // homes,
                                       minlength=num_devices).max()))
  return most


def model_microstep_times(model_cfg, mesh, tokens_per_seq: int,
                          seqs_per_device: int, skews, seed: int = 0,
                          dispatch: str = 'exact') -> dict:
  """Seconds of the whole model's forward + backward on one micro-batch
  (canonical layout, routes replayed) at several routing skews, keyed by
  the busiest device's rows; each runs at the capacity bucket of its own
  demand, as the trainer would pick it."""
  model = transformer.Transformer(model_cfg, mesh, rngs=nnx.Rngs(seed),
                                  dispatch=dispatch)
  graphdef, params = sharding.split_model(model, mesh)
  num_dev = mesh.shape[EXPERT]
  b = seqs_per_device * num_dev
  rng = np.random.default_rng(seed)
  toks = jnp.asarray(rng.integers(0, model_cfg.vocab_size,
                                  (b, tokens_per_seq + 1)), jnp.int32)
  valid = jnp.ones(toks.shape, bool)
  e, k = model_cfg.num_experts, model_cfg.top_k
  num_moe = model_cfg.num_layers - model_cfg.first_dense_layers
  spd = e // num_dev
  buckets = config_lib.capacity_buckets(seqs_per_device * tokens_per_seq, k,
                                        num_dev, spd, dispatch=dispatch)
  programs = {}
  for skew in skews:
    routes_LNK = skewed_routes(rng, num_moe, b * tokens_per_seq, e, k,
                               np.arange(spd), skew)
    rows = busiest_device_rows(routes_LNK, e, num_dev)
    cap = config_lib.pick_bucket(rows, buckets)
    routes = jnp.asarray(routes_LNK.reshape(num_moe, b, tokens_per_seq, k))

    def loss(params, routes=routes, cap=cap):
      logp, _ = step_lib.token_logp(graphdef, params, toks, valid, None,
                                    routes, cap)
      return -logp.mean()
    programs[rows] = (jax.jit(jax.grad(loss)), (params,))
  return _median_times(programs)


def cpu_profile(model_cfg, *, tokens_per_seq: int, seqs_per_device: int,
                slots_per_device: int,
                skews=(0.0, 0.15, 0.3, 0.45, 0.6), log=print
                ) -> tuple[HardwareProfile, dict]:
  """Measures this machine on the given model's shapes; returns the
  profile and the raw measurements."""
  model = ModelShape.from_config(model_cfg)
  num_dev = len(jax.devices())
  mesh = expert_parallel.make_mesh(1, num_dev)
  tokens = tokens_per_seq * seqs_per_device
  raw = {}
  raw['all_to_all_s'] = a2a = all_to_all_times(mesh, (16, 64, 128),
                                                model.d_model)
  lat_a2a, inv_bw = _fit_line(list(a2a), list(a2a.values()))
  # The simulator charges an all-to-all its off-device bytes: (D-1)/D.
  bw_a2a = (num_dev - 1) / num_dev / inv_bw
  log(f'calibrate: all-to-all {bw_a2a / 1e9:.2f} GB/s, {lat_a2a * 1e3:.3f} ms')
  raw['engine_rounds'] = rounds = engine_round_times(mesh, model,
                                                     slots_per_device)
  # One expert per round at this size: the whole round time as bandwidth.
  round_s = 0.5 * (rounds['fill_round_s'] + rounds['return_round_s'])
  copy_bw = rounds['item_bytes'] / round_s
  log(f"calibrate: engine round {rounds['fill_round_s'] * 1e3:.2f} ms fill, "
      f"{rounds['return_round_s'] * 1e3:.2f} ms return")
  raw['hbm_bw'] = hbm = memory_bandwidth(mesh)
  log(f'calibrate: memory {hbm / 1e9:.2f} GB/s per device')
  raw['model_microstep_s'] = micro = model_microstep_times(
      model_cfg, mesh, tokens_per_seq, seqs_per_device, skews)
  probe = HardwareProfile('probe', 1.0, 1.0, hbm, 0, bw_a2a, lat_a2a, bw_a2a,
                          lat_a2a)
  # The emulated exchange moves the per-cell bound on every pair: a fixed
  # cost per layer, the same at every skew.
  chunk = costs.padded_cells(num_dev, tokens * min(model.top_k,
                                                   model.num_experts // num_dev))
  a2a_s = model.num_moe_layers * 4 * costs.all_to_all_time(
      chunk * model.d_model * 4, probe)
  rows = list(micro)
  rest = [t - a2a_s for t in micro.values()]
  fixed, slope = _fit_line(rows, rest)
  flops = model.num_moe_layers * model.expert_flops_per_row() / slope
  nonexpert_s = tokens * model.nonexpert_flops_per_token(tokens_per_seq) / flops
  layer_overhead = max(fixed - nonexpert_s, 0.0) / (2 * model.num_layers)
  log(f'calibrate: micro-step {min(micro.values()) * 1e3:.1f}-'
      f'{max(micro.values()) * 1e3:.1f} ms over busiest-device rows '
      f'{rows}; expert GEMM {flops / 1e9:.2f} GFLOP/s per device, '
      f'{layer_overhead * 1e3:.3f} ms per layer and pass')
  profile = HardwareProfile(
      name='cpu_measured', peak_flops_per_s=flops, matmul_efficiency=1.0,
      hbm_bw=hbm, devices_per_node=0, intra_bw=bw_a2a,
      intra_latency_s=lat_a2a, inter_bw=bw_a2a, inter_latency_s=lat_a2a,
      layer_overhead_s=layer_overhead, transfer_overlap=0.0,
      copy_bw=copy_bw, copy_latency_s=0.0, emulated_exchange=True,
      tiled_gemm=True,
      notes=f'measured on {num_dev} local {jax.devices()[0].platform} '
            f'devices by foremoe_jax.sim.calibrate (exact dispatch, '
            f'emulated exchange, lockstep tile loop)')
  return profile, {k: ({str(a): b for a, b in v.items()}
                       if isinstance(v, dict) else v) for k, v in raw.items()}
