"""A newcomer's mistakes end in one line naming what to change, not a
traceback (issue 25): a missing config file, a mesh larger than the
devices (alone and under experiments.launch), a truncated safetensors
file, a second Ctrl-C, an MSA top-k larger than the key blocks. Plus the
resume hint, runnable as printed without an activated venv.

Most run `cli.run` in this process; two start the entry point itself.
"""
import importlib
import os
import shlex
import signal
import subprocess
import sys
import time

from absl import logging
import numpy as np
import pytest

import line_sink

from foremoe_jax import config as config_lib
from foremoe_jax.hf import files
from foremoe_jax.hf.families import HFCheckpointError
from foremoe_jax.utils import cli, distributed, launcher
from foremoe_jax.utils.preemption import PreemptionGuard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli_run(monkeypatch, argv, main, **kw):
  """cli.run(main) as `python -m prog *argv` would: (exit status, stderr
  lines), with absl's verbosity put back afterwards."""
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sys, 'argv', ['prog', *argv])
  monkeypatch.delenv(distributed.PROCESS_ID_ENV, raising=False)
  verbosity = logging.get_verbosity()
  try:
    with pytest.raises(SystemExit) as e:
      cli.run(main, **kw)
  finally:
    logging.set_verbosity(verbosity)
  return e.value.code


def test_missing_config_file_is_one_line_naming_the_configs(monkeypatch,
                                                            capsys):
  called = []
  status = _cli_run(monkeypatch, ['--config=configs/nope.py'],
                    lambda argv: called.append(argv))
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and not called
  assert len(err) == 1, err
  assert err[0].startswith(f'config file not found: --config=configs/nope.py '
                           f'(from {ROOT}); configs/ has ')
  # It names the config files that are there, every one of them.
  listed = err[0].split('configs/ has ', 1)[1].split(', ')
  assert listed == sorted(f for f in os.listdir(os.path.join(ROOT, 'configs'))
                          if f.endswith('.py') and not f.startswith('_'))
  assert 'tiny.py' in listed
  # `path:arg` names the same file; an existing one passes.
  assert cli.missing_config_file('configs/tiny.py:x', cwd=ROOT) is None
  line = cli.missing_config_file('configs/tiny.py', cwd='/')
  assert line.endswith('run from the repository root, where configs/ is')


def test_second_ctrl_c_is_one_line_with_the_resume_hint(monkeypatch, capsys):
  def main(argv):
    del argv
    with PreemptionGuard():
      os.kill(os.getpid(), signal.SIGINT)  # Finish the step, then save...
      time.sleep(0.5)
      os.kill(os.getpid(), signal.SIGINT)  # ...no: abort now.
      time.sleep(5)
      raise AssertionError('the second SIGINT did not stop main')

  status = _cli_run(monkeypatch, [], main, interrupt_hint='resume with: X')
  err = capsys.readouterr().err
  assert status == 128 + signal.SIGINT
  assert 'Traceback' not in err
  # The guard's line for the first signal, then one line for the second.
  assert [l for l in err.splitlines() if l] == [
      'SIGINT: finishing the current step, then saving a checkpoint (signal '
      'again to abort now)', 'aborted by a second SIGINT: resume with: X']
  assert cli.interrupted_line(KeyboardInterrupt('second SIGTERM')) == (
      'aborted by a second SIGTERM', 128 + signal.SIGTERM)
  assert cli.interrupted_line(KeyboardInterrupt()) == ('aborted by SIGINT',
                                                       130)


def test_mesh_larger_than_the_devices_names_what_to_change():
  assert cli.mesh_device_error(1, 8, 8) is None
  assert cli.mesh_device_error(1, 4, 8) is None  # One process may idle some.
  one = cli.mesh_device_error(2, 8, 8)
  assert one == (
      'parallel.num_data x parallel.num_expert = 2 x 8 = 16 devices, but this '
      'process has 8 simulated CPU devices: run with XLA_FLAGS='
      '--xla_force_host_platform_device_count=16, or set '
      '--config.parallel.num_data and --config.parallel.num_expert to '
      'multiply to 8')
  # Under the launcher XLA_FLAGS is the launcher's to set: name its flags.
  multi = cli.mesh_device_error(2, 8, 8, processes=2)
  assert 'XLA_FLAGS' not in multi
  assert ('but the job has 8 (2 processes x 4): give experiments.launch '
          '--num_processes x --devices_per_process = 16') in multi
  # Several processes must fill the mesh: a smaller one leaves one idle.
  assert cli.mesh_device_error(1, 4, 8, processes=2) is not None
  gpu = cli.mesh_device_error(1, 16, 8, processes=1, platform='gpu')
  assert 'XLA_FLAGS' not in gpu and gpu.endswith('multiply to 8')


