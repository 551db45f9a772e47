"""Entry points run as users run them: absl flags and --config.* overrides."""
import json
import os
import shlex
import signal
import subprocess
import sys

import pytest

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bad_override_fails_with_the_rule():
  cmd = [sys.executable, '-m', 'experiments.rl_train',
         '--config=configs/tiny.py', '--workdir=/tmp/unused',
         '--config.model.top_k=99']
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode != 0
  assert 'model.top_k: top_k (99) must be <= num_experts (8)' in out.stderr


def _rl_train(*flags, timeout=300, env=None):
  cmd = [sys.executable, '-m', 'experiments.rl_train',
         '--config=configs/tiny.py', *flags]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout,
                        env=env or dict(os.environ, PYTHONPATH=ROOT))


def test_bad_planner_method_is_one_line_before_any_work(tmp_path):
  out = _rl_train(f'--workdir={tmp_path}', '--config.planner.method=bogus')
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
      "config error: planner.method: must be one of static, eplb_step, "
      "eplb_microstep, foresight_split, foremoe, got 'bogus'"]
  assert '# run:' not in out.stdout and not os.listdir(tmp_path)


def test_unknown_config_field_is_one_line_with_the_nearest_name(tmp_path):
  out = _rl_train(f'--workdir={tmp_path}', '--config.rl.stepz=3')
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
      'unknown config field --config.rl.stepz; did you mean --config.rl.steps?']
  out = _rl_train(f'--workdir={tmp_path}', '--config.planr.method=static')
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
      'unknown config field --config.planr.method; did you mean '
      '--config.planner.method?']


