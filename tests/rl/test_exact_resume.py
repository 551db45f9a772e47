"""Exact resume, as a user hits it: kill -9 mid-RL, rerun the same command.

The run is configs/tiny_dataset.py end to end (generated JSONL files, a BPE
tokenizer, math-verify), so the data position travels in the checkpoint too.
The later steps of the resumed run must equal those of a run that was never
interrupted, number for number (timings aside), on CPU: the same prompts in
the same order, the same samples, the same rewards. The same holds when the
latest checkpoint is damaged and the run falls back to the one before.
"""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import conftest
from foremoe_jax import placement as placement_lib
from foremoe_jax import planner as planner_lib
from foremoe_jax.utils import tensorboard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# A generous planner deadline: a plan that times out on a loaded machine
# falls back to the home layout, which is a different (valid) run. One
# capacity (dropless) and one pair bucket (the pair bound): EPLB-step's
# plans change bucket step to step (the home layout at step 1, then
# rungs in turn), and each bucket would compile the update again, which
# costs more than the whole step here; with one, every step runs the same
# program.
FLAGS = ['--config=configs/tiny_dataset.py', '--config.warmstart.steps=10',
         '--config.rl.prompts_per_step=8', '--config.eval_prompts=8',
         '--config.checkpoint_every=1', '--config.rl.steps=4',
         '--config.sample_log_every=1',
         '--config.planner.method=eplb_step',
         '--config.planner.deadline_ms=600000',
         '--config.parallel.capacity_factors=(100,)',
         '--config.parallel.cell_factors=(100,)']


