"""The MSA indexer distillation phase (rl/distill.py, docs/design.md §6.11).

Checked: the distillation forward is exactly the dense model's (same
weights, attention_type='dense'); only the index branch changes and its
held-out KL falls; the phase's files and summary; a text-file source's
windows and its one-line errors; the step-0 checkpoint replaced in place.
"""
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import tiny_msa
from foremoe_jax import config as config_lib
from foremoe_jax.model import expert_parallel, sharding, transformer
from foremoe_jax.rl import checkpoint, distill
from foremoe_jax.tasks import task_from_config


def _config(**distill_kw):
  c = tiny_msa.get_config()
  c.model.num_layers = 1  # One MSA layer: the dense model has the same paths.
  c.model.first_sparse_layer = 0
  c.model.max_seq_len = 24
  c.model.msa_block_size = 4
  c.parallel.num_expert = 1
  c.parallel.slots_per_device = 0
  c.msa_distill.update(steps=12, learning_rate=3e-2, batch_size=8,
                       eval_sequences=8, log_every=5, **distill_kw)
  config_lib.validate_config(c)
  return c


@pytest.fixture(scope='module')
def phase(tmp_path_factory):
  """One distillation run of a random tiny MSA model, shared by the tests."""
  c = _config()
  mesh = expert_parallel.make_mesh(1, 1)
  model = transformer.Transformer(c.model, mesh, rngs=nnx.Rngs(0))
  graphdef, params = sharding.split_model(model, mesh)
  workdir = str(tmp_path_factory.mktemp('distill'))
  task = task_from_config(c)
  # A torn earlier attempt's records, which the phase must drop.
  with open(os.path.join(workdir, distill.DISTILL_FILE), 'w') as f:
    f.write('{"step": 3, "kl": 9.0}\n{"step": 4')
  new, summary = distill.run(c, task, graphdef, params, mesh, workdir,
                             np.random.default_rng(0))
  return dict(config=c, mesh=mesh, params=params, new=new, summary=summary,
              workdir=workdir, task=task)


def _flat(state):
  return {path: np.asarray(v.get_value()) for path, v in
          nnx.to_flat_state(state)}


def test_only_the_index_branch_changes_and_its_kl_falls(phase):
  old, new = _flat(phase['params']), _flat(phase['new'])
  assert old.keys() == new.keys()
  changed = {p for p in old if not np.array_equal(old[p], new[p])}
  index = {p for p in old if distill.is_index_param(p, None)}
  assert len(index) == 4 and changed == index
  s = phase['summary']
  assert s['msa_distill_kl_after'] < 0.7 * s['msa_distill_kl_before']
  for k in ('msa_recall_before', 'msa_recall_after', 'msa_recall_far_before',
            'msa_recall_far_after'):
    assert 0.0 < s[k] <= 1.0, (k, s[k])
  lines = [json.loads(l) for l in open(
      os.path.join(phase['workdir'], distill.DISTILL_FILE))]
  assert [r['step'] for r in lines] == [1, 5, 10, 12]
  assert {'kl', 'recall', 'recall_far', 'recall_far_oracle',
          'recall_layer0'} <= lines[0].keys()
  assert s['msa_recall_far_after'] <= s['msa_recall_far_oracle'] + 1e-6


def test_distillation_forward_is_the_dense_models(phase):
  c = phase['config']
  dense_cfg = ml_collections.ConfigDict(c.model.to_dict())
  dense_cfg.attention_type = 'dense'
  graph = lambda m: nnx.graphdef(nnx.eval_shape(
      lambda: transformer.Transformer(m, phase['mesh'], rngs=nnx.Rngs(0))))
  _, rest = distill.split_params(phase['new'])
  tokens, _ = phase['task'].supervised_batch(np.random.default_rng(3), 4)
  forward = lambda g, p, t: jax.jit(lambda p, t: nnx.merge(g, p)(t)[:2])(p, t)
  dense_logits, _ = forward(graph(dense_cfg), rest, tokens)
  ours, aux = forward(distill.distill_graphdef(c, phase['mesh']),
                      phase['new'], tokens)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(dense_logits),
                             atol=1e-5, rtol=1e-5)
  assert aux.indexer_distill.recall.shape == (1,)
  # The sparse model with the same weights differs (it drops keys).
  sparse, _ = forward(graph(c.model), phase['new'], tokens)
  assert np.abs(np.asarray(sparse) - np.asarray(dense_logits)).max() > 1e-3


