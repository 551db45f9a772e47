"""`make gpu-check`'s shell plumbing, dry-run on CPU (DRY_RUN=1): the gpu
tests skip, the bench runs at toy shapes in interpret mode, and the one
JSON summary is written whatever the time budget leaves, so a rented GPU
never meets a broken script (scripts/gpu_check.sh)."""
import glob
import json
import os
import subprocess
import sys

from experiments import render_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  proc, out = _run(tmp_path, budget=400)
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