def test_rl_train_mesh_error_is_one_line_before_any_work(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith('FOREMOE_')}
  env.update(PYTHONPATH=ROOT,
             XLA_FLAGS='--xla_force_host_platform_device_count=8')
  workdir = tmp_path / 'run'
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.rl_train', f'--workdir={workdir}',
       '--config.parallel.num_data=2'], cwd=ROOT, capture_output=True,
      text=True, timeout=300, env=env)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
      'config error: ' + cli.mesh_device_error(2, 8, 8)]
  assert '# run:' not in out.stdout and not workdir.exists()


def test_mesh_error_under_launch_is_printed_once_with_the_launch_flags(
    tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith('FOREMOE_')}
  env.update(PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  out = line_sink.Lines()
  # configs/tiny.py's mesh is 1 x 8: 2 processes of 2 devices hold 4.
  status = launcher.launch('experiments.rl_train',
                           [f'--workdir={tmp_path}/run'], 2, 2, out=out,
                           env=env)
  assert status == 2, out.text
  want = 'config error: ' + cli.mesh_device_error(1, 8, 4, processes=2)
  lines = [l for l in out.text.splitlines() if not l.startswith('[launch]')]
  assert lines == [f'[p0] {want}'], out.text


def test_rerun_command_runs_without_an_activated_venv():
  venv_python = os.path.join(ROOT, '.venv', 'bin', 'python')
  assert cli.python_command(venv_python, ROOT) == '.venv/bin/python'
  assert cli.python_command('/usr/bin/python3', ROOT) == '/usr/bin/python3'
  args = ['--config=configs/tiny.py', '--workdir=/tmp/a b']
  cmd = cli.rerun_command('experiments.rl_train', args,
                          executable=venv_python, cwd=ROOT, environ={})
  assert shlex.split(cmd) == ['.venv/bin/python', '-m',
                              'experiments.rl_train', *args]
  # A child of experiments.launch names the launch instead.
  env = {cli.RERUN_ENV: 'python -m experiments.launch -- x'}
  assert cli.rerun_command('experiments.rl_train', args,
                           environ=env) == env[cli.RERUN_ENV]


def test_only_process_zero_prints():
  pid = distributed.PROCESS_ID_ENV
  assert distributed.prints_output({pid: '0'})
  assert not distributed.prints_output({pid: '1'})
  # Alone (no id set, no distributed runtime): it prints.
  assert distributed.prints_output({})


def test_truncated_safetensors_is_one_error_naming_the_file(tmp_path):
  tensors = {'a': np.arange(64, dtype=np.float32).reshape(8, 8),
             'b': np.ones(5, np.float32)}
  files.write_checkpoint(str(tmp_path), {'model_type': 'x'}, tensors)
  path = tmp_path / files.SINGLE
  data = path.read_bytes()
  assert files.tensor_shapes(str(tmp_path)) == {'a': (8, 8), 'b': (5,)}
  for keep in (len(data) - 7, 200, 20, 3):  # Data, header, length cut.
    path.write_bytes(data[:keep])
    with pytest.raises(HFCheckpointError) as e:
      files.tensor_shapes(str(tmp_path))
    line = str(e.value)
    assert '\n' not in line
    assert line.startswith(f'{path}: not a complete safetensors file (')
    assert f'; {keep} bytes): an interrupted download or copy' in line
  (tmp_path / files.CONFIG).write_text('{"model_type": ')
  with pytest.raises(HFCheckpointError, match='config.json: not valid JSON'):
    files.read_config(str(tmp_path))


def test_msa_top_k_beyond_the_key_blocks_is_refused():
  cfg = importlib.import_module('configs.tiny').get_config()
  m = cfg.model
  m.attention_type = 'msa'
  m.max_seq_len, m.msa_block_size = 32, 8
  m.msa_top_k = 4  # All 4 key blocks: allowed (dense, through MSA).
  config_lib.validate_config(cfg)
  m.msa_top_k = 5
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate_config(cfg)
  assert str(e.value) == ('model.msa_top_k: must be <= the number of key '
                          'blocks, max_seq_len / msa_block_size = 32 / 8 = 4, '
                          'got 5')
