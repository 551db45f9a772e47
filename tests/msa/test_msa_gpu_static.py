"""The static GPU check: the MSA kernels compiled for an H100 on a CPU host.

Needs the `triton` package (in the test extra), not a GPU. The checks are
against what does not depend on this tool: the CUDA occupancy rules worked
by hand, tensor-core facts of Triton on Hopper (a warpgroup MMA needs 64
rows), and a kernel tiling that the H100 refused (the f32 dK/dV kernel
over whole key blocks: results/gpu_check_h100.json's failures were of
this kind) against the tiling that replaced it.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa import benchmark_gpu
from pallas_kernels.msa import gpu_static
from pallas_kernels.msa import index_kernel
from pallas_kernels.msa import kv_outer

pytest.importorskip('triton')
S = jax.ShapeDtypeStruct
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def test_occupancy_follows_the_cuda_rules_worked_by_hand():
  # 255 registers: 8160 a warp, allocated in units of 256: 8192; 8 warps
  # take all 65536 of an SM. 164356 + 1024 B of 233472: one block.
  occ = gpu_static.occupancy(255, 164356, 8)
  assert occ['by']['registers'] == 1 and occ['by']['shared_memory'] == 1
  assert occ['blocks_per_sm'] == 1 and occ['warps_per_sm'] == 8
  assert occ['limited_by'] == ['registers', 'shared_memory']
  # 128 registers x 32 = 4096 a warp, 16384 a 4-warp block: 4 blocks;
  # shared memory would allow 233472 // (40960 + 1024) = 5.
  occ = gpu_static.occupancy(128, 40960, 4)
  assert occ['by'] == {'registers': 4, 'shared_memory': 5, 'warps': 16,
                       'blocks': 32}
  assert occ['blocks_per_sm'] == 4 and occ['limited_by'] == ['registers']
  # One byte past the 227 KiB a block may ask for: it cannot launch.
  occ = gpu_static.occupancy(32, 232448 + 1, 4)
  assert occ['blocks_per_sm'] == 0 and occ['limited_by'] == ['shared_memory']
  assert gpu_static.occupancy(32, 232448, 4)['blocks_per_sm'] == 1


def test_ptxas_and_sass_are_read_as_printed():
  usage = gpu_static.ptxas_usage(
      "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
      'ptxas info    : Function properties for k\n'
      '    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n'
      'ptxas info    : Used 168 registers, used 1 barriers\n')
  assert usage == {'registers': 168, 'spill_store_bytes': 8,
                   'spill_load_bytes': 12, 'stack_bytes': 16}
  with pytest.raises(ValueError, match='no usage line'):
    gpu_static.ptxas_usage('ptxas fatal: unknown')
  ops = gpu_static.sass_opcodes(
      '        /*0a40*/                   HGMMA.64x128x16.F32.BF16 gdesc[UR4], RZ ;\n'
      '        /*0a50*/              @!P0 LDL.64 R2, [R1+0x8] ;\n'
      '        /*0a60*/               @P1 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n'
      '        /*0a70*/                   HGMMA.64x128x16.F32.BF16 gdesc[UR8], RZ ;\n')
  assert ops == {'HGMMA': 2, 'LDL': 1, 'HMMA': 1}


def _dot_kernel(rows: int):
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jax.lax.dot_general(
        a_ref[...], b_ref[...], (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)
  return pl.pallas_call(
      kernel, out_shape=S((rows, 128), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name=f'dot{rows}')


@pytest.mark.parametrize('rows, wgmma', [(64, True), (16, False)])
def test_a_bf16_dot_takes_the_warpgroup_mma_from_64_rows(rows, wgmma):
  call = _dot_kernel(rows)
  args = S((rows, 128), jnp.bfloat16), S((128, 128), jnp.bfloat16)
  kernels = gpu_static.triton_kernels(call, *args)
  assert [(k.name, k.num_warps, k.num_stages, k.grid) for k in kernels] == [
      (f'dot{rows}', 4, 1, (1, 1, 1))]
  # Asked again for the same function, jax's lowering cache must not hide
  # it.
  assert gpu_static.triton_kernels(call, *args) == kernels
  ops = gpu_static.compile_sm90(kernels[0])['opcodes']
  assert (ops['HGMMA'] > 0) == wgmma and (ops['HMMA'] > 0) == (not wgmma)


def test_fp8_dots_reach_fp8_tensor_cores_with_the_lowering_fix(monkeypatch):
  # jax's lowering alone: Triton turns the fp8 operands into f16 and runs
  # mma.sync. With index_kernel's fix (Triton's own Hopper default for
  # fp8 dots): a warpgroup MMA on fp8 (QGMMA). Other dots: same module.
  from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
  raw = getattr(lowering.tt_dialect, '_dialect', lowering.tt_dialect)
  f8, bf16 = jnp.float8_e4m3fn, jnp.bfloat16

  def kernel(dtype):
    (k,) = gpu_static.triton_kernels(_dot_kernel(64), S((64, 128), dtype),
                                     S((128, 128), dtype))
    return k

  monkeypatch.setattr(lowering, 'tt_dialect', raw)
  plain_f8, plain_bf16 = kernel(f8), kernel(bf16)
  ops = gpu_static.compile_sm90(plain_f8)['opcodes']
  assert ops['HMMA'] > 0 and ops['QGMMA'] == 0 and ops['HGMMA'] == 0
  assert index_kernel.fp8_dots_on_tensor_cores()
  assert index_kernel.fp8_dots_on_tensor_cores()  # once: no second wrap
  assert lowering.tt_dialect._dialect is raw  # pylint: disable=protected-access
  fixed_f8 = kernel(f8)
  assert 'maxNumImpreciseAcc' in fixed_f8.ttir
  ops = gpu_static.compile_sm90(fixed_f8)['opcodes']
  assert ops['QGMMA'] > 0 and ops['HMMA'] == 0
  assert kernel(bf16).ttir == plain_bf16.ttir


# The bench's shapes, prefill at a shorter length (the kernels' code does
# not depend on it), decode at its 128k cache and batch 2. The tests
# below share kernels (compile_sm90 compiles each once a process).
CFG = benchmark_gpu.GPUBench(tune_len=4096, decode_batch=2)
F32_LEN = 1024


def _f32_dkv_kernels():
  # The dK/dV kernel itself at gpu-check's f32 site (its tiles' shared
  # memory depends on the block size and head dim, 128 each, not on the
  # groups or top-k), whose default tiling the test below compiles too;
  # the per-block sum launch after it is tiny.
  fn, args = gpu_static.msa_sites(CFG, f32_len=F32_LEN)['f32 bwd_dkv']
  return [kern for kern in gpu_static.triton_kernels(fn, *args)
          if kern.name == 'msa_kv_outer_dkv']


def test_the_f32_dkv_tiling_the_h100_refused_is_caught(monkeypatch):
  # Whole key blocks: K and V as TF32 high and low halves alone are
  # 4 x 64 KiB, past the 227 KiB of a block.
  monkeypatch.setattr(kv_outer, '_dkv_tiling', lambda *a: (2, 1))
  (whole,) = _f32_dkv_kernels()
  report = gpu_static.compile_sm90(whole)
  assert report['shared_bytes'] > 4 * 64 * 1024
  assert not report['fits_shared']
  assert report['occupancy']['blocks_per_sm'] == 0
  monkeypatch.undo()
  (parts,) = _f32_dkv_kernels()
  assert parts.digest != whole.digest
  assert gpu_static.compile_sm90(parts)['fits_shared']


def test_every_kernel_gpu_check_runs_fits_an_h100():
  # Without the forward's tune variants (the experiment compiles those
  # too).
  sites = {name: site for name, site in gpu_static.msa_sites(
      CFG, f32_len=F32_LEN).items() if '[' not in name}
  rows = gpu_static.report(sites)
  summary = gpu_static.summary(rows)
  assert summary['errors'] == [] and summary['over_shared_memory'] == []
  by_site = {}
  for row in rows:
    by_site.setdefault(row['site'], []).append(row)
  assert {r['kernel'] for r in by_site['main']} == {'msa_kv_outer_forward'}
  assert {r['kernel'] for r in by_site['index']} == {'msa_index_scores',
                                                     'msa_index_topk'}
  # The bf16 prefill dots are warpgroup MMAs, and the forward holds its
  # 128-row tiles in registers without spilling.
  for site, kernel in (('index', 'msa_index_scores'),
                       ('main', 'msa_kv_outer_forward'),
                       ('bwd_dkv', 'msa_kv_outer_dkv')):
    (r,) = [r for r in by_site[site] if r['kernel'] == kernel]
    assert r['opcodes']['HGMMA'] > 0 and r['opcodes']['HMMA'] == 0, site
  # fp8 index scores on fp8 warpgroup MMAs (index_kernel's lowering fix).
  (fp8,) = [r for r in by_site['index_fp8']
            if r['kernel'] == 'msa_index_scores']
  assert fp8['opcodes']['QGMMA'] > 0 and fp8['opcodes']['HMMA'] == 0
  (main,) = by_site['main']
  assert main['spill_store_bytes'] == 0
  # dK/dV in two key parts: twice the programs, and (the reason the bench
  # times it) fewer registers spilled than over whole blocks.
  (dkv,), (dkv2,) = ([r for r in by_site[site]
                      if r['kernel'] == 'msa_kv_outer_dkv']
                     for site in ('bwd_dkv', 'bwd_dkv_parts2'))
  assert dkv2['grid'][2] == 2 * dkv['grid'][2]
  assert dkv2['spill_store_bytes'] < dkv['spill_store_bytes']
  assert main['launches'] == 1 and main['grid'][:2] == [1, CFG.groups]
  # The dK/dV per-block sums: one launch, no spill (it replaced an XLA
  # loop of data-dependent trip count, a host sync per step on a GPU).
  (total,) = [r for r in by_site['bwd_dkv']
              if r['kernel'] == 'msa_kv_outer_dkv_sum']
  assert total['launches'] == 1 and total['spill_store_bytes'] == 0
  # Decode: the selection's two launches, the split-K kernel that reads the
  # selection itself (a program per sequence, group and slot; no spill)
  # and the merge.
  assert {r['kernel'] for r in by_site['decode']} == {
      'msa_index_scores', 'msa_index_topk', 'msa_kv_outer_decode',
      'msa_kv_outer_combine'}
  (dec,) = [r for r in by_site['decode']
            if r['kernel'] == 'msa_kv_outer_decode']
  assert dec['grid'] == [CFG.decode_batch, CFG.groups, CFG.top_k]
  assert dec['spill_store_bytes'] == 0


def test_the_moe_grouped_matmul_fits_an_h100_on_warpgroup_mmas():
  rows = gpu_static.report(gpu_static.grouped_matmul_sites())
  summary = gpu_static.summary(rows)
  assert summary['errors'] == [] and summary['over_shared_memory'] == []
  assert summary['spilling'] == []
  # The forward, the VJP's dx (w read transposed) and dw: three kernels.
  assert {r['kernel'] for r in rows} == {'grouped_tile_matmul',
                                         'grouped_tile_matmul_t',
                                         'grouped_slot_matmul_t'}
  for r in rows:
    if not r['site'].startswith('f32'):
      assert r['opcodes']['HGMMA'] > 0 and r['opcodes']['HMMA'] == 0, r


def test_decode_topk_takes_only_the_real_rows():
  # At the bench's 128k cache (1,024 blocks) a top-k tile holds [1024, w]
  # scores in registers: w = the G = 4 real rows, one program a sequence.
  # A tile of 8 of the score tile's 16 rows took twice the programs, half
  # on padding, and spilled.
  site = gpu_static.msa_sites(CFG)['decode']
  (topk,) = [kern for kern in gpu_static.triton_kernels(site[0], *site[1])
             if kern.name == 'msa_index_topk']
  assert topk.grid[:2] == (2, 1)
  report = gpu_static.compile_sm90(topk)
  assert report['spill_store_bytes'] == 0


def test_the_entry_point_prints_one_json_line_and_saves_it(tmp_path):
  # One site, the per-token forward: a fast compile.
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.gpu_static', '--json',
       '--sites=main_token', f'--results_dir={tmp_path}'],
      cwd=ROOT, capture_output=True, text=True, check=True,
      env=os.environ).stdout.splitlines()
  assert out[0].startswith('# run: ') and '"triton": "3.6' in out[0]
  result = json.loads(out[-1])
  assert [r['site'] for r in result['rows']] == ['main_token']
  assert result['rows'][0]['kernel'] == 'msa_forward_gpu'
  assert result['summary']['kernels'] == 1
  saved = json.loads((tmp_path / 'gpu_static.json').read_text())
  assert saved['result'] == result
  assert saved['command'].startswith('python -m experiments.gpu_static')
  # A part of the sites with no --results_dir is not saved: it would
  # replace the committed file, all sites, with one.
  here = tmp_path / 'elsewhere'
  here.mkdir()
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.gpu_static', '--json',
       '--sites=main_token'], cwd=here, capture_output=True, text=True,
      check=True, env=env).stdout.splitlines()
  assert '# not saved: a part of gpu_static' in out[-2]
  assert json.loads(out[-1])['rows'][0]['kernel'] == 'msa_forward_gpu'
  assert not (here / 'results').exists()
