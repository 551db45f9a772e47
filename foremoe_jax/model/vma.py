"""Which mesh axes a value differs over, inside a shard_map.

shard_map tracks, per value, the manual mesh axes it varies over; a loop's
carry must keep one such type, and a value that varies gets per-device
gradients (autodiff then sums nothing over those axes).
"""
from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
  """Mesh axes over which `x` differs between devices (inside a shard_map)."""
  aval = jax.typeof(x)
  vma = getattr(aval, 'vma', None)
  if vma is None:
    vma = aval.manual_axis_type.varying
  return frozenset(vma)


def vary(x, axes):
  """`x` marked as differing over `axes` (a no-op for axes it already
  differs over). A value that differs per device gets per-device
  gradients: autodiff then sums nothing over those axes."""
  todo = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, todo, to='varying') if todo else x
