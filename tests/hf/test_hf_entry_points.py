"""convert_hf, hf_forward and export_hf as users run them; init_from_hf."""
import importlib
import json
import os
import subprocess
import sys

import numpy as np

from foremoe_jax import hf
from foremoe_jax.hf import convert, files, workdir as workdir_lib
from foremoe_jax.rl import trainer
import hf_numpy_reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def run(module, *flags):
  out = subprocess.run([sys.executable, '-m', f'experiments.{module}', *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.startswith('# run:')  # The setup is printed first.
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_convert_forward_export_commands(tmp_path):
  c = ref.tiny_config('olmoe')
  t = ref.random_tensors(c, seed=7)
  src = str(tmp_path / 'src')
  ref.write_checkpoint(src, c, t, shards=2)
  work, out = str(tmp_path / 'work'), str(tmp_path / 'out')
  run('convert_hf', f'--hf_dir={src}', f'--workdir={work}')
  m = json.load(open(os.path.join(work, 'model_config.json')))
  assert (m['hf_model_type'], m['qk_norm_scope']) == ('olmoe', 'full')
  assert json.load(open(os.path.join(work, 'hf_config.json'))) == c

  result = run('export_hf', f'--workdir={work}', f'--out={out}')
  assert result['files'] == ['config.json', 'model.safetensors']
  back = files.read_tensors(out)
  assert back.keys() == t.keys()
  for k in t:
    np.testing.assert_array_equal(back[k], t[k], err_msg=k)

  tok = np.random.default_rng(1).integers(0, 64, (2, 6))
  np.save(tmp_path / 'tok.npy', tok.astype(np.int32))
  run('hf_forward', f'--hf_dir={out}', f'--tokens_npy={tmp_path}/tok.npy',
      f'--out_npy={tmp_path}/logits.npy')
  logits = np.load(tmp_path / 'logits.npy')
  assert logits.dtype == np.float32 and logits.shape == (2, 6, 64)
  np.testing.assert_allclose(logits, ref.forward(c, t, tok),
                             atol=1e-4, rtol=1e-4)


def test_bad_hf_dir_is_one_line(tmp_path):
  cmd = [sys.executable, '-m', 'experiments.hf_forward',
         f'--hf_dir={tmp_path}', f'--tokens_npy={tmp_path}/t.npy',
         f'--out_npy={tmp_path}/o.npy']
  np.save(tmp_path / 't.npy', np.zeros((1, 2), np.int32))
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
      f'config error: {tmp_path}/config.json: no config.json in the '
      'checkpoint directory']


def test_trainer_starts_from_the_imported_params(tmp_path, capsys):
  c = ref.tiny_config('qwen3_moe')
  t = ref.random_tensors(c, seed=3)
  src = str(tmp_path / 'src')
  ref.write_checkpoint(src, c, t)
  cfg = importlib.import_module('configs.tiny').get_config()
  cfg.init_from_hf = src
  cfg.warmstart.steps = 0  # Checkpoint 0 holds the parameters RL starts from.
  cfg.rl.steps = 0
  cfg.eval_prompts = 0
  cfg.parallel.num_expert = 4  # 4 experts in the checkpoint.
  work = str(tmp_path / 'run')
  trainer.train(cfg, work)
  # One line says the weights came: every tensor of the checkpoint.
  n = sum(x.size for x in t.values())
  assert f'init_from_hf: loaded {n:,} parameters (' in capsys.readouterr().out
  assert cfg.model.hf_model_type == 'qwen3_moe' and cfg.model.head_dim == 16
  assert cfg.model.dtype == 'float32'  # Not in the checkpoint: kept.

  # The trainer writes config.json (another piece of the trainer); write it
  # here when it does not yet, as export reads it.
  if not os.path.exists(os.path.join(work, 'config.json')):
    json.dump(cfg.to_dict(), open(os.path.join(work, 'config.json'), 'w'))
  m, state, original = workdir_lib.read_workdir(work)
  assert original == c
  _, want, _ = hf.import_hf(src)
  got, want = convert.params_of_state(state), convert.params_of_state(want)
  assert got.keys() == want.keys()
  for path in want:
    assert np.array_equal(got[path], want[path]), path

  out = str(tmp_path / 'exported')
  workdir_lib.export_checkpoint(work, out)
  back = files.read_tensors(out)
  assert back.keys() == t.keys()
  for k in t:
    np.testing.assert_array_equal(back[k], t[k], err_msg=k)
