"""Per-device memory and compile time of the RL update at real size.

Two sources, set side by side:

* the memory model (`sim.memory.update_memory`), component by component,
  for a model config, an EP size and tokens per device per micro-step;
* XLA's own buffer assignment of the compiled update (`memory_analysis`):
  the real step (`rl/step.py` `RLStep.update`), lowered from abstract
  arrays (no weight is allocated) on a mesh of simulated CPU devices as
  large as the EP group, at reduced depth, so it compiles on this host.
  Its exchange is `dispatch_exact.footprint_exchange`, which holds the
  buffers of the ragged all-to-all a GPU runs (XLA:CPU compiles no such
  op, and the CPU emulation pads every pair of devices to a static bound).

The transfer engine's moves are compiled both ways: as the CPU emulation
runs them (in place, after each micro-step's backward) and as GPU/TPU do
(inside the layers, `engine.moves_in_layers`, with a stand-in of the
ragged collective's buffers: `lowered_update`'s engine_exchange), at the
check depth and at full depth; the headline peak is the largest of the
model and both.

The model is checked against XLA at each compiled depth; XLA's peaks give
a per-layer slope, extrapolated to the config's full depth beside the
model's own count. The compile times at those depths show that scanning
over the layers keeps compile time flat in depth.

Run in a process whose XLA_FLAGS give it `--xla_force_host_platform_
device_count` >= the EP size (experiments/memory_report.py starts one).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel, moe, shapes, sharding
from foremoe_jax.planner.topology import Topology
from foremoe_jax.rl import step as step_lib
from foremoe_jax.sim import memory
from foremoe_jax.sim.workload import ModelShape, Workload
from foremoe_jax.transfer import engine, schedule


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  config: str = 'qwen3_30b_a3b'
  ep: int = 64
  seqs_per_device: int = 2  # Per micro-step.
  tokens_per_seq: int = 4096
  microsteps: int = 2  # Of the compiled step (memory does not grow with M).
  redundant_slots_per_device: int = 2
  check_layers: int = 2  # Depth of the step compiled against the model.
  compile_layers: tuple = (2, 4, 8)  # Depths compiled (times, XLA's slope).
  # Also compile the config's whole depth (abstract arrays: nothing is
  # allocated, and the scanned layers keep its compile as quick as 2's):
  # XLA's own peak and compile time of the real step, not extrapolated.
  full_depth: bool = True
  capacity_factor: float = 1.25  # Receive bucket over the uniform rows.
  remat_policy: str = 'full'
  # Non-expert master weights and Adam moments split over every device
  # (parallel.fsdp_axes='data+expert'); '' keeps them replicated.
  fsdp_axes: str = 'data+expert'


def model_config(report: MemoryReport, num_layers: int | None = None):
  import importlib  # pylint: disable=g-import-not-at-top
  cfg = importlib.import_module(f'configs.{report.config}').get_config()
  m = cfg.model
  if num_layers is not None:
    m.num_layers = num_layers
    m.first_dense_layers = min(m.first_dense_layers, num_layers - 1)
  m.remat_policy = report.remat_policy
  m.max_seq_len = max(m.max_seq_len, report.tokens_per_seq + 1)
  return cfg


def _capacity_rows(report: MemoryReport, m) -> int:
  tokens = report.seqs_per_device * report.tokens_per_seq
  spd = m.num_experts // report.ep + report.redundant_slots_per_device
  buckets = config_lib.capacity_buckets(tokens, m.top_k, report.ep, spd)
  return config_lib.pick_bucket(
      int(report.capacity_factor * tokens * m.top_k), buckets)


def modelled(report: MemoryReport, num_layers: int | None = None) -> dict:
  """The memory model's components (bytes per device)."""
  cfg = model_config(report, num_layers)
  m = cfg.model
  shape = ModelShape.from_config(m)
  work = Workload(num_devices=report.ep, num_microsteps=report.microsteps,
                  seqs_per_microbatch=report.seqs_per_device,
                  tokens_per_seq=report.tokens_per_seq,
                  redundant_slots_per_device=report.redundant_slots_per_device,
                  remat_policy=report.remat_policy,
                  fsdp_all=bool(report.fsdp_axes))
  spd = work.slots_per_device(shape)
  return memory.update_memory(
      shape, work, ep=report.ep, slots_per_device=spd,
      capacity_rows=_capacity_rows(report, m),
      remat_policy=report.remat_policy,
      fsdp_shards=report.ep if work.fsdp_all else 1,
      step_rounds=int(cfg.transfer.step_rounds),
      microstep_rounds=int(cfg.transfer.microstep_rounds),
      flush=str(cfg.transfer.get('flush', 'auto'))).as_dict()


def _modules(model):
  iterate = getattr(nnx, 'iter_modules', None)
  return iterate(model) if iterate else model.iter_modules()


def _abstract(x, sharding_):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_)


def compiled_update(report: MemoryReport, num_layers: int,
                    engine_exchange: str | None = None):
  """(compiled update, seconds to build, lower and compile) at this depth.
  engine_exchange: as `lowered_update`'s."""
  t0 = time.perf_counter()
  compiled = lowered_update(report, num_layers,
                            engine_exchange=engine_exchange).compile()
  return compiled, time.perf_counter() - t0


