"""Public MSA API: dispatch, agreement of the impls, clear errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels import msa


def test_auto_is_the_xla_path_on_cpu():
  assert msa.resolve_impl('auto') == ('xla', 'tpu', True)
  assert msa.resolve_impl('pallas', 'gpu') == ('pallas', 'gpu', True)


def test_all_impls_agree_through_the_api():
  b, t, s, g, r, d, di, c, k, o = 1, 24, 40, 2, 2, 16, 8, 8, 3, 16
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  kw = dict(block_size=c, top_k=k, q_offset=o)
  results = {impl: jax.jit(functools.partial(
      msa.msa_attention, impl=impl, **kw))(q, kk, v, qi, ki)
             for impl in ('reference', 'xla', 'pallas')}
  want, want_aux = results.pop('reference')
  want_kl = msa.msa_indexer_kl_loss(q, kk, qi, ki, want_aux, block_size=c,
                                    q_offset=o, impl='reference')
  for impl, (out, aux) in results.items():
    lib.assert_close(out, want, 1e-5, impl)
    np.testing.assert_array_equal(lib.as_sets(aux['sel_BGTK']),
                                  lib.as_sets(want_aux['sel_BGTK']))
    kl = jax.jit(functools.partial(
        msa.msa_indexer_kl_loss, block_size=c, q_offset=o, impl=impl))(
            q, kk, qi, ki, aux)
    lib.assert_close(kl, want_kl, 1e-5, f'{impl} kl')
  lengths = jnp.array([29])
  dec = {impl: jax.jit(functools.partial(
      msa.msa_decode, block_size=c, top_k=k, impl=impl))(
          q[:, 0], kk, v, qi[:, 0], ki, lengths)
         for impl in ('reference', 'xla')}
  lib.assert_close(dec['xla'][0], dec['reference'][0], 1e-5, 'decode')


def test_config_names_every_gpu_kernel_set():
  from foremoe_jax import config as config_lib
  assert config_lib.MSA_GPU_KERNELS == msa.GPU_KERNELS


@pytest.mark.parametrize('gpu_kernels', msa.GPU_KERNELS)
def test_every_gpu_kernel_set_through_the_api(gpu_kernels):
  # Prefill and decode on the GPU backend (interpret mode here) with each
  # kernel set, against the reference.
  b, t, s, g, r, d, di, c, k, o = 1, 24, 48, 2, 2, 16, 8, 16, 2, 24
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  kw = dict(block_size=c, top_k=k)
  # Jitted: interpret-mode kernels run eagerly op by op (3x slower here).
  out, aux = jax.jit(functools.partial(
      msa.msa_attention, q_offset=o, impl='pallas', pallas_backend='gpu',
      gpu_kernels=gpu_kernels, **kw))(q, kk, v, qi, ki)
  want, want_aux = msa.msa_attention(q, kk, v, qi, ki, q_offset=o,
                                     impl='reference', **kw)
  lib.assert_close(out, want, 1e-5, gpu_kernels)
  np.testing.assert_array_equal(aux['sel_BGTK'], want_aux['sel_BGTK'])
  lengths = jnp.array([37])
  dec = jax.jit(functools.partial(
      msa.msa_decode, impl='pallas', pallas_backend='gpu',
      gpu_kernels=gpu_kernels, **kw))(q[:, 0], kk, v, qi[:, 0], ki, lengths)
  dec_want = msa.msa_decode(q[:, 0], kk, v, qi[:, 0], ki, lengths,
                            impl='reference', **kw)
  lib.assert_close(dec[0], dec_want[0], 1e-5, f'{gpu_kernels} decode')


def _inputs():
  return lib.make_inputs(1, 16, 16, 2, 2, 16, 8)[:5]


@pytest.mark.parametrize('kwargs,match', [
    (dict(q_offset=1), 'q_offset'),
    (dict(q_offset=-1), 'q_offset'),
    (dict(top_k=0), 'top_k'),
    (dict(block_size=0), 'block_size'),
    (dict(impl='cuda'), 'impl'),
    (dict(impl='pallas', pallas_backend='gpu', block_size=24), 'power-of-two'),
    (dict(impl='pallas', pallas_backend='gpu', block_size=16,
          gpu_kernels='flash'), 'gpu_kernels'),
])
def test_bad_arguments_are_rejected_clearly(kwargs, match):
  args = dict(block_size=8, top_k=2)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    msa.msa_attention(*_inputs(), **args)


def test_mismatched_shapes_are_rejected_clearly():
  q, k, v, qi, ki = _inputs()
  with pytest.raises(ValueError, match='H divisible by G'):
    msa.msa_attention(q[:, :, :3], k, v, qi, ki, block_size=8, top_k=2)
  with pytest.raises(ValueError, match='qi'):
    msa.msa_attention(q, k, v, qi[:, :, :1], ki, block_size=8, top_k=2)
  with pytest.raises(ValueError, match='lengths_B'):
    msa.msa_decode(q[:, 0], k, v, qi[:, 0], ki, jnp.array([3, 4]),
                   block_size=8, top_k=2)


def test_lse_output_carries_gradient_on_the_kernel_path():
  # The custom_vjp honours a cotangent on lse (d lse / d s = p).
  q, k, v, qi, ki = _inputs()
  f = lambda impl: jax.jit(jax.grad(lambda q: msa.msa_attention(
      q, k, v, qi, ki, block_size=8, top_k=2, impl=impl)[1]['lse_BTH'].sum()))(q)
  lib.assert_close(f('pallas'), f('reference'), 1e-5)
