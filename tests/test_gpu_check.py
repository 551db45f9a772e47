"""`make gpu-check`'s shell plumbing, dry-run on CPU (DRY_RUN=1): the gpu
tests skip, the bench runs at toy shapes in interpret mode, and the one
JSON summary is written whatever the time budget leaves, so a rented GPU
never meets a broken script (scripts/gpu_check.sh)."""
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
  proc, out = _run(tmp_path, budget=400)
  bench = out['bench_msa']
  assert bench.get('complete'), proc.stdout[-3000:] + proc.stderr[-3000:]
  assert out['tests']['skipped'] > 0 and out['tests']['failed'] == 0
  assert out['tests_rc'] == 0 and out['bench_rc'] == 0
  # No GPU test ran, so it is not a pass; the docs' table renders it.
  assert out['gpu_check'] == 'fail' and proc.returncode == 1
  text = render_results.render_gpu_check(str(tmp_path), 'gpu_check_dry')
  assert '| 128 |' in text


def test_a_spent_budget_still_writes_the_summary(tmp_path):
  # No budget left for the bench: its soft deadline is already past, so
  # it measures nothing, says so, and the summary is written.
  _, out = _run(tmp_path, budget=0)
  assert out['gpu_check'] == 'fail'
  bench = out['bench_msa']
  assert not bench['complete']
  assert all(r.get('skipped') == 'deadline'
             for r in [bench['ceilings'], *bench['results'], *bench['decode']])
