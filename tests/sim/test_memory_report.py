"""The memory report: XLA's buffer assignment of the real step vs the model."""
import jax
import numpy as np
import pytest

from foremoe_jax.benchmarks import memory_report


@pytest.fixture(scope='module')
def report():
  return memory_report.MemoryReport(
      config='tiny', ep=8, seqs_per_device=2, tokens_per_seq=24,
      microsteps=2, redundant_slots_per_device=1, check_layers=2,
      compile_layers=(2, 3))


@pytest.fixture(scope='module')
def result(report):
  return memory_report.run(report, log=lambda *a: None)


def test_compiled_arguments_hold_the_f32_state_sharded(report, result):
  """XLA's argument bytes per device hold the float32 parameters and both
  Adam moments at one device's share (experts split over EP, the rest
  split over every device: the report's fsdp_axes='data+expert'), counted
  here from the abstract model's own shardings, and little more (the batch
  and the plan are small); well under the replicated state's bytes."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from foremoe_jax.model import expert_parallel, shapes, sharding  # pylint: disable=import-outside-toplevel
  cfg = memory_report.model_config(report, 2)
  mesh = expert_parallel.make_mesh(1, report.ep)
  _, state = nnx.split(shapes.abstract_model(cfg.model, mesh))
  assert report.fsdp_axes == 'data+expert'
  leaves = [v for _, v in nnx.to_flat_state(state)]

  def state_bytes(**fsdp):
    shards = jax.tree.leaves(sharding.state_shardings(state, mesh, **fsdp))
    return sum(int(np.prod(s.shard_shape(v.shape))) * 4
               for v, s in zip(leaves, shards))
  split = state_bytes(fsdp=True, fsdp_axes='data+expert')
  xla = result['check']['2']['xla']
  assert 3 * split <= xla['argument'] <= 3 * split * 1.1
  assert xla['argument'] < 0.6 * 3 * state_bytes()  # Replicated: ~2x more.
  assert xla['peak'] >= xla['argument']


def test_report_takes_the_larger_of_model_and_extrapolated_xla(result):
  res = result
  xla = {int(d): c['xla']['peak'] for d, c in res['check'].items()}
  slope = xla[3] - xla[2]
  assert res['xla_bytes_per_layer'] == pytest.approx(slope, rel=1e-6)
  # tiny has 2 layers: the extrapolation is XLA's own peak at 2, and the
  # full depth (compiled: full_depth is on) is that same program.
  assert res['xla_extrapolated_full_depth'] == pytest.approx(xla[2], rel=1e-6)
  assert res['xla_full_depth_compiled'] and res['xla_full_depth'] == xla[2]
  assert res['compile_s_full_depth'] == res['compile_s_by_layers']['2']
  # ... and the largest of the model, that program and the same update
  # with the moves inside the layers, as GPU/TPU run it.
  assert res['xla_full_depth_moves_in_layers'] == (
      res['check_moves_in_layers']['2']['xla']['peak'])
  assert res['peak_bytes_per_device'] == max(
      res['model_full_depth']['total'], res['xla_full_depth'],
      res['xla_full_depth_moves_in_layers'])
  assert res['model_bytes_per_layer'] > 0 and slope > 0


def test_model_tracks_xla_at_every_compiled_depth(result):
  """The memory model (counted from the shapes) stays within 15% of XLA's
  buffer assignment of the compiled step at each depth (4% on this toy
  shape; 8% at Qwen3-30B-A3B, EP 64, in results/memory_report.json), and
  its per-layer slope is XLA's within a quarter."""
  for depth, c in result['check'].items():
    xla, model = c['xla']['peak'], c['model']['total']
    assert abs(model / xla - 1) <= 0.15, (depth, model, xla)
    assert c['rel_error_model_vs_xla'] == pytest.approx(model / xla - 1)
  # The update as GPU/TPU run it (the moves' fills in the layers' forward,
  # their returns in its backward) too.
  moved = result['check_moves_in_layers']['2']
  model = result['check']['2']['model']['total']
  assert abs(model / moved['xla']['peak'] - 1) <= 0.15, moved
  assert moved['over_emulation_bytes'] == pytest.approx(
      moved['xla']['peak'] - result['check']['2']['xla']['peak'])
  assert result['model_bytes_per_layer'] == pytest.approx(
      result['xla_bytes_per_layer'], rel=0.25)


def test_moves_in_layers_compile_with_the_footprint_exchange(report):
  """Inside `engine.use_exchange('footprint')` the update is traced as a
  GPU runs it: the moves' fills and returns sit in the computations of the
  layers' matmuls (the emulation's run in scans of their own), by
  collective-permutes, with no conditional around them; outside it, the
  backend's emulation again."""
  from foremoe_jax.transfer import engine  # pylint: disable=import-outside-toplevel
  from foremoe_jax.utils import hlo  # pylint: disable=import-outside-toplevel
  texts = {}
  for name in ('footprint', None):
    texts[name] = memory_report.lowered_update(
        report, 2, engine_exchange=name).compile().as_text()
  assert engine.default_exchange() == 'emulated'
  with pytest.raises(ValueError, match='exchange must be one of'):
    with engine.use_exchange('shifts'):
      pass

  def permutes_beside_matmuls(text):
    computes = hlo.compute_computations(text)
    return [c for c in hlo.collectives(text)
            if c['kind'] == 'collective-permute'
            and c['computation'] in computes]
  moved = permutes_beside_matmuls(texts['footprint'])
  assert moved and not any(c['in_conditional'] for c in moved), moved
  assert len(moved) > len(permutes_beside_matmuls(texts[None]))
