"""Host memory that stays flat over a long run: glibc's mmap threshold.

glibc serves a large allocation with its own mmap, returned to the system
on free, but after such a block is freed it raises that threshold to the
block's size (up to 32 MiB on 64-bit), so later buffers of that size come
from the heap instead. The RL loop allocates and frees multi-MiB host
buffers every step (rollouts, loads, XLA's host transfers); on the heap,
fragmentation keeps some of them resident, and RSS creeps up in steps of a
few MiB, about 0.15 MiB a step on configs/tiny.py (`experiments.soak`).
Pinning the threshold turns the dynamic adjustment off (glibc's documented
effect of setting M_MMAP_THRESHOLD), which removes the creep; the cost is a
fresh mapping per large buffer, which the soak run shows is not measurable
next to a step. The same effect as MALLOC_MMAP_THRESHOLD_=131072 in the
environment, which must be set before the process starts; tcmalloc or
jemalloc through LD_PRELOAD (what MaxText suggests on TPU hosts) avoids the
problem too.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # From glibc's <malloc.h>.
DEFAULT_THRESHOLD = 128 * 1024  # glibc's own starting value.


def pin_mmap_threshold(nbytes: int = DEFAULT_THRESHOLD) -> bool:
  """Fixes glibc's mmap threshold at `nbytes`; False where the C library is
  not glibc (nothing is changed there)."""
  name = ctypes.util.find_library('c')
  try:
    libc = ctypes.CDLL(name or 'libc.so.6')
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  return bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))