def test_overrides_of_the_default_config_are_one_line_too(tmp_path):
  """Without --config the default file loads where a given one does (at
  flag parsing): ml_collections loaded it, overrides applied, while the
  flag was defined at import, so a typo was a 50-line traceback (exit 1)
  and, run from elsewhere, a missing default an OSError traceback."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  run = lambda *flags, cwd=ROOT: subprocess.run(
      [sys.executable, '-m', 'experiments.rl_train',
       f'--workdir={tmp_path}', *flags], cwd=cwd, capture_output=True,
      text=True, timeout=300, env=env)
  out = run('--config.rl.stepz=3')
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
      'unknown config field --config.rl.stepz; did you mean --config.rl.steps?']
  out = run('--config.rll.steps=3')
  assert (out.returncode, out.stderr.strip().splitlines()) == (2, [
      'unknown config field --config.rll.steps; did you mean '
      '--config.rl.steps?'])
  out = run('--config.rl.steps=3', cwd=str(tmp_path))
  assert (out.returncode, out.stderr.strip().splitlines()) == (2, [
      f'config file not found: --config=configs/tiny.py (from {tmp_path}); '
      'run from the repository root, where configs/ is'])
  assert not os.listdir(tmp_path)


@pytest.fixture(scope='module')
def preempted_run(tmp_path_factory):
  """One job with --config.* overrides, as a scheduler preempts it: SIGTERM
  mid-RL, then the same command continued to two steps past the stop. Two
  tests read it: the overrides took effect; the stop saved and the rerun
  resumed. (One run for both: each costs a warm start and RL compiles.)"""
  tmp_path = tmp_path_factory.mktemp('preempted')
  workdir = tmp_path / 'run'
  # Two warm-start steps: the warm start is done and saved before RL, as
  # with more; what is read here (the steps, the stop, the resume) does
  # not depend on how far it trained.
  flags = [f'--workdir={workdir}', '--config.warmstart.steps=2',
           '--config.eval_prompts=0', '--config.checkpoint_every=100',
           # Task sort, EPLB-step, one capacity and pair bucket: the
           # programs other tests' runs share (conftest.SHARED_TINY_RUN).
           *conftest.shared_tiny_run_flags()]
  # The trace is of step 2, the first step with no compiles: a trace of
  # step 1 also records every compile of the run's programs, which costs
  # seconds to write and is no more a profile of the step.
  cmd = [sys.executable, '-m', 'experiments.rl_train',
         '--config=configs/tiny.py', *flags, '--config.rl.steps=50',
         '--config.profile_steps=2']
  # The run's compilation cache (tests/conftest.py) comes with os.environ.
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith('step    2 |'):
      proc.send_signal(signal.SIGTERM)
      break
  rest, err = proc.communicate(timeout=300)
  run = dict(workdir=workdir, flags=flags, cmd=cmd,
             returncode=proc.returncode, stdout=''.join(lines) + rest,
             rest=rest, stderr=err)
  last = [l for l in run['stdout'].splitlines() if l.startswith('step ')]
  run['stopped_at'] = int(last[-1].split('|')[0].split()[1]) if last else 0
  # Read before the rerun appends to it (None: no step was logged).
  metrics = workdir / 'metrics.jsonl'
  run['steps_at_stop'] = ([json.loads(l)['step'] for l in open(metrics)]
                          if metrics.exists() else None)
  run['rerun'] = _rl_train(*flags, f'--config.rl.steps={run["stopped_at"] + 2}',
                           timeout=600, env=env)
  return run


def test_rl_train_cli_applies_config_overrides(preempted_run):
  run = preempted_run
  assert '# run:' in run['stdout']  # The setup is printed first.
  out = run['rerun']
  assert out.returncode == 0, out.stderr[-3000:]
  assert '# run:' in out.stdout
  # --config.rl.steps ended the rerun two steps past the stop;
  # --config.planner.method chose every step's planner.
  records = [json.loads(l) for l in open(run['workdir'] / 'metrics.jsonl')]
  assert [r['step'] for r in records] == list(range(1, run['stopped_at'] + 3))
  assert all(r['planner'] == 'eplb_step' for r in records)
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary['reward_first'] is not None


def test_sigterm_saves_the_step_and_a_rerun_continues_there(preempted_run):
  """As a scheduler preempts a job: SIGTERM mid-RL, then the same command."""
  run = preempted_run
  workdir, cmd, err = run['workdir'], run['cmd'], run['stderr']
  assert run['returncode'] == 128 + signal.SIGTERM, err[-3000:]
  stopped_at = run['stopped_at']
  assert 2 <= stopped_at < 50
  final = run['rest'].strip().splitlines()[-1]
  assert final.startswith(f'stopped by SIGTERM: step {stopped_at} saved in '), final
  # The hint runs as printed from the same folder: the interpreter that ran
  # the job (no activated venv needed), then the same flags.
  hint = shlex.split(final.split('resume with: ', 1)[1])
  assert os.path.samefile(os.path.join(ROOT, hint[0]), sys.executable), hint
  assert hint[1:] == ['-m', 'experiments.rl_train', *cmd[3:]], hint
  assert 'Traceback' not in err
  assert os.path.isdir(workdir / 'checkpoints' / str(stopped_at))
  traces = [f for _, _, fs in os.walk(workdir / 'profile') for f in fs]
  assert any(f.endswith('.xplane.pb') for f in traces), traces
  assert run['steps_at_stop'] == list(range(1, stopped_at + 1))

  out = run['rerun']
  assert out.returncode == 0, out.stderr[-3000:]
  assert f'restored the rl checkpoint at step {stopped_at}' in out.stdout
  assert 'warm start ' not in out.stdout
  steps = [json.loads(l)['step'] for l in open(workdir / 'metrics.jsonl')]
  assert steps == list(range(1, stopped_at + 3))


def test_benchmark_writes_its_results_file_and_the_renderer_reads_it(tmp_path):
  cmd = [sys.executable, '-m', 'experiments.bench_planner', '--json',
         '--layers=1', '--no_milp', '--sampled_traces=false',
         '--noalt_traces', f'--results_dir={tmp_path}']
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-3000:]
  record = json.load(open(tmp_path / 'bench_planner.json'))
  # The file holds exactly the printed result, the command and the setup.
  assert record['result'] == json.loads(out.stdout.strip().splitlines()[-1])
  # Where the file went is not part of the command (results.command_line).
  assert record['command'] == ('python -m experiments.bench_planner --json '
                               '--layers=1 --no_milp --sampled_traces=false '
                               '--noalt_traces')
  assert record['run']['bench'] == 'planner'
  from experiments import render_results  # pylint: disable=g-import-not-at-top
  block = render_results.render_block('bench_planner', str(tmp_path))
  assert record['command'] in block
  for c in record['result']['configs']:
    assert c['name'] in block


def test_progress_goes_to_stderr_under_json():
  # --json keeps stdout to the setup and one JSON line; a long run's
  # progress still shows, on stderr. (A subprocess: experiments.common
  # defines absl flags that other experiments' modules define too.)
  code = ('from experiments import common; '
          'common.progress(True)("repetition 1/5"); '
          'common.progress(False)("a table row")')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                       capture_output=True, text=True, check=True)
  assert (out.stdout, out.stderr) == ('a table row\n', 'repetition 1/5\n')


def test_a_scratch_run_keeps_its_plots_beside_its_results(tmp_path):
  # With --results_dir elsewhere, the PNGs go there too (<results_dir>/
  # <bench>), never over the committed ones; progress goes to stderr
  # under --json, the summary is stdout's last line.
  # One model, Mixtral (8 experts: a cell simulates in a fifth of the time
  # of Qwen3's 128), and two micro-steps a cell (the default is 8): the
  # same cells, rows and plot.
  cmd = [sys.executable, '-m', 'experiments.sweep_moves', '--json',
         '--models=mixtral_8x7b', '--devices=8', '--microsteps=2',
         f'--results_dir={tmp_path}']
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  png = tmp_path / 'sweep_moves' / 'foremoe_vs_foresight_split_step.png'
  assert summary['plots'] == [str(png)] and png.stat().st_size > 0
  saved = json.load(open(tmp_path / 'sweep_moves.json'))
  assert saved['result']['summary'] == summary
  assert 'mixtral_8x7b' in out.stderr


def test_launch_refuses_a_process_count_below_one():
  """A flag error (absl's line, status 1), not launcher's ValueError
  traceback."""
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.launch', '--num_processes=0', '--',
       'experiments.rl_train'], cwd=ROOT, capture_output=True, text=True,
      timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 1 and 'Traceback' not in out.stderr
  assert ('flag --num_processes=0: 0 is not a positive integer'
          in out.stderr)