def test_text_file_windows_and_errors(tmp_path, phase):
  tok = phase['task'].tokenizer
  text = '12+34=46' * 40
  path = tmp_path / 'corpus.txt'
  path.write_text(text)
  src = distill.TextWindows(str(path), tok, 24)
  ids = np.asarray(tok.encode(text))
  tokens, valid = src.train_batch(np.random.default_rng(0), 5)
  assert tokens.shape == (5, 24) and valid.all()
  for row in tokens:  # Each window is a contiguous slice of the stream.
    starts = [s for s in range(len(src.train_ids) - 23)
              if np.array_equal(ids[s:s + 24], row)]
    assert starts
  assert len(src.eval_ids) == max(24, len(ids) // 10)
  np.testing.assert_array_equal(src.eval_ids, ids[-len(src.eval_ids):])
  path.write_text('12+3')
  with pytest.raises(ValueError, match='needs at least 2 windows'):
    distill.TextWindows(str(path), tok, 24)
  path.write_text('12 + 3 is 15' * 20)
  with pytest.raises(ValueError, match='cannot be tokenised'):
    distill.TextWindows(str(path), tok, 24)
  path.write_text('12+3')
  with pytest.raises(ValueError, match='needs at least 2 windows'):
    distill.TextWindows(str(path), tok, 24)
  c = _config()
  c.msa_distill.text_file = str(tmp_path / 'missing.txt')
  with pytest.raises(config_lib.ConfigError, match='msa_distill.text_file'):
    config_lib.validate_config(c)
  c = _config()
  c.model.attention_type = 'dense'
  with pytest.raises(config_lib.ConfigError, match='attention_type'):
    config_lib.validate_config(c)
  # Windows of their own length (an HF import sets max_seq_len to the
  # checkpoint's context), at most the model's.
  c = _config()
  assert distill.window_len(c) == c.model.max_seq_len == 24
  c.msa_distill.seq_len = 8
  config_lib.validate_config(c)
  assert distill.window_len(c) == 8
  c.msa_distill.seq_len = 32
  with pytest.raises(config_lib.ConfigError, match='msa_distill.seq_len'):
    config_lib.validate_config(c)


def test_checkpoint_replace_puts_the_later_phase_in_place(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'ckpt'))
  ckpt.save(0, {'w': np.zeros(3, np.float32)}, phase='warmstart_done')
  with pytest.raises(Exception, match='already exists'):
    ckpt.save(0, {'w': np.ones(3, np.float32)}, phase='distill_done')
  ckpt.save(0, {'w': np.ones(3, np.float32)}, phase='distill_done',
            replace=True)
  out = ckpt.restore_latest({'w': np.zeros(3, np.float32)}, log=lambda _: 0)
  assert out['phase'] == 'distill_done' and ckpt.steps() == [0]
  np.testing.assert_array_equal(out['params']['w'], np.ones(3))


