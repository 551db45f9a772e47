"""glibc's heap, handed back: `host_memory.trim` after a checkpoint save."""
import ctypes

import jax.numpy as jnp
import numpy as np

from foremoe_jax.benchmarks import soak
from foremoe_jax.rl import checkpoint
from foremoe_jax.utils import host_memory


def test_trim_returns_freed_heap_pages_below_a_live_block():
  libc = ctypes.CDLL('libc.so.6')
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = (ctypes.c_size_t,)
  libc.free.argtypes = (ctypes.c_void_p,)
  n, size = 8192, 4096  # 32 MiB in blocks under the mmap threshold: heap.
  blocks = [libc.malloc(size) for _ in range(n)]
  for b in blocks:
    ctypes.memset(b, 1, size)  # Touch them: resident.
  for b in blocks[:-1]:  # The last one pins the heap's top: no auto-trim.
    libc.free(b)
  before = soak.rss_bytes()
  assert host_memory.trim()
  released = before - soak.rss_bytes()
  libc.free(blocks[-1])
  assert released > 0.5 * n * size, released


def test_every_save_trims_and_the_checkpoint_restores_the_same(
    tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(host_memory, 'trim', lambda: calls.append(1) or True)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  w_NM = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)
  for step in (1, 2):
    ckpt.save(step, {'w': jnp.asarray(w_NM * step)}, phase='rl')
  assert len(calls) == 2
  r = ckpt.restore(2, {'params': {'w': jnp.zeros((16, 8))}})
  np.testing.assert_array_equal(r['params']['w'], w_NM * 2)
