"""`make gpu-check`'s shell plumbing, dry-run on CPU (DRY_RUN=1): the gpu
tests skip, the bench runs at toy shapes in interpret mode, and the one
JSON summary is written whatever the time budget leaves, so a rented GPU
never meets a broken script (scripts/gpu_check.sh). The dry run's bench is
also where every phase of the GPU bench is checked to run and report
(tests/msa/test_msa_bench_gpu.py tests the rest of its code)."""
import glob
import json
import os
import subprocess
import sys

import pytest

from experiments import render_results
from pallas_kernels.msa import benchmark_gpu as bg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What bench_msa --dry_run runs: benchmark_gpu.run at these shapes.
DRY = bg.GPUBench(**bg.DRY_RUN)


def _run(tmp_path, budget: int):
  env = dict(os.environ, DRY_RUN='1', BUDGET=str(budget),
             PYTHON=sys.executable, LOGDIR=str(tmp_path),
             RESULTS=str(tmp_path / 'gpu_check_dry.json'))
  proc = subprocess.run(['bash', 'scripts/gpu_check.sh'], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  with open(tmp_path / 'gpu_check_dry.json') as f:
    return proc, json.load(f)


def test_dry_run_writes_a_complete_summary(tmp_path):
  measured = os.path.join(ROOT, 'results', 'bench_msa_gpu.json')
  before = open(measured).read() if os.path.exists(measured) else None
  # BUDGET 500: the bench may start phases for 500 - 200 (the tests' share)
  # - 75 = 225 s. Its toy shapes took 62 s on an idle 2-core host (the
  # bench alone, under the suite's XLA flags): at 400 (125 s) a host 2x
  # slower (a loaded CI machine) sat at the limit of skipping phases.
  proc, out = _run(tmp_path, budget=500)
  # The dry run's toy bench lands beside its logs, never over a GPU's
  # measurement in results/.
  assert (tmp_path / 'bench_msa_gpu.json').exists()
  assert (open(measured).read() if os.path.exists(measured)
          else None) == before
  bench = out['bench_msa']
  assert bench.get('complete'), proc.stdout[-3000:] + proc.stderr[-3000:]
  assert out['tests']['skipped'] > 0 and out['tests']['failed'] == 0
  assert out['tests_rc'] == 0 and out['bench_rc'] == 0
  # No GPU test ran, so it is not a pass; the docs' table renders it.
  assert out['gpu_check'] == 'fail' and proc.returncode == 1
  # The grouped-GEMM bench ran in the time the tests left, checked each
  # kind against float32, and landed beside the logs too.
  gemm = out['bench_grouped_gemm']
  assert out['gemm_rc'] == 0 and gemm['complete'], gemm
  assert set(gemm['check']) == {'pallas', 'ragged_dot'}
  assert (tmp_path / 'bench_grouped_gemm_gpu.json').exists()
  text = render_results.render_gpu_check(str(tmp_path), 'gpu_check_dry')
  assert '| 128 |' in text
  assert '| `ragged_dot` |' in text and '2,048 routed rows' in text
  # The bench's rows as it printed them, phase by phase.
  with open(tmp_path / 'bench_msa.log') as f:
    rows = [json.loads(line[len('# row '):]) for line in f
            if line.startswith('# row ')]
  _every_phase_ran_and_reported(bench, rows, text)


def _every_phase_ran_and_reported(out: dict, rows: list[dict], text: str):
  """The dry run's bench (its final JSON, its printed rows and the docs'
  table rendered from the summary) has every phase and every kernel's
  timing. Checked on the dry run's own bench: running the bench a second
  time, in process, would prove the same at the same cost."""
  assert [r['phase'] for r in rows] == ['ceilings', 'check', 'tune',
                                        'prefill', 'decode', 'train',
                                        'profile', 'mosaic']
  assert out['order'] == ['prefill 128', 'decode 128', 'train 128',
                          'profile 128', 'mosaic 128']
  # The Mosaic phase: the score launch timed beside Triton's and equal to
  # it; the forward not run at the dry run's 2 heads a group, and said so.
  mos, = out['mosaic']
  assert mos['index_scores_s'] > 0 and mos['index_scores_mosaic_s'] > 0
  assert mos['index_scores_mosaic_speedup'] > 0 and mos['mosaic_wrong'] == []
  assert '8-row parts' in mos['mosaic_not_applicable']
  assert 'kernel_errors' not in mos
  assert out['reference_check']['selection_margin_violations'] == 0
  assert out['reference_check']['fp8_margin_violations'] == 0
  assert out['reference_check']['max_abs_err'] < 2e-2  # bf16 inputs
  # Every variant timed beside the default, one default per group.
  tune = out['tune']
  assert set(tune['speedup_vs_default']) == {c.label() for c in bg.TUNE}
  assert tune['not_timed'] == [] and tune['wrong'] == []
  assert max(tune['max_abs_diff_vs_default'].values()) <= bg.TUNE_TOLERANCE
  assert len(tune['default_s']) == -(-len(bg.TUNE) // DRY.tune_group)
  pre = out['results'][0]
  for key in ('dense_s', 'msa_s', 'index_s', 'index_fused_s', 'main_s',
              'dense_train_s', 'msa_train_s', 'index_fp8_s', 'msa_fp8_s',
              'bwd_dq_s', 'bwd_dkv_s', 'bwd_dkv_prefetch_s',
              'bwd_dkv_parts2_s', 'main_plan_s', 'main_kernel_s',
              'main_combine_s', 'index_scores_s', 'index_topk_s',
              'main_tiles_s', 'main_shared_s', 'main_tiles_shared_s',
              'bwd_dq_tiles_s', 'bwd_dq_shared_s', 'bwd_dq_tiles_shared_s'):
    assert pre[key] > 0, key
  # Union tiles read between 1 and q_tile blocks per token-slot.
  assert 1 <= pre['tiles_union_per_k'] <= bg._tile_rows(DRY)
  assert set(pre['index_scores_variants']) == {
      bg.index_variant_label(kw) for kw in bg.INDEX_VARIANTS}
  assert pre['index_scores_variants_wrong'] == []
  assert pre['speedup_fp8'] == pytest.approx(
      pre['dense_s'] / pre['msa_fp8_s'], rel=1e-2)
  # The tune's fastest (if it beat the default) is timed in each row.
  assert ('msa_tuned_s' in pre) == ('best' in tune)
  dec = out['decode'][0]
  for key in ('decode_msa_s', 'decode_msa_xla_topk_s', 'decode_index_s',
              'decode_index_xla_topk_s', 'decode_main_s',
              *(f'decode_index_nb{nb}_s'
                for nb in bg.DECODE_BLOCKS_PER_PROGRAM),
              'decode_unaligned_msa_s'):
    assert dec[key] > 0, key
  assert dec['unaligned_cost'] == pytest.approx(
      dec['decode_unaligned_msa_s'] / dec['decode_msa_s'], rel=1e-2)
  assert not dec['decode_best'].startswith('unaligned')
  assert dec['decode_speedup_best'] >= dec['decode_speedup'] * (1 - 1e-5)
  # One traced call of each (a CPU trace here: XLA's threads' ops).
  prof = out['profile']['profiles']
  assert set(prof) == {'prefill 128 msa', 'prefill 128 dense',
                       'decode 128 x2 msa', 'decode 128 x2 dense'}
  for p in prof.values():
    assert p['source'] == 'cpu' and p['calls'] == bg.PROFILE_CALLS
    assert p['kernels'] > 0 and 0 < p['busy_us'] <= p['span_us'] * 1.001
  # The docs' GPU table, rendered from gpu_check_summary.py's summary.
  assert 'flip rate 0' in text, text
  assert 'Not measured' not in text
  assert 'Index score launch at 128 tokens' in text, text
  assert 'The Mosaic GPU kernels (index_mosaic, kv_outer_mosaic)' in text
  assert '128 tokens, not run: the Mosaic KV-outer forward needs' in text
  assert 'Wall time per phase, compiles included: ceilings' in text, text
  assert 'train 128 ' in text.split('Wall time per phase')[1], text
  assert "Where one call's time goes (cpu trace of 3" in text, text
  assert '| decode 128 x2 msa | ' in text, text


def test_a_spent_budget_still_writes_the_summary(tmp_path):
  # No budget left for the bench: its soft deadline is already past, so
  # it measures nothing, says so, and the summary is written.
  _, out = _run(tmp_path, budget=0)
  assert out['gpu_check'] == 'fail'
  bench = out['bench_msa']
  assert not bench['complete']
  assert all(r.get('skipped') == 'deadline'
             for r in [bench['ceilings'], *bench['results'], *bench['decode']])
  assert out['gemm_rc'] is None
  assert 'no time left' in out['bench_grouped_gemm']['skipped']


# What the GPU image lacks of the CPU install (its package list has
# neither): a module the gpu tests import must not need them.
_NOT_ON_GPU_IMAGE = ('grain', 'tensorboardX', 'math_verify')


def test_gpu_tests_are_collected_from_files_the_gpu_image_can_import():
  # The script collects tests/*/*_gpu.py only; every `gpu` test must live
  # in such a file, and those files must import there.
  files = sorted(glob.glob(os.path.join(ROOT, 'tests', '*', '*.py')))
  marked = [f for f in files if 'mark.gpu' in open(f).read()]
  assert marked and all(f.endswith('_gpu.py') for f in marked), marked
  blocker = (
      'import sys\n'
      'class B:\n'
      '  def find_spec(self, name, path=None, target=None):\n'
      f'    if name.split(".")[0] in {_NOT_ON_GPU_IMAGE!r}:\n'
      '      raise ImportError("not on the GPU image: " + name)\n'
      'sys.meta_path.insert(0, B())\n'
      'import pytest\n'
      'sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu",\n'
      '                      "--collect-only", *sys.argv[1:]]))\n')
  gpu_files = sorted(glob.glob(os.path.join(ROOT, 'tests', '*', '*_gpu.py')))
  proc = subprocess.run([sys.executable, '-c', blocker, *gpu_files], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
  n_gpu = sum(open(f).read().count('mark.gpu') for f in marked)
  assert 'collected' in proc.stdout and n_gpu > 0
