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
environment, which must be set before the process starts. jemalloc through
LD_PRELOAD (what MaxText suggests on TPU hosts; `experiments.soak` says how
to get it without root) was measured too, over 2,000 steps of
configs/tiny.py: a lower RSS (~0.88 GiB against ~1.22 GiB) and faster steps
(0.26 s against 0.42 s), but no flatter: it grew from 787 to 891 MiB after
the warm-up, and its purges move RSS by hundreds of MiB at a time.

`trim` hands freed heap pages back after a burst such as a checkpoint save.
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


def trim() -> bool:
  """Hands the free pages of every glibc malloc arena back to the system
  (`malloc_trim(0)`); False where the C library is not glibc.

  Freed memory inside a heap stays resident until glibc trims it, and on
  its own it trims only a heap's top. A checkpoint save allocates and frees
  host copies of the whole state (orbax, tensorstore), and whatever of that
  sits below a live block counts as RSS until a later allocation reuses it.
  """
  name = ctypes.util.find_library('c')
  try:
    malloc_trim = ctypes.CDLL(name or 'libc.so.6').malloc_trim
  except (OSError, AttributeError):
    return False
  malloc_trim.argtypes = (ctypes.c_size_t,)
  malloc_trim(0)
  return True

