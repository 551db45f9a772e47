"""`make gpu-rehearsal` (tests/gpu_rehearsal.py) on a test file of its own:
a kernel asked for the GPU runs in interpret mode with the GPU's own code
(a masked row store, an f32 dot at TF32x3, which XLA:CPU refuses), is
recorded at the shapes it ran with, and is compiled for an H100; a kernel
Triton cannot compile fails the rehearsal though its test passed."""
import os
import subprocess
import sys

import pytest

from foremoe_jax.utils import results
from pallas_kernels.msa import gpu_static

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_TESTS = '''
import functools
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa import kernel_common as kc


def _scatter_rows(dst_ref, x_ref, w_ref, zeros_ref, y_ref):
  # y[dst[r]] = x[r] @ w for rows with dst < num rows; the others write
  # nothing (their lanes masked, pointed past the last row). y starts as
  # the zeros it aliases.
  del zeros_ref
  y = jnp.dot(x_ref[...], w_ref[...],
              precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
              preferred_element_type=jnp.float32)
  dst = dst_ref[...]
  ok = dst < y_ref.shape[0]
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, 16), 1)
  plgpu.store(y_ref.at[jnp.where(ok, dst, y_ref.shape[0])[:, None], cols],
              y, mask=ok[:, None])


def scatter_rows(dst, x, w, zeros, interpret, block=16):
  rows = zeros.shape[0]
  return kc.pallas_call(
      _scatter_rows,
      grid=(x.shape[0] // block,),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,)),
                pl.BlockSpec((block, 16), lambda i: (i, 0)),
                pl.BlockSpec((16, 16), lambda i: (0, 0)),
                pl.BlockSpec((rows, 16), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((rows, 16), lambda i: (0, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, 16), jnp.float32),
      input_output_aliases={3: 0},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret)(dst, x, w, zeros)


def _case(n=32, rows=24):
  rng = np.random.default_rng(0)
  # Rows 0..23 once each, in a shuffled order; 8 rows go nowhere (24).
  dst = rng.permutation(np.r_[np.arange(rows), np.full(n - rows, rows)])
  x = rng.normal(size=(n, 16)).astype(np.float32)
  w = rng.normal(size=(16, 16)).astype(np.float32)
  want = np.zeros((rows, 16), np.float32)
  live = dst < rows
  want[dst[live]] = x[live] @ w
  return jnp.asarray(dst, jnp.int32), x, w, want


def test_rows_land_where_sent():
  dst, x, w, want = _case()
  got = jax.jit(functools.partial(scatter_rows, interpret=False))(
      dst, x, w, jnp.zeros((24, 16), jnp.float32))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rows_land_where_sent_by_the_platform_rule_in_a_shard_map():
  # What a GPU compile picks (the cuda branch; the default here would
  # write no row), inside a shard_map that checks varying axes.
  dst, x, w, want = _case()
  mesh = jax.sharding.Mesh(jax.devices()[:1], ('x',))
  spec = jax.sharding.PartitionSpec('x')

  def per_device(*args):
    return jax.lax.platform_dependent(
        *args, cuda=functools.partial(scatter_rows, interpret=False),
        default=lambda dst, x, w, zeros: zeros)

  got = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec,
                              out_specs=spec))(
      dst, x, w, jnp.zeros((24, 16), jnp.float32))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_triton_refuses_a_block_of_24_rows():
  dst, x, w, want = _case(n=48)
  want = np.zeros((24, 16), np.float32)
  live = np.asarray(dst) < 24
  want[np.asarray(dst)[live]] = x[live] @ w
  got = jax.jit(functools.partial(scatter_rows, block=24,
                                  interpret=False))(
      dst, x, w, jnp.zeros((24, 16), jnp.float32))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
'''


def _rehearse(tmp_path, select=None):
  (tmp_path / 'test_kernels_gpu.py').write_text(_TESTS)
  env = dict(os.environ, FOREMOE_GPU_REHEARSAL='1',
             FOREMOE_GPU_REHEARSAL_DIR=str(tmp_path),
             PYTHONPATH=os.pathsep.join([HERE, ROOT]))
  proc = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
       '-p', 'gpu_rehearsal', '--rootdir', str(tmp_path),
       *([] if select is None else ['-k', select]), str(tmp_path)],
      capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
  record = results.load('gpu_rehearsal', str(tmp_path))
  assert record['command'] == 'make gpu-rehearsal'
  assert record['run']['target'] == 'sm_90a (H100)'
  return proc, record['result']


@pytest.fixture(scope='module', autouse=True)
def _needs_triton():
  if gpu_static.triton_version() is None:
    pytest.skip("the triton package is missing: pip install -e "
                "'.[gpu-static]'")


def test_a_gpu_kernel_runs_its_gpu_code_and_is_compiled_for_an_h100(
    tmp_path):
  proc, out = _rehearse(tmp_path, select='land')
  log = proc.stdout[-3000:] + proc.stderr[-3000:]
  assert proc.returncode == 0, log
  assert {k.rsplit('::', 1)[1]: v for k, v in out['tests'].items()} == {
      'test_rows_land_where_sent': {'outcome': 'passed',
                                    'kernel_launches': 1},
      'test_rows_land_where_sent_by_the_platform_rule_in_a_shard_map': {
          'outcome': 'passed', 'kernel_launches': 1}}
  # One kernel: the same jaxpr, shapes and launch in both tests.
  (row,) = out['rows']
  # Recorded at the shapes it ran with, compiled by Triton for sm_90a.
  assert row['site'].startswith('_scatter_rows(int32[32], float32[32,16], '
                                'float32[16,16], float32[24,16])'), row
  assert row['grid'] == [2, 1, 1] and row['num_warps'] == 4, row
  assert row['fits_shared'] and row['registers'] > 0, row
  assert row['tests'] == sorted(out['tests'])
  assert out['summary']['errors'] == [] and out['summary']['kernels'] == 1
  assert 'distinct kernels compiled for sm_90a' in proc.stdout


def test_a_kernel_triton_cannot_compile_fails_the_rehearsal(tmp_path):
  # Its test passes in interpret mode; on a GPU it could not launch.
  proc, out = _rehearse(tmp_path)
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert {k.rsplit('::', 1)[1]: v['outcome']
          for k, v in out['tests'].items()}[
              'test_triton_refuses_a_block_of_24_rows'] == 'passed'
  (error,) = out['summary']['errors']
  assert error.startswith('_scatter_rows(int32[48]'), error