def lowered_update(report: MemoryReport, num_layers: int, *,
                   exchange: str = 'footprint', platforms=None,
                   engine_exchange: str | None = None):
  """The update at this depth, lowered from abstract arrays.

  exchange: the dispatch's ('footprint': XLA:CPU compiles no ragged
  all-to-all, so the memory report lowers the step with a stand-in that
  holds the real collective's buffers, `dispatch_exact`; 'ragged': the
  GPU/TPU collective, to lower for `platforms`, e.g. ('cuda',)).
  engine_exchange: the transfer engine's (`engine.EXCHANGES`; None: the
  backend's, on CPU the emulation, whose moves run in place after each
  micro-step's backward). 'footprint' lowers the step as a GPU runs it:
  the moves' fills inside the layers' forward (the next micro-step's
  slots then live through the backward), their returns in its backward,
  in buffers of the ragged collective's sizes.
  """
  if engine_exchange is not None:
    with engine.use_exchange(engine_exchange):
      return lowered_update(report, num_layers, exchange=exchange,
                            platforms=platforms)
  cfg = model_config(report, num_layers)
  m = cfg.model
  mesh = expert_parallel.make_mesh(1, report.ep)
  abstract = shapes.abstract_model(m, mesh)
  for _, module in _modules(abstract):
    if isinstance(module, moe.MoE):
      module.exchange = exchange
  graphdef, state = nnx.split(abstract)
  flat = nnx.to_flat_state(state)
  shard = jax.tree.leaves(sharding.state_shardings(
      state, mesh, fsdp=bool(report.fsdp_axes),
      fsdp_axes=report.fsdp_axes or 'data'))
  # The float32 master the train state holds, laid out as the trainer's.
  params = nnx.from_flat_state([
      (path, v.replace(jax.ShapeDtypeStruct(v.shape, jnp.float32,
                                            sharding=s)))
      for (path, v), s in zip(flat, shard)])
  tx = step_lib.make_optimizer(1e-6, 1.0)
  opt = jax.eval_shape(tx.init, params)
  # Adam's moments are laid out like their parameters (a leaf's sharding
  # follows from its shape and kind, so its shape finds it): the experts'
  # over 'expert', the rest replicated or split as the parameters are.
  by_shape = {tuple(v.shape): s for (_, v), s in zip(flat, shard)}
  repl = NamedSharding(mesh, P())
  opt = jax.tree.map(lambda x: _abstract(x, by_shape.get(
      tuple(x.shape), repl)), opt)
  train_state = step_lib.TrainState(
      graphdef, params, opt, None, _abstract(jnp.zeros((), jnp.int32), repl))
  per_mb = report.seqs_per_device * report.ep
  t = report.tokens_per_seq + 1
  num_moe = config_lib.num_moe_layers(m)
  rows = NamedSharding(mesh, P(None, (expert_parallel.DATA,
                                      expert_parallel.EXPERT)))
  routes = NamedSharding(mesh, P(None, None, (expert_parallel.DATA,
                                              expert_parallel.EXPERT)))
  mm = report.microsteps
  batch = dict(
      tokens_MbT=_abstract(jnp.zeros((mm, per_mb, t), jnp.int32), rows),
      valid_MbT=_abstract(jnp.zeros((mm, per_mb, t), bool), rows),
      loss_mask_MbT=_abstract(jnp.zeros((mm, per_mb, t - 1), jnp.float32),
                              rows),
      routes_MLbTK=_abstract(jnp.zeros((mm, num_moe, per_mb, t - 1, m.top_k),
                                       jnp.int16), routes),
      rewards_B=_abstract(jnp.zeros((mm * per_mb,), jnp.float32), repl),
      microbatches_Mb=_abstract(jnp.zeros((mm, per_mb), jnp.int32), repl))
  spd = m.num_experts // report.ep + report.redundant_slots_per_device
  topo = Topology(1, report.ep, spd)
  ident = placement_lib.identity_placement(num_moe, m.num_experts, report.ep,
                                           spd)
  stacked = placement_lib.stack_placements([ident] * mm)
  # Laid out as the trainer lays them out: each device its own rows.
  transfer = schedule.build_step_transfer(
      stacked.slot_expert, m.num_experts, topo,
      schedule.TransferBudget(int(cfg.transfer.step_rounds),
                              int(cfg.transfer.microstep_rounds),
                              flush=str(cfg.transfer.get('flush', 'auto'))))
  plan = step_lib.StepPlan(step_lib.device_placement(stacked, mesh),
                           step_lib.device_transfer(transfer, mesh),
                           _capacity_rows(report, m))
  rl_step = step_lib.make_rl_step(tx, num_generations=8, eps_low=0.2,
                                  eps_high=0.28, beta=0.0)
  return rl_step.update.trace(train_state, batch, {}, plan).lower(
      lowering_platforms=platforms)


