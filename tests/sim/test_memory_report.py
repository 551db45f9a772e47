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
  assert res['peak_bytes_per_device'] == max(
      res['model_full_depth']['total'], res['xla_full_depth'])
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
  assert result['model_bytes_per_layer'] == pytest.approx(
      result['xla_bytes_per_layer'], rel=0.25)
