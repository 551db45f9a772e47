"""Checkpointer saves without keeping tensorstore's metric dicts alive."""
import gc
import os
import tracemalloc

import jax
import numpy as np
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils

from foremoe_jax.rl import checkpoint


def _dict_form_bytes(suffix):
  """The counters summed from the dict form (orbax's own reader's way)."""
  return sum(v['value'] for m in ts.experimental_collect_matching_metrics(
      '/tensorstore/kvstore/') if m['name'].endswith(suffix)
             for v in m['values'])


def test_checkpointer_reads_the_same_byte_counts_as_the_dict_form(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  assert tensorstore_utils.get_tensorstore_raw_bytes is (
      checkpoint._raw_bytes_without_leak)
  before = checkpoint._raw_bytes_without_leak('write')
  # Random float32 barely compresses (zstd): most of its bytes are written.
  w_NM = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
  ckpt.save(1, {'w': jax.numpy.asarray(w_NM)}, phase='rl')
  restored = ckpt.restore(1, {'params': {'w': jax.numpy.zeros((64, 64))}})
  np.testing.assert_array_equal(restored['params']['w'], w_NM)
  assert checkpoint._raw_bytes_without_leak('write') - before >= (
      0.9 * w_NM.nbytes)
  for direction, suffix in (('write', '/bytes_written'),
                            ('read', '/bytes_read')):
    assert checkpoint._raw_bytes_without_leak(direction) == (
        _dict_form_bytes(suffix)) > 0


def test_reading_the_byte_counts_keeps_no_python_objects(tmp_path):
  checkpoint.Checkpointer(str(tmp_path)).save(
      1, {'w': jax.numpy.ones((8,))}, phase='rl')  # Counters exist now.
  checkpoint._raw_bytes_without_leak('write')
  gc.collect()
  tracemalloc.start()
  try:
    for _ in range(300):
      checkpoint._raw_bytes_without_leak('write')
    gc.collect()
    kept, _ = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  # The dict form keeps every key and value: ~7 kB a call here, 2 MB.
  assert kept < 20_000, kept
  assert os.path.isdir(tmp_path / '1')