def test_a_replacing_save_that_dies_leaves_the_old_step(tmp_path,
                                                      monkeypatch):
  """A kill while the later phase's step is written leaves the earlier
  one to restore (before, it was deleted first: nothing was left); a kill
  after the new step is whole but before the old one is gone leaves the
  new one alone."""
  path = str(tmp_path / 'ckpt')
  template = {'w': np.zeros(3, np.float32)}
  ckpt = checkpoint.Checkpointer(path)
  ckpt.save(0, {'w': np.zeros(3, np.float32)}, phase='warmstart_done')

  def killed(*a, **k):
    raise KeyboardInterrupt('killed mid-save')
  monkeypatch.setattr(ckpt._mgr, 'save', killed)  # pylint: disable=protected-access
  with pytest.raises(KeyboardInterrupt):
    ckpt.save(0, {'w': np.ones(3, np.float32)}, phase='distill_done',
              replace=True)
  again = checkpoint.Checkpointer(path)
  out = again.restore_latest(template, log=lambda _: 0)
  assert out['phase'] == 'warmstart_done' and again.steps() == [0]
  # The new step saved whole, the old one still aside: the new one stays.
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.copytree(os.path.join(path, '0'), str(tmp_path / 'old'))
  again.save(0, {'w': np.ones(3, np.float32)}, phase='distill_done',
             replace=True)
  shutil.copytree(str(tmp_path / 'old'),
                  os.path.join(path, '0' + checkpoint.REPLACED))
  third = checkpoint.Checkpointer(path)
  assert third.restore_latest(template, log=lambda _: 0)['phase'] == (
      'distill_done')
  assert sorted(os.listdir(path)) == ['0']


def test_a_datasets_evaluation_batch_is_held_out(tmp_path):
  """With a dataset task the evaluation sequences are its eval file's
  records: none is a training record, drawing them moves no training draw,
  and the valid mask runs from the first prompt token to EOS (the PADs on
  either side are no text). Before, they were the next records of the
  warm-start stream itself (trained on once it wrapped), and every PAD
  after EOS was a query of the KL and of the recall."""
  from foremoe_jax.tasks import word_problems  # pylint: disable=g-import-not-at-top
  from foremoe_jax.tasks.dataset import DatasetTask  # pylint: disable=g-import-not-at-top
  paths = word_problems.make_dataset(str(tmp_path), num_train=40,
                                     num_eval=6, seed=0, vocab_size=300)

  def make(**kw):
    return DatasetTask(train_path=paths['train'], tokenizer_path=str(tmp_path),
                       answer_marker='####', reward='numeric',
                       max_prompt_len=48, max_completion_len=16,
                       prompt_template='Q: {prompt}\nA: ', **kw)

  def questions(task, tokens):
    return [task.decode(t[:task.prompt_len])[3:-4] for t in tokens]

  with_eval, alone = (distill.TaskSequences(make(eval_path=paths['eval'])),
                      distill.TaskSequences(make()))
  ev, ev_valid = with_eval.eval_batch(np.random.default_rng(7), 8)
  train = [with_eval.train_batch(np.random.default_rng(0), 8)[0]
           for _ in range(12)]  # Several epochs of the 40 records.
  np.testing.assert_array_equal(  # The same draws as a run without it.
      np.concatenate(train), np.concatenate(
          [alone.train_batch(np.random.default_rng(0), 8)[0]
           for _ in range(12)]))
  eval_qs = questions(with_eval.task, ev)
  assert len(set(eval_qs)) >= 3 and set(eval_qs) <= {
      json.loads(l)['question'] for l in open(paths['eval'])}
  assert not set(eval_qs) & set(questions(with_eval.task,
                                          np.concatenate(train)))
  assert with_eval.source == 'eval_path records'
  assert 'not held out' in alone.source
  # valid: from the first non-PAD prompt token through EOS, nothing after.
  p, eos, pad = with_eval.task.prompt_len, with_eval.task.eos_id, with_eval.task.pad_id
  for row, v in zip(ev, ev_valid):
    first, end = int(np.argmax(row != pad)), p + int(np.argmax(row[p:] == eos))
    np.testing.assert_array_equal(v, (np.arange(len(row)) >= first)
                                  & (np.arange(len(row)) <= end))
    assert (row[end + 1:] == pad).all()
  assert not ev_valid[:, -1].all()  # Some PADs after EOS were hidden.
