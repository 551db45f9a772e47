"""Several processes, one mesh: the launcher, and one RL step run as 2
processes x 4 CPU devices against the same step in one process with 8.

The independent reference for the multi-process run is the single-process
run of the same config: the mesh, the programs and the host-side data are
the same, only the devices are split over two processes that exchange
collectives over gloo, so the final parameters must agree to float
rounding.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import conftest
import line_sink

from foremoe_jax import config as config_lib
from foremoe_jax.utils import distributed, launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A child for the launcher tests: prints its id, then process 1 fails with
# status 3 while process 0 would run for a minute.
_CHILD = '''
import os, sys, time
pid = int(os.environ['FOREMOE_PROCESS_ID'])
print('hello from', pid, os.environ['FOREMOE_NUM_PROCESSES'],
      os.environ['XLA_FLAGS'], flush=True)
if pid == 1:
  sys.exit(3)
if os.environ.get('CHILD_MODE') == 'hang':
  time.sleep(60)
'''


def _child_env(tmp_path, **extra):
  (tmp_path / 'mh_child.py').write_text(_CHILD)
  env = {k: v for k, v in os.environ.items() if not k.startswith('FOREMOE_')}
  env.update(PYTHONPATH=str(tmp_path), **extra)
  return env


def test_xla_flags_replace_the_device_count():
  f = launcher.xla_flags_with_devices(
      '--xla_force_host_platform_device_count=8 --xla_foo=1', 4)
  assert f.split() == ['--xla_foo=1',
                       '--xla_force_host_platform_device_count=4']
  assert launcher.xla_flags_with_devices('', 2) == \
      '--xla_force_host_platform_device_count=2'


def test_initialize_from_env_is_a_no_op_without_the_variables():
  assert distributed.initialize_from_env({}) is False
  with pytest.raises(ValueError, match='FOREMOE_PROCESS_ID'):
    distributed.initialize_from_env({
        distributed.COORDINATOR_ENV: 'localhost:1',
        distributed.NUM_PROCESSES_ENV: '2'})
  # A ConfigError (one line from an entry point), checked before jax's
  # client is started: not an integer, or an id outside [0, N).
  for num, index in (('2', 'x'), ('2', '2'), ('0', '0'), ('two', '0')):
    with pytest.raises(config_lib.ConfigError,
                       match='must be an integer in'):
      distributed.initialize_from_env({
          distributed.COORDINATOR_ENV: 'localhost:1',
          distributed.NUM_PROCESSES_ENV: num,
          distributed.PROCESS_ID_ENV: index})


def test_launcher_prefixes_output_and_reports_a_failure(tmp_path):
  out = line_sink.Lines()
  status = launcher.launch('mh_child', [], 2, 3, out=out,
                           env=_child_env(tmp_path))
  assert status == 3
  lines = out.text.splitlines()
  assert any(l.startswith('[p0] hello from 0 2') and
             l.endswith('--xla_force_host_platform_device_count=3')
             for l in lines), out.text
  assert any(l.startswith('[p1] hello from 1 2') for l in lines), out.text


def test_launcher_stops_the_others_when_one_fails(tmp_path):
  out = line_sink.Lines()
  t0 = time.monotonic()
  status = launcher.launch('mh_child', [], 2, 1, out=out,
                           env=_child_env(tmp_path, CHILD_MODE='hang'))
  # Process 0 would sleep 60 s: it was stopped when process 1 failed.
  assert status == 3 and time.monotonic() - t0 < 30, out.text
  assert '[launch] process 1 exited with status 3' in out.text


_AGREE_CHILD = '''
import os, signal
import numpy as np
from foremoe_jax.utils import distributed
from foremoe_jax.utils.preemption import PreemptionGuard
from foremoe_jax.rl import trainer
assert distributed.initialize_from_env()
pid = int(os.environ['FOREMOE_PROCESS_ID'])
guard = PreemptionGuard()
print('max', distributed.max_over_processes(10 * pid + 3), flush=True)
print('stop before', trainer.stop_requested(guard), flush=True)
if pid == 1:  # Only process 1 gets the signal.
  guard.signum = signal.SIGTERM
print('stop after', trainer.stop_requested(guard), guard.signum, flush=True)
# Host data that differs (a plan one process made past its deadline): every
# process ends with process 0's, arrays included.
mine = {'pid': pid, 'slots': np.arange(5) * (pid + 1), 'why': 'x' * 10 * pid}
got = distributed.from_process_0(mine)
print('from0', got['pid'], got['slots'].tolist(), len(got['why']), flush=True)
'''


def test_processes_agree_on_a_stop_signal_only_one_of_them_got(tmp_path):
  """A scheduler's SIGTERM reaching one process stops every process at the
  same step boundary (else the next collective would hang); host data that
  differs between them (the trainer's plan) becomes process 0's."""
  (tmp_path / 'mh_agree.py').write_text(_AGREE_CHILD)
  env = {k: v for k, v in os.environ.items() if not k.startswith('FOREMOE_')}
  env.update(PYTHONPATH=f'{tmp_path}{os.pathsep}{ROOT}', JAX_PLATFORMS='cpu')
  out = line_sink.Lines()
  assert launcher.launch('mh_agree', [], 2, 1, out=out, env=env) == 0, \
      out.text
  for i in (0, 1):
    mine = [l.split('] ', 1)[1] for l in out.text.splitlines()
            if l.startswith(f'[p{i}] ') and ' ' in l]
    assert 'max 13' in mine, out.text
    assert 'stop before False' in mine, out.text
    assert 'stop after True 15' in mine, out.text
    assert 'from0 0 [0, 1, 2, 3, 4] 0' in mine, out.text


# One RL step of configs/tiny.py (4 warm-start steps first). partial_credit
# gives rewards that differ within a group even after so short a warm start,
# so the step's gradient is not zero. The planner's deadline is a minute:
# the two runs compared must make the same plan, and at tiny's 200 ms a
# loaded host's planner can miss it in one run and not the other (then the
# capacity and the loads differ, rightly).
_FLAGS = ('--config=configs/tiny.py', '--config.warmstart.steps=4',
          '--config.rl.steps=1', '--config.eval_prompts=0',
          '--config.rl.prompts_per_step=8', '--config.rl.num_generations=4',
          '--config.task_kwargs.partial_credit=1.0',
          '--config.planner.deadline_ms=60000')


def _run(cmd, devices):
  env = {k: v for k, v in os.environ.items() if not k.startswith('FOREMOE_')}
  env.update(PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices} '
             + conftest.CPU_TEST_XLA_FLAGS)
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=900, env=env)
  assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
  return out.stdout


def _final_params(workdir):
  """The last checkpoint's parameters (one flat array per leaf), restored in
  this process on the run's mesh and layout."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from foremoe_jax.model import expert_parallel, sharding, transformer  # pylint: disable=g-import-not-at-top
  from foremoe_jax.rl import checkpoint, step  # pylint: disable=g-import-not-at-top
  with open(os.path.join(workdir, 'config.json')) as f:
    cfg = json.load(f)
  mesh = expert_parallel.make_mesh(cfg['parallel']['num_data'],
                                   cfg['parallel']['num_expert'])
  _, params = sharding.split_model(transformer.Transformer(
      ml_collections.ConfigDict(cfg['model']), mesh, rngs=nnx.Rngs(0)), mesh)
  restored = checkpoint.Checkpointer(
      os.path.join(workdir, 'checkpoints')).restore_latest(
          step.master_params(params), log=lambda line: None)
  assert restored['phase'] == 'rl' and restored['step'] == 1
  return [np.asarray(x).ravel() for x in jax.tree.leaves(restored['params'])]


def _run_both(tmp_path, num_processes, devices_per_process, mesh_flags,
              reference_joins_runtime=False):
  """(multi-process run's params, single-process run's params).

  reference_joins_runtime: run the single process through the launcher too
  (`jax.distributed` with one process), so its collectives also go through
  gloo and add in the same order as the multi-process run's.
  """
  multi, single = tmp_path / 'multi', tmp_path / 'single'
  flags = (*_FLAGS, *mesh_flags)
  out = _run([sys.executable, '-m', 'experiments.launch',
              f'--num_processes={num_processes}',
              f'--devices_per_process={devices_per_process}', '--',
              'experiments.rl_train', *flags, f'--workdir={multi}'],
             devices=devices_per_process)
  lines = out.splitlines()
  # Process 0 prints the run (its setup, the step's line and the summary,
  # once each); the others print nothing on stdout, and gloo's connection
  # lines are dropped (experiments.launch).
  assert sum(l.startswith('[p0] step    1') for l in lines) == 1, out
  assert sum(l.startswith('[p0] {"greedy_reward_') for l in lines) == 1, out
  assert not [l for l in lines if not l.startswith(('[p0] ', '[launch] '))
              and ('step ' in l or '# run:' in l or '"plots"' in l)], out
  assert '[Gloo]' not in out, out
  total = num_processes * devices_per_process
  assert f'"devices": {total}' in out
  assert f'"processes": {num_processes}' in out
  mesh = dict(f.split('.')[-1].split('=') for f in mesh_flags)
  assert (f'"mesh": "{mesh["num_data"]} data x {mesh["num_expert"]} expert"'
          in out), out
  if reference_joins_runtime:
    _run([sys.executable, '-m', 'experiments.launch', '--num_processes=1',
          f'--devices_per_process={total}', '--', 'experiments.rl_train',
          *flags, f'--workdir={single}'], devices=total)
  else:
    _run([sys.executable, '-m', 'experiments.rl_train', *flags,
          f'--workdir={single}'], devices=total)

  # metrics.jsonl and warmstart.jsonl are written once (by process 0 only),
  # and the step saw the same samples.
  rec_m = [json.loads(l) for l in open(multi / 'metrics.jsonl')]
  rec_s = [json.loads(l) for l in open(single / 'metrics.jsonl')]
  assert [r['step'] for r in rec_m] == [1] == [r['step'] for r in rec_s]
  assert len(open(multi / 'warmstart.jsonl').readlines()) == 1
  assert rec_m[0]['grad_norm'] > 0  # A step that moved the parameters.
  for k in ('reward_mean', 'reward_std', 'completion_len', 'capacity',
            'device_load_MD'):
    assert rec_m[0][k] == rec_s[0][k], k
  for k in ('loss', 'grad_norm', 'kl'):
    assert np.isclose(rec_m[0][k], rec_s[0][k], rtol=1e-5, atol=1e-7), k
  return _final_params(str(multi)), _final_params(str(single))


@pytest.mark.slow
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path):
  # A 2 (data) x 4 (expert) mesh: the data all-reduce crosses the processes,
  # the expert all-to-all stays within one. Once jax.distributed runs, every
  # collective goes through gloo, even between devices of one process, and
  # gloo adds sums over 4 or 8 devices in another order than XLA's
  # in-process collectives (about 1e-7 relative). So the single process
  # joins the runtime too: same collectives, and the split over processes
  # is the only difference (WORKSPACE.md, "Several processes").
  p_m, p_s = _run_both(tmp_path, 2, 4, ('--config.parallel.num_data=2',
                                        '--config.parallel.num_expert=4',
                                        '--config.parallel.slots_per_device=3'),
                       reference_joins_runtime=True)
  assert len(p_m) == len(p_s)
  for a, b in zip(p_m, p_s):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_gloo_connect_lines_are_dropped_even_interleaved():
  noise = ['[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of '
           'connected peer ranks is : 1',
           '[Gloo] Rank [Gloo] Rank 2 is connected to 3 peer ranks. Expected '
           'number of connected peer ranks is : 3',
           '3 is connected to 3 peer ranks. Expected number of connected peer '
           'ranks is : 3', '[Gloo] Rank ']
  kept = ['step    1 | reward 0.5', '[Gloo] something else went wrong',
          'a line that mentions peer ranks', '']
  # Four threads at once (a CI run's output).
  noise.append('[Gloo] Rank 0 is connected to 7[Gloo] Rank 1 is connected '
               'to 7[Gloo] Rank 2 is connected to 7 peer ranks. Expected '
               'number of connected peer ranks is : 7[Gloo] Rank 3 peer '
               'ranks.  peer ranks. Expected number of connected peer ranks '
               'is :  is connected to Expected number of connected peer '
               'ranks is : ')
  # A number run into the next thread's word (a CI run's output, verbatim).
  noise.append('[Gloo] Rank 1 is connected to 3 peer ranks. [Gloo] Rank 3 is '
               'connected to 3 peer ranks. [Gloo] Rank 2 is connected to '
               '3Expected number of connected peer ranks is : 3 peer ranks. '
               'Expected number of connected peer ranks is : 3Expected '
               'number of connected peer ranks is : ')
  kept.append('step 3Expected reward')
  assert all(launcher.is_gloo_noise(l) for l in noise)
  assert not any(launcher.is_gloo_noise(l) for l in kept)
  # A message's tail alone on a line (its last number, its newline, a piece
  # of its words) goes with it; the same after the job's own output stays.
  lines = [noise[-1], '', '3', ' is connected to 7', 'step    1 | reward 0.5',
           '7', '', ' is connected to ']
  assert list(launcher.drop_gloo_noise(lines)) == [
      'step    1 | reward 0.5', '7', '', ' is connected to ']
