"""Per-device memory and compile time of the RL update at real size.

  python -m experiments.memory_report --json

Counts Qwen3-30B-A3B's update on an EP group of 64 (8,192 tokens a device
per micro-step, bf16 compute, float32 master weights and Adam moments)
with the non-expert state split over the 64 devices (ZeRO, parallel.
fsdp_axes='data+expert'; --fsdp_axes=none replicates it), with the
memory model (foremoe_jax/sim/memory.py), checks the model
against XLA's buffer assignment of the real compiled step at reduced
depths (2, 4, 8 layers) and at full depth on 64 simulated CPU devices,
extrapolates XLA's peak along its per-layer slope beside the compiled
full depth, and times the compiles.
The logic lives in foremoe_jax/benchmarks/memory_report.py.
"""
import dataclasses
import os

# The check compiles on an EP group of 64 simulated devices.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=64')

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top

from experiments import common  # pylint: disable=g-import-not-at-top
from foremoe_jax.benchmarks import memory_report  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils.run_info import print_run_info  # pylint: disable=g-import-not-at-top

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line '
                          '(progress on stderr).')
_CONFIG = flags.DEFINE_string('config_name', 'qwen3_30b_a3b',
                              'A module of configs/.')
_EP = flags.DEFINE_integer('ep', 64, 'EP group (simulated devices).')
_FSDP = flags.DEFINE_enum(
    'fsdp_axes', 'data+expert', ['data+expert', 'none'],
    'Non-expert state split over every device (parallel.fsdp_axes='
    "'data+expert'), or replicated ('none').")
_LAYERS = flags.DEFINE_list('compile_layers', ['2', '4', '8'],
                            'Depths whose compile times are reported.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  report = memory_report.MemoryReport(
      config=_CONFIG.value, ep=_EP.value,
      fsdp_axes='' if _FSDP.value == 'none' else _FSDP.value,
      compile_layers=tuple(int(x) for x in _LAYERS.value))
  run = print_run_info({'bench': 'memory_report',
                        **dataclasses.asdict(report)})
  result = memory_report.run(report, log=common.progress(_JSON.value))
  common.finish('memory_report', run, result)


if __name__ == '__main__':
  app.run(main)
