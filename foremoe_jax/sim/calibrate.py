"""A hardware profile of this machine, measured rather than assumed.

Runs small programs on the local devices (on CPU, the simulated devices of
`--xla_force_host_platform_device_count`) with the repository's own
kernels and fits the profile's constants:

* expert compute: the EP layer (`expert_parallel_ffn`), forward and
  backward, at several capacities with random routing, minus its four
  all-to-alls, fitted as `layer_overhead + rows * flops_per_row / F`;
* all-to-all: the layer's token exchange at two sizes -> bandwidth and
  latency (one tier: every simulated device shares one memory);
* expert copies: transfer-engine rounds (`engine._shifted`, a cyclic-shift
  permute inside the engine's conditional) at two sizes;
* memory: an elementwise pass over a large array on every device;
* the non-expert part: the whole model's forward and backward on one
  micro-batch at a known capacity, minus its modelled expert layers, gives
  the non-expert efficiency.

Collectives on the XLA CPU backend are synchronous, so nothing overlaps
(`transfer_overlap = 0`). Nothing here reads the benchmark it validates.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel, sharding, transformer
from foremoe_jax.rl import step as step_lib
from foremoe_jax.sim import costs
from foremoe_jax.sim.hardware import HardwareProfile
from foremoe_jax.sim.workload import ModelShape
from foremoe_jax.transfer import engine

EXPERT = expert_parallel.EXPERT


def _median_time(fn, *args, repeats: int = 7) -> float:
  jax.block_until_ready(fn(*args))  # Compile and warm up.
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _fit_line(x, y):
  """(intercept, slope) of a least-squares line, slope kept > 0."""
  slope, icpt = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
  return float(icpt), float(max(slope, 1e-30))


def ep_layer_times(mesh, model: ModelShape, tokens_per_device: int,
                   slots_per_device: int, capacities, seed: int = 0) -> dict:
  """Seconds of one EP layer forward + backward per capacity."""
  num_dev = mesh.shape[EXPERT]
  d, f, e, k = model.d_model, model.moe_d_ff, model.num_experts, model.top_k
  n = tokens_per_device * num_dev
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  ids = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :k], jnp.int32)
  gates = jnp.full((n, k), 1.0 / k, jnp.float32)
  valid = jnp.ones((n,), bool)
  p = placement_lib.identity_placement(1, e, num_dev, slots_per_device)
  spd = slots_per_device
  w = [jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32) for s in
       ((num_dev * spd, d, f), (num_dev * spd, d, f), (num_dev * spd, f, d))]
  out = {}
  for cap in capacities:
    def loss(x, wg, wu, wd, cap=cap):
      y, _ = expert_parallel.expert_parallel_ffn(
          x, ids, gates, valid, wg, wu, wd,
          jnp.asarray(p.slot_expert[0]), jnp.asarray(p.slot_share[0]),
          mesh=mesh, capacity=cap, num_experts=e)
      return (y * y).sum()
    out[int(cap)] = _median_time(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
                                 x, *w)
  return out


def all_to_all_times(mesh, rows_list, width: int) -> dict:
  """Seconds of one all-to-all of [D, rows, width] f32 per device."""
  num_dev = mesh.shape[EXPERT]
  out = {}
  for rows in rows_list:
    x = jnp.ones((num_dev * num_dev, rows, width), jnp.float32)
    fn = jax.jit(jax.shard_map(
        lambda a: jax.lax.all_to_all(a, EXPERT, 0, 0, tiled=True), mesh=mesh,
        in_specs=P(EXPERT), out_specs=P(EXPERT)))
    out[int(rows * width * 4 * num_dev)] = _median_time(fn, x)
  return out


def round_times(mesh, item_elems_list, num_rounds: int = 8) -> dict:
  """Seconds per transfer-engine round moving an item of n f32 elements."""
  num_dev = mesh.shape[EXPERT]
  out = {}
  for elems in item_elems_list:
    x = jnp.ones((num_dev, elems), jnp.float32)

    def body(a, rounds):
      shift_R = jnp.full((rounds,), 1, jnp.int32)
      def step(r, c):
        return jax.lax.cond(shift_R[r] != 0,
                            lambda c: engine._shifted(c, shift_R[r], num_dev)  # pylint: disable=protected-access
                            + 1.0, lambda c: c, c)
      return jax.lax.fori_loop(0, rounds, step, a)

    def prog(rounds):
      return jax.jit(jax.shard_map(lambda a: body(a, rounds), mesh=mesh,
                                   in_specs=P(EXPERT), out_specs=P(EXPERT)))
    t1 = _median_time(prog(1), x)
    tn = _median_time(prog(num_rounds + 1), x)
    out[int(elems * 4)] = max(tn - t1, 1e-9) / num_rounds
  return out


def memory_bandwidth(mesh, elems_per_device: int = 1 << 22) -> float:
  """Bytes/s of one device reading and writing, all devices at once."""
  num_dev = mesh.shape[EXPERT]
  x = jax.device_put(jnp.ones((num_dev, elems_per_device), jnp.float32),
                     jax.sharding.NamedSharding(mesh, P(EXPERT)))
  fn = jax.jit(lambda a: a * 1.0001 + 0.5)
  return 2 * 4 * elems_per_device / _median_time(fn, x)


def model_microstep_time(model_cfg, mesh, tokens_per_seq: int,
                         seqs_per_device: int, capacity: int,
                         seed: int = 0) -> float:
  """Seconds of the whole model's forward + backward on one micro-batch
  (canonical layout, fresh routing, a fixed capacity)."""
  model = transformer.Transformer(model_cfg, mesh, rngs=nnx.Rngs(seed))
  graphdef, params = sharding.split_model(model, mesh)
  num_dev = mesh.shape[EXPERT]
  b = seqs_per_device * num_dev
  rng = np.random.default_rng(seed)
  toks = jnp.asarray(rng.integers(0, model_cfg.vocab_size,
                                  (b, tokens_per_seq + 1)), jnp.int32)
  valid = jnp.ones(toks.shape, bool)

  def loss(params):
    logp, _ = step_lib.token_logp(graphdef, params, toks, valid, None, None,
                                  capacity)
    return -logp.mean()
  return _median_time(jax.jit(jax.grad(loss)), params)


def cpu_profile(model_cfg, *, tokens_per_seq: int, seqs_per_device: int,
                slots_per_device: int, capacities=(32, 64, 128),
                log=print) -> tuple[HardwareProfile, dict]:
  """Measures this machine on the given model's shapes; returns the
  profile and the raw measurements."""
  model = ModelShape.from_config(model_cfg)
  num_dev = len(jax.devices())
  mesh = expert_parallel.make_mesh(1, num_dev)
  tokens = tokens_per_seq * seqs_per_device
  raw = {}
  raw['all_to_all_s'] = a2a = all_to_all_times(mesh, (16, 128), model.d_model)
  lat_a2a, inv_bw = _fit_line(list(a2a), list(a2a.values()))
  bw_a2a = 1.0 / inv_bw
  # The simulator charges an all-to-all its off-device bytes: (D-1)/D.
  bw_a2a *= (num_dev - 1) / num_dev
  log(f'calibrate: all-to-all {bw_a2a / 1e9:.2f} GB/s, {lat_a2a * 1e3:.3f} ms')
  raw['round_s'] = rounds = round_times(
      mesh, (1024, model.params_per_expert))
  lat_copy, inv_bw = _fit_line(list(rounds), list(rounds.values()))
  log(f'calibrate: engine round {1 / inv_bw / 1e9:.2f} GB/s, '
      f'{lat_copy * 1e3:.3f} ms')
  raw['hbm_bw'] = hbm = memory_bandwidth(mesh)
  log(f'calibrate: memory {hbm / 1e9:.2f} GB/s per device')
  raw['ep_layer_s'] = layer = ep_layer_times(mesh, model, tokens,
                                             slots_per_device, capacities)
  probe = HardwareProfile('probe', 1.0, 1.0, hbm, 0, bw_a2a, lat_a2a, bw_a2a,
                          lat_a2a)
  rows, rest = [], []
  for cap, t in layer.items():
    tile = expert_parallel.default_tile(num_dev * cap, slots_per_device)
    rows.append(costs.padded_rows(num_dev, cap, slots_per_device, tile))
    rest.append(t - 4 * costs.all_to_all_time(
        costs.padded_cells(num_dev, cap) * model.d_model * 4, probe))
  icpt, slope = _fit_line(rows, rest)
  flops = model.expert_flops_per_row() / slope
  layer_overhead = max(icpt, 0.0) / 2  # Per pass; fwd + bwd is two.
  log(f'calibrate: expert GEMM {flops / 1e9:.2f} GFLOP/s per device, '
      f'{layer_overhead * 1e3:.3f} ms per layer and pass')
  cap0 = capacities[-1]
  raw['model_microstep_s'] = whole = model_microstep_time(
      model_cfg, mesh, tokens_per_seq, seqs_per_device, cap0)
  expert_part = model.num_moe_layers * float(np.interp(
      cap0, list(layer), list(layer.values())))
  nonexpert_s = max(whole - expert_part
                    - model.num_layers * 2 * layer_overhead, 1e-6)
  ne_flops = tokens * model.nonexpert_flops_per_token(tokens_per_seq)
  ne_eff = min(1.0, ne_flops / nonexpert_s / flops)
  log(f'calibrate: model micro-step {whole * 1e3:.1f} ms, non-expert part '
      f'{nonexpert_s * 1e3:.1f} ms ({ne_eff:.3f} of the GEMM rate)')
  profile = HardwareProfile(
      name='cpu_measured', peak_flops_per_s=flops, matmul_efficiency=1.0,
      hbm_bw=hbm, devices_per_node=0, intra_bw=bw_a2a,
      intra_latency_s=lat_a2a, inter_bw=bw_a2a, inter_latency_s=lat_a2a,
      layer_overhead_s=layer_overhead, nonexpert_efficiency=ne_eff,
      transfer_overlap=0.0, copy_bw=1.0 / inv_bw, copy_latency_s=lat_copy,
      notes=f'measured on {num_dev} local {jax.devices()[0].platform} '
            f'devices by foremoe_jax.sim.calibrate')
  return profile, raw
