"""Test-wide set-up: 8 simulated CPU devices, set once before jax loads.

Tests marked `gpu` need a CUDA device and run only through
`make gpu-check` (scripts/gpu_check.sh sets JAX_PLATFORMS=cuda, which the
setdefault below leaves alone); anywhere else they are skipped with the
reason, so the CPU suite stays green.
"""
import os

import pytest

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')


def _gpu_missing_reason():
  import jax  # pylint: disable=g-import-not-at-top
  try:
    if jax.default_backend() == 'gpu':
      return None
  except RuntimeError:
    pass
  return ('needs an NVIDIA GPU: run `make gpu-check` (JAX_PLATFORMS=cuda); '
          f'this process has JAX_PLATFORMS={os.environ.get("JAX_PLATFORMS")!r}')


def pytest_collection_modifyitems(config, items):
  del config
  gpu_items = [item for item in items if item.get_closest_marker('gpu')]
  if not gpu_items:
    return
  reason = _gpu_missing_reason()
  if reason:
    for item in gpu_items:
      item.add_marker(pytest.mark.skip(reason=reason))
