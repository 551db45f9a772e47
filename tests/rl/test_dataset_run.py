"""configs/tiny_dataset.py end to end, as a user runs it: generate the files,
train, and resume exactly (the data position is in the checkpoint).

A run that lost everything after its step-2 checkpoint and is rerun to step
4 must log the very numbers (timings aside) of the run that went to 4 at
once: the same prompts in the same order, the same samples, the same
rewards.
"""
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _run(args):
  # The test run's compilation cache (tests/conftest.py) comes with
  # os.environ: the three runs compile their programs once.
  out = subprocess.run([sys.executable, '-m', *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  return out.stdout


def _metrics(workdir):
  records = [json.loads(l) for l in open(workdir / 'metrics.jsonl')]
  return [{k: v for k, v in r.items() if not k.endswith('_s')}
          for r in records]


def test_dataset_config_trains_and_resumes_exactly(tmp_path):
  data = tmp_path / 'data'
  _run(['experiments.make_word_problems', f'--out_dir={data}',
        '--num_train=300', '--num_eval=16'])
  flags = ['--config=configs/tiny_dataset.py',
           f'--config.task_kwargs.train_path={data}/train.jsonl',
           f'--config.task_kwargs.eval_path={data}/eval.jsonl',
           f'--config.task_kwargs.tokenizer_path={data}',
           '--config.warmstart.steps=10', '--config.rl.prompts_per_step=8',
           '--config.eval_prompts=8', '--config.checkpoint_every=2',
           '--config.sample_log_every=1',
           '--config.planner.method=eplb_step',
           '--config.planner.deadline_ms=600000',
           # Two capacity rungs: one update program for every step (the
           # static first step and the balanced ones), not one per bucket.
           '--config.parallel.capacity_growth=100']
  train = ['experiments.rl_train', *flags]
  straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
  out = _run([*train, '--config.rl.steps=4', f'--workdir={straight}'])
  assert 'greedy reward after warm start' in out
  expected = _metrics(straight)
  assert [r['step'] for r in expected] == [1, 2, 3, 4]
  assert all(0.0 <= r['reward_mean'] <= 1.0 for r in expected)

  # The finished run as it stood at step 2: its last checkpoint is gone (as
  # after a crash before it was written); the logs run on to step 4 and are
  # cut back on the rerun.
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / 'checkpoints' / '4')
  out = _run([*train, '--config.rl.steps=4', f'--workdir={resumed}'])
  assert 'restored the rl checkpoint at step 2' in out
  assert _metrics(resumed) == expected

  # Decoded samples, one record per step, logged once across the resume,
  # and the same as the uninterrupted run's.
  samples = [json.loads(l) for l in open(resumed / 'samples.jsonl')]
  assert [r['step'] for r in samples] == [1, 2, 3, 4]
  assert samples == [json.loads(l) for l in open(straight / 'samples.jsonl')]
  questions = {json.loads(l)['question']: json.loads(l)['answer']
               for l in open(data / 'train.jsonl')}
  for r in samples:
    for smp in r['samples']:
      q = smp['prompt'][len('Q: '):-len('\nA: ')]
      assert smp['reference'] == questions[q].split('####')[-1].strip()
      assert smp['reward'] in (0.0, 1.0)
  assert '  sample | ' in out