def _env():
  # The runs share the test run's persistent compilation cache (tests/
  # conftest.py, through os.environ): the same programs are compiled once,
  # and a resumed run executes the very programs the uninterrupted one did,
  # as on one machine. They are bound by running steps, hence the flags
  # for runs (conftest.CPU_RUN_XLA_FLAGS), the same in both.
  return conftest.cpu_run_env(ROOT)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  out = tmp_path_factory.mktemp('data')
  done = subprocess.run(
      [sys.executable, '-m', 'experiments.make_word_problems',
       f'--out_dir={out}', '--num_train=300', '--num_eval=16'],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
  assert done.returncode == 0, done.stderr[-3000:]
  return out


def _cmd(workdir, data, *extra):
  return [sys.executable, '-m', 'experiments.rl_train', *FLAGS, *extra,
          f'--config.task_kwargs.train_path={data}/train.jsonl',
          f'--config.task_kwargs.eval_path={data}/eval.jsonl',
          f'--config.task_kwargs.tokenizer_path={data}',
          f'--workdir={workdir}']


def _run(workdir, data, *extra):
  out = subprocess.run(_cmd(workdir, data, *extra), cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=_env())
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  return out.stdout


def _metrics(workdir):
  """Per step, every logged number except wall-clock timings."""
  records = [json.loads(l) for l in open(os.path.join(workdir,
                                                      'metrics.jsonl'))]
  return [{k: v for k, v in r.items() if not k.endswith('_s')}
          for r in records]


def _samples(workdir):
  return [json.loads(l) for l in open(workdir / 'samples.jsonl')]


def test_kill_9_mid_rl_then_rerun_equals_the_uninterrupted_run(tmp_path,
                                                                data):
  """The run before the kill is the uninterrupted run: every step it logged
  was computed with no interruption before it, so the steps the rerun redoes
  must equal those records, number for number (a second, uninterrupted run
  of the same command would compute them again: same seed, same data)."""
  killed = tmp_path / 'killed'
  # Killed after step 3 is logged, with checkpoints every step (the last
  # two kept): the latest complete one is step 2 or 3.
  proc = subprocess.Popen(_cmd(killed, data),
                          cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True,
                          env=_env())
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith('step    3 |'):
      proc.send_signal(signal.SIGKILL)
      break
  proc.communicate(timeout=120)
  assert proc.returncode == -signal.SIGKILL
  out = ''.join(lines)
  assert 'greedy reward after warm start' in out
  assert '  sample | ' in out
  # What the uninterrupted steps logged (each record is flushed before its
  # step's line is printed; step 3's samples may or may not have landed).
  expected = _metrics(killed)
  assert [r['step'] for r in expected] == [1, 2, 3]
  assert all(0.0 <= r['reward_mean'] <= 1.0 for r in expected)
  # Decoded samples, one record per step, each scored against the
  # dataset's own reference for its question.
  expected_samples = _samples(killed)
  assert [r['step'] for r in expected_samples][:2] == [1, 2]
  questions = {json.loads(l)['question']: json.loads(l)['answer']
               for l in open(data / 'train.jsonl')}
  for r in expected_samples:
    for smp in r['samples']:
      q = smp['prompt'][len('Q: '):-len('\nA: ')]
      assert smp['reference'] == questions[q].split('####')[-1].strip()
      assert smp['reward'] in (0.0, 1.0)
  tb = lambda w: tensorboard.read_scalars(str(w / 'tensorboard' / 'rl'))
  expected_tb = tb(killed)['rl/reward_mean']
  assert [s for s, _ in expected_tb] == [1, 2, 3]

  # The latest checkpoint then loses its array data, as a crash mid-write
  # or a bad disk leaves it: the rerun names it, falls back to the one
  # before, sets the damaged one aside and redoes the steps after, dropping
  # their records.
  ckpts = sorted(int(d) for d in os.listdir(killed / 'checkpoints')
                 if d.isdigit())
  latest, resume_at = ckpts[-1], ckpts[-1] - 1
  assert 2 <= latest < 4 and ckpts[-2:] == [resume_at, latest], ckpts
  for dirpath, _, files in os.walk(killed / 'checkpoints' / str(latest)
                                   / 'params'):
    for f in files:
      open(os.path.join(dirpath, f), 'wb').close()

  out = _run(killed, data)
  assert f'checkpoint at step {latest} in ' in out
  assert ('is unreadable (' in out
          and f'falling back to step {resume_at}' in out)
  assert f'restored the rl checkpoint at step {resume_at}' in out
  assert f'moved the unreadable step {latest} to ' in out
  assert [d.split('.')[0] for d in os.listdir(
      killed / 'checkpoints.unreadable')] == [str(latest)]
  assert 'warm start ' not in out
  # The redone steps (resume_at + 1 .. 3) equal what the uninterrupted
  # steps logged, and the run finished.
  got = _metrics(killed)
  assert [r['step'] for r in got] == [1, 2, 3, 4]
  assert got[:3] == expected
  # TensorBoard shows each step once: the killed attempt's events past the
  # checkpoint (flushed each step) are hidden by the rerun's purge step.
  got_tb = tb(killed)['rl/reward_mean']
  assert [s for s, _ in got_tb] == [1, 2, 3, 4]
  assert got_tb[:3] == expected_tb
  # Samples are logged once across the resume, and equal the
  # uninterrupted steps'.
  got_samples = _samples(killed)
  assert [r['step'] for r in got_samples] == [1, 2, 3, 4]
  assert got_samples[:len(expected_samples)] == expected_samples


def test_planner_state_round_trips_through_json():
  """A restored planner plans the next step exactly as the original would:
  same placement, same EPLB history, same counters."""
  rng = np.random.default_rng(0)
  num_layers, num_experts, num_devices, spd = 2, 8, 4, 3
  topo = planner_lib.Topology(num_nodes=2, devices_per_node=2,
                              slots_per_device=spd)
  cost = planner_lib.CostModel.from_expert_shape(64, 64)
  initial = placement_lib.identity_placement(num_layers, num_experts,
                                             num_devices, spd)

  def make():
    return planner_lib.StepPlanner('eplb_step', topo, cost, initial,
                                   carry_over=True)

  def loads():
    return rng.integers(0, 50, (2, num_layers, num_devices, num_experts))

  a = make()
  for _ in range(3):
    a.plan(loads())
  b = make()
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  np.testing.assert_array_equal(b.history_LE, a.history_LE)
  assert b.stats()['plans'] == 3
  nxt = loads()
  pa, pb = a.plan(nxt), b.plan(nxt)
  for m in range(pa.num_microsteps):
    np.testing.assert_array_equal(pa.microstep(m).slot_expert,
                                  pb.microstep(m).slot_expert)
    np.testing.assert_array_equal(pa.microstep(m).slot_share,
                                  pb.microstep(m).slot_share)
  a.close()
  b.close()
