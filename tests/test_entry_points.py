"""Entry points run as users run them: absl flags and --config.* overrides."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rl_train_cli_applies_config_overrides(tmp_path):
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'experiments.rl_train',
         '--config=configs/tiny.py', f'--workdir={workdir}',
         '--config.warmstart.steps=5', '--config.rl.steps=2',
         '--config.rl.prompts_per_step=8', '--config.eval_prompts=0',
         '--config.planner.method=eplb_step', '--config.task=sort']
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-3000:]
  assert '# run:' in out.stdout  # The setup is printed first.
  records = [json.loads(l) for l in open(workdir / 'metrics.jsonl')]
  assert [r['step'] for r in records] == [1, 2]
  assert all(r['planner'] == 'eplb_step' for r in records)
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary['reward_first'] is not None


def test_bad_override_fails_with_the_rule():
  cmd = [sys.executable, '-m', 'experiments.rl_train',
         '--config=configs/tiny.py', '--workdir=/tmp/unused',
         '--config.model.top_k=99']
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode != 0
  assert 'model.top_k: top_k (99) must be <= num_experts (8)' in out.stderr


def test_benchmark_writes_its_results_file_and_the_renderer_reads_it(tmp_path):
  cmd = [sys.executable, '-m', 'experiments.bench_planner', '--json',
         '--layers=1', '--no_milp', '--sampled_traces=false',
         f'--results_dir={tmp_path}']
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-3000:]
  record = json.load(open(tmp_path / 'bench_planner.json'))
  # The file holds exactly the printed result, the command and the setup.
  assert record['result'] == json.loads(out.stdout.strip().splitlines()[-1])
  assert record['command'] == ('python -m experiments.bench_planner --json '
                               f'--layers=1 --no_milp --sampled_traces=false '
                               f'--results_dir={tmp_path}')
  assert record['run']['bench'] == 'planner'
  from experiments import render_results  # pylint: disable=g-import-not-at-top
  block = render_results.render_block('bench_planner', str(tmp_path))
  assert record['command'] in block
  for c in record['result']['configs']:
    assert c['name'] in block
