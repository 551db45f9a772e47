"""Reruns of a workdir as a user makes them after a crash: the run's tail,
its logs and its config record.

A run killed after its last checkpoint but before its summary finishes the
tail on the next run (it used to be "complete" for good, with no summary or
plots); a warm start's earlier attempt leaves no records behind; a resumed
run compiles its step programs once; a rerun whose config cannot restore
the checkpoints leaves config.json as it was; and a rerun's changed fields
are named against the run's first config, added and removed ones included.
"""
import functools
import importlib
import json
import os
import re

import pytest

import conftest

from foremoe_jax.rl import checkpoint, trainer


def _config(**over):
  # Every step runs the same programs, those other tests' runs share
  # (conftest.SHARED_TINY_RUN).
  cfg = conftest.apply_shared_tiny_run(
      importlib.import_module('configs.tiny').get_config())
  cfg.warmstart.steps = 2
  cfg.rl.steps = 2
  cfg.checkpoint_every = 1
  cfg.eval_prompts = 4
  cfg.sample_log_every = 0
  cfg.planner.deadline_ms = 600000
  for k, v in over.items():
    *path, last = k.split('.')
    node = cfg
    for p in path:
      node = node[p]
    node[last] = v
  return cfg


def _steps(path):
  return [json.loads(l)['step'] for l in open(path)]


def test_a_run_killed_in_its_tail_finishes_it_on_rerun(tmp_path, capsys,
                                                       monkeypatch):
  wd = str(tmp_path)
  summary_path = os.path.join(wd, trainer.SUMMARY_FILE)
  # An earlier warm start's records (stopped, then rerun whole): dropped.
  with open(os.path.join(wd, 'warmstart.jsonl'), 'w') as f:
    f.write('{"step": 50, "phase": "warmstart", "sft_loss": 9.0}\n')
  real_eval = trainer.greedy_eval

  def dies_in_the_final_eval(*args, **kw):
    evaluate, calls = real_eval(*args, **kw), []

    def once(params):
      calls.append(1)
      if len(calls) == 2:  # After RL: the last checkpoint is written.
        raise KeyboardInterrupt('killed in the tail')
      return evaluate(params)
    return once

  monkeypatch.setattr(trainer, 'greedy_eval', dies_in_the_final_eval)
  with pytest.raises(KeyboardInterrupt):
    trainer.train(_config(), wd)
  assert not os.path.exists(summary_path)
  assert _steps(os.path.join(wd, 'warmstart.jsonl')) == [2]
  monkeypatch.setattr(trainer, 'greedy_eval', real_eval)

  # The same command again: the tail runs, and the run is complete.
  out = trainer.train(_config(), wd)
  assert not out.get('complete') and 'greedy_reward_after_rl' in out
  with open(summary_path) as f:
    assert json.load(f)['greedy_reward_after_rl'] == (
        out['greedy_reward_after_rl'])
  assert os.path.exists(os.path.join(wd, 'reward.png'))
  again = trainer.train(_config(), wd)
  assert again['complete'] and again['summary'] == json.load(
      open(summary_path))

  # Trained on to step 4: its programs compile at the first resumed step
  # only (a weak-typed step counter compiled the update again at step 4).
  capsys.readouterr()
  trainer.train(_config(**{'rl.steps': 4}), wd)
  log = capsys.readouterr().out
  update_compiles = [s for names, s in re.findall(
      r'compiled (.*) at step (\d+)', log) if 'update' in names]
  assert update_compiles == ['3'], log[-3000:]

  # A rerun whose model cannot restore these checkpoints is refused as
  # another config (not taken for damage: an older step is not tried and
  # nothing is set aside), and config.json (which export reads) still
  # describes the run.
  before = open(os.path.join(wd, trainer.CONFIG_FILE)).read()
  steps = sorted(os.listdir(os.path.join(wd, 'checkpoints')))
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match='written under another config'):
    trainer.train(_config(**{'model.d_model': 48, 'rl.steps': 4}), wd)
  assert open(os.path.join(wd, trainer.CONFIG_FILE)).read() == before
  assert sorted(os.listdir(os.path.join(wd, 'checkpoints'))) == steps
  assert not os.path.exists(os.path.join(wd, 'checkpoints.unreadable'))


def test_config_changes_are_named_against_the_first_config(tmp_path,
                                                           capsys):
  wd = str(tmp_path)
  cfg = _config()
  trainer._record_config(wd, cfg)  # pylint: disable=protected-access
  assert capsys.readouterr().out == ''
  assert json.load(open(os.path.join(wd, trainer.FIRST_CONFIG_FILE))) == (
      json.load(open(os.path.join(wd, trainer.CONFIG_FILE))))
  changed = _config(**{'rl.learning_rate': 1e-2, 'rl.steps': 9})
  del changed.rl['beta']  # Removed: the trainer would take its default.
  changed.rl.new_field = 1  # Added.
  for _ in range(2):  # The second rerun still compares with the first run.
    trainer._record_config(wd, changed)  # pylint: disable=protected-access
    line = capsys.readouterr().out
    assert 'rl.beta, rl.learning_rate, rl.new_field' in line, line
    assert 'rl.steps' not in line  # A change a rerun may make.
  assert json.load(open(os.path.join(wd, trainer.CONFIG_FILE)))['rl'][
      'learning_rate'] == 1e-2


def test_before_rl_reward_is_not_reported_against_other_prompts(tmp_path,
                                                                capsys):
  """eval_prompts may change on resume; the before-RL value, measured on
  the first run's prompts, is then not reported beside an after-RL value
  measured on others (the warm-started policy is gone)."""
  calls = []
  evaluate = lambda params: calls.append(params) or 0.25
  before = functools.partial(trainer._greedy_before_rl, str(tmp_path),  # pylint: disable=protected-access
                             evaluate, 'params')
  assert before(False, num_prompts=64) == 0.25 and len(calls) == 1
  assert before(True, num_prompts=64) == 0.25 and len(calls) == 1
  assert before(True, num_prompts=128) is None and len(calls) == 1
  assert 'measured on 64 held-out prompts, this run evaluates 128' in (
      capsys.readouterr().out)
  # A file from before the count was kept: taken as it is.
  (tmp_path / trainer.EVAL_FILE).write_text('{"greedy_reward_before_rl": 0.5}')
  assert before(True, num_prompts=128) == 0.5
