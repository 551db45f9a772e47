"""What a benchmark or experiment ran on: versions, devices, host.

Every entry point prints this first, so a number is never quoted without the
setup that produced it.
"""
from __future__ import annotations

import json
import os
import platform
import sys


def run_info(extra: dict | None = None) -> dict:
  """Versions, devices and host facts, plus any caller-given config."""
  info = {'python': sys.version.split()[0], 'host': platform.node(),
          'cpu_count': os.cpu_count(),
          'xla_flags': os.environ.get('XLA_FLAGS', '')}
  try:
    import numpy
    info['numpy'] = numpy.__version__
  except ImportError:
    pass
  if 'jax' in sys.modules or extra is None or extra.get('uses_jax', True):
    try:
      import jax
      import flax
      info.update(jax=jax.__version__, flax=flax.__version__,
                  backend=jax.default_backend(), devices=jax.device_count(),
                  device_kind=jax.devices()[0].device_kind,
                  # Several processes (experiments.launch, a cluster) hold
                  # `devices` together, `local_devices` each.
                  processes=jax.process_count(),
                  local_devices=jax.local_device_count())
    except ImportError:
      pass
  if extra:
    info.update({k: v for k, v in extra.items() if k != 'uses_jax'})
  return info


def print_run_info(extra: dict | None = None) -> dict:
  info = run_info(extra)
  print('# run: ' + json.dumps(info, default=str), flush=True)
  return info
