"""The RL update's GPU path, lowered for CUDA on this CPU host.

The one-GPU machine `make gpu-check` runs on has a single device, so there
the exact dispatch's ragged all-to-all and the transfer engine's ragged
fills and returns never cross a device boundary. Here the update of an
8-device EP mesh is traced and lowered for CUDA with the choices a GPU
backend makes (`jax.lax.ragged_all_to_all` for the exchanges,
`jax.lax.ragged_dot` for the grouped GEMM): every shape, dtype and
transpose rule of that path is checked by jax's own abstract evaluation,
at no device time. It cannot compile here (XLA:CPU has no ragged
all-to-all), so what runs on a GPU is left to the gpu tests.
"""
import collections
import re

from foremoe_jax.benchmarks import memory_report
from foremoe_jax.model import dispatch_exact, grouped_swiglu


def test_the_update_lowers_for_cuda_with_ragged_exchanges(monkeypatch):
  # What a GPU backend picks when nothing is named (the defaults read
  # jax.default_backend(), which is 'cpu' here).
  monkeypatch.setattr(dispatch_exact, 'default_exchange',
                      lambda backend=None: 'ragged')
  monkeypatch.setattr(grouped_swiglu, 'default_kind',
                      lambda backend=None: 'ragged_dot')
  report = memory_report.MemoryReport(
      config='tiny', ep=8, seqs_per_device=2, tokens_per_seq=24,
      microsteps=2, redundant_slots_per_device=1)
  text = memory_report.lowered_update(
      report, 2, exchange='ragged', platforms=('cuda',)).as_text()
  # (collective, element type of its result) for every collective that
  # moves rows or weights between devices.
  moved = collections.Counter()
  for line in text.split('\n'):
    m = re.search(r'stablehlo\.(all_to_all|all_gather|collective_permute)'
                  r'"?\(.*-> tensor<[0-9x]*x?([a-z0-9]+)>$', line)
    if m:
      moved[m.group(1), m.group(2)] += 1
    elif 'ragged_all_to_all' in line and 'custom_call' in line:
      moved['ragged_all_to_all',
            re.search(r'-> tensor<[0-9x]*x([a-z0-9]+)>', line).group(1)] += 1
  # Tokens to their slots and back, forward and backward, and the engine's
  # fills and gradient returns: every float crosses a device boundary in a
  # ragged all-to-all. The fixed-size collectives carry only the int32
  # counts (send sizes to receive sizes) and the placement's ids.
  assert moved['ragged_all_to_all', 'f32'] >= 4, moved
  assert {dtype for kind, dtype in moved
          if kind != 'ragged_all_to_all'} <= {'i32'}, moved
  assert 'ragged_dot' in text