def xla_bytes(compiled) -> dict:
  """XLA's buffer assignment of a compiled program, per device."""
  ma = compiled.memory_analysis()
  out = dict(argument=float(ma.argument_size_in_bytes),
             output=float(ma.output_size_in_bytes),
             alias=float(ma.alias_size_in_bytes),
             temp=float(ma.temp_size_in_bytes))
  # Donated state aliases the output: arguments + temporaries is the peak.
  out['peak'] = out['argument'] + out['temp'] + max(
      0.0, out['output'] - out['alias'])
  return out


def run(report: MemoryReport = MemoryReport(), log=print) -> dict:
  """Model vs XLA at every compiled depth; the headline peak is the larger
  of the model at full depth and XLA's peak at full depth: compiled there
  (`full_depth`), else extrapolated along XLA's own per-layer slope (a
  least-squares line through the reduced depths: what does not grow with
  depth, XLA's transients, is its intercept)."""
  num_layers = model_config(report).model.num_layers
  full = modelled(report)
  log(f"model: {full['total'] / 1e9:.1f} GB per device at {num_layers} "
      f'layers ({report.config}, EP {report.ep})')
  reduced = sorted(set(report.compile_layers) | {report.check_layers})
  depths = sorted(set(reduced) | ({num_layers} if report.full_depth
                                  else set()))
  compile_s, checks = {}, {}
  for depth in depths:
    compiled, secs = compiled_update(report, depth)
    compile_s[depth] = secs
    xla, model = xla_bytes(compiled), modelled(report, depth)
    del compiled
    rel = model['total'] / xla['peak'] - 1
    checks[depth] = dict(model=model, xla=xla, rel_error_model_vs_xla=rel)
    log(f'{depth} layers: compiled in {secs:.1f} s; model '
        f"{model['total'] / 1e9:.2f} GB, XLA {xla['peak'] / 1e9:.2f} GB "
        f'({100 * rel:+.1f}%)')
  # The same update as a GPU runs it (the moves inside the layers, the
  # ragged collective's buffers): at the check depth against the model, and
  # at full depth for the headline.
  exact = {}
  for depth in sorted({report.check_layers}
                      | ({num_layers} if report.full_depth else set())):
    compiled, secs = compiled_update(report, depth, engine_exchange='footprint')
    xla, model = xla_bytes(compiled), checks[depth]['model']
    del compiled
    rel = model['total'] / xla['peak'] - 1
    exact[depth] = dict(xla=xla, rel_error_model_vs_xla=rel,
                        over_emulation_bytes=(xla['peak']
                                              - checks[depth]['xla']['peak']))
    log(f'{depth} layers, moves in the layers (GPU/TPU): compiled in '
        f"{secs:.1f} s; XLA {xla['peak'] / 1e9:.2f} GB ({100 * rel:+.1f}% "
        f"model), {exact[depth]['over_emulation_bytes'] / 1e9:+.2f} GB over "
        'the CPU emulation')
  peaks = np.array([checks[d]['xla']['peak'] for d in reduced])
  slope, intercept = np.polyfit(np.array(reduced, float), peaks, 1)
  xla_extrapolated = float(intercept + slope * num_layers)
  compiled_full = num_layers in checks
  xla_full = (checks[num_layers]['xla']['peak'] if compiled_full
              else xla_extrapolated)
  model_slope = ((checks[reduced[-1]]['model']['total']
                  - checks[reduced[0]]['model']['total'])
                 / (reduced[-1] - reduced[0]))
  xla_full_exact = exact[num_layers]['xla']['peak'] if compiled_full else None
  peak = max(full['total'], xla_full, xla_full_exact or 0.0)
  log(f'XLA per layer {slope / 1e9:.2f} GB (model {model_slope / 1e9:.2f});'
      f' XLA extrapolated to {num_layers} layers '
      f'{xla_extrapolated / 1e9:.1f} GB'
      + (f', compiled there {xla_full / 1e9:.1f} GB' if compiled_full else '')
      + f'; peak {peak / 1e9:.1f} GB')
  return dict(
      report=dataclasses.asdict(report), num_layers=num_layers,
      peak_bytes_per_device=peak, model_full_depth=full,
      xla_full_depth=xla_full, xla_full_depth_compiled=compiled_full,
      # The update as GPU/TPU run it (module docstring of lowered_update's
      # engine_exchange), at the check depth and, when compiled, full depth.
      xla_full_depth_moves_in_layers=xla_full_exact,
      check_moves_in_layers={str(d): v for d, v in exact.items()},
      rel_error_model_vs_xla_moves_in_layers=exact[report.check_layers][
          'rel_error_model_vs_xla'],
      xla_extrapolated_full_depth=xla_extrapolated,
      xla_bytes_per_layer=float(slope), model_bytes_per_layer=model_slope,
      check={str(d): checks[d] for d in depths},
      rel_error_model_vs_xla=checks[report.check_layers][
          'rel_error_model_vs_xla'],
      compile_s_by_layers={str(d): compile_s[d] for d in depths},
      compile_growth=compile_s[depths[-1]] / compile_s[depths[0]],
      compile_s_full_depth=compile_s.get(num_layers),
      fits_80gb_with_10pct_headroom=peak <= 0.9 * 80e9)
