"""The RL update's GPU path, lowered for CUDA on this CPU host.

The one-GPU machine `make gpu-check` runs on has a single device, so there
the exact dispatch's ragged all-to-all and the transfer engine's ragged
fills and returns never cross a device boundary, and the MSA kernels never
run inside the sharded step. Here the update of an 8-device EP mesh is
traced and lowered for CUDA with the choices a GPU backend makes (the
`gpu_choices` fixture of tests/conftest.py: `jax.lax.ragged_all_to_all` for
the exchanges, the Pallas Triton grouped GEMM, the Pallas Triton MSA
kernels): every shape, dtype, varying
axis and transpose rule of that path is checked by jax's own abstract
evaluation, at no device time. It cannot compile here (XLA:CPU has no
ragged all-to-all), so what runs on a GPU is left to the gpu tests.
"""
import collections
import re

from foremoe_jax.benchmarks import memory_report
from pallas_kernels.msa import api as msa_api


def _lowered_text(config: str, tokens_per_seq: int,
                  exchange: str = 'ragged') -> str:
  report = memory_report.MemoryReport(
      config=config, ep=8, seqs_per_device=2, tokens_per_seq=tokens_per_seq,
      microsteps=2, redundant_slots_per_device=1)
  return memory_report.lowered_update(
      report, 2, exchange=exchange, platforms=('cuda',)).as_text()


def _moved(text: str) -> collections.Counter:
  """(collective, element type of its result) for every collective that
  moves rows or weights between devices."""
  moved = collections.Counter()
  for line in text.split('\n'):
    m = re.search(r'stablehlo\.(all_to_all|all_gather|collective_permute)'
                  r'"?\(.*-> tensor<[0-9x]*x?([a-z0-9]+)>$', line)
    if m:
      moved[m.group(1), m.group(2)] += 1
    elif 'ragged_all_to_all' in line and 'custom_call' in line:
      moved['ragged_all_to_all',
            re.search(r'-> tensor<[0-9x]*x([a-z0-9]+)>', line).group(1)] += 1
  return moved


def test_the_update_lowers_for_cuda_with_ragged_exchanges(gpu_choices):
  del gpu_choices
  text = _lowered_text('tiny', 24)
  moved = _moved(text)
  # Tokens to their slots and back, forward and backward, and the engine's
  # fills and gradient returns: every float crosses a device boundary in a
  # ragged all-to-all. The fixed-size collectives carry only the int32
  # counts (send sizes to receive sizes) and the placement's ids.
  assert moved['ragged_all_to_all', 'f32'] >= 4, moved
  assert {dtype for kind, dtype in moved
          if kind != 'ragged_all_to_all'} <= {'i32'}, moved
  # The expert SwiGLU: its matmuls and weight gradients as Triton kernels,
  # per device, not ragged_dot (dense GEMMs over every group on a GPU).
  assert 'grouped_tile_matmul' in text and 'grouped_slot_matmul_t' in text
  assert 'ragged_dot' not in text


def test_the_ragged_exchange_adds_no_all_reduce(gpu_choices):
  # What a ragged all-to-all writes differs per device. Typed as the same
  # on every device (its zeros output buffer's type), autodiff summed the
  # received rows' cotangents over the mesh: an all-reduce of every
  # device's row gradients into every other's, wrong values that a
  # one-GPU run cannot show. The CPU emulation, checked against the
  # loop-over-experts reference, has its all-reduces only where the
  # update needs them (loss, statistics, replicated weights): the ragged
  # exchange must have the same ones.
  del gpu_choices
  count = lambda text: text.count('stablehlo.all_reduce')
  ragged = count(_lowered_text('tiny', 24))
  emulated = count(_lowered_text('tiny', 24, exchange='emulated'))
  assert ragged == emulated, (ragged, emulated)


def test_the_msa_update_lowers_its_triton_kernels_per_device(gpu_choices,
                                                            monkeypatch):
  """The MSA model's update, its attention run per device inside the step's
  shard_map: every Pallas kernel's outputs must say which mesh axes they
  vary over (`kernel_common.pallas_call`), and the loops around them must
  keep one carry type."""
  del gpu_choices
  config = memory_report.model_config

  def gpu_blocks(report, num_layers=None):
    cfg = config(report, num_layers)
    cfg.model.msa_block_size = 16  # The Triton kernels' smallest tile.
    return cfg
  monkeypatch.setattr(memory_report, 'model_config', gpu_blocks)
  text = _lowered_text('tiny_msa', 63)
  for name in ('msa_index_scores', 'msa_index_topk', 'msa_kv_outer_forward',
               'msa_kv_outer_dkv', 'msa_backward_dq_gpu'):
    assert name in text, name
  assert 'grouped_tile_matmul' in text
  assert _moved(text)['ragged_all_to_all', 'f32'] >= 4
  # A kernel output typed as the same on every device would be summed over
  # the mesh in the backward: the XLA attention's update has the same
  # all-reduces.
  monkeypatch.setattr(msa_api, 'resolve_impl', lambda impl, *a, **k: (
      'xla', None, False))
  xla_text = _lowered_text('tiny_msa', 63)
  assert 'msa_kv_outer_forward' not in xla_text
  assert (text.count('stablehlo.all_reduce')
          == xla_text.count('stablehlo.all_reduce'))
