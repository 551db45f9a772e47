"""DatasetTask: files -> left-padded prompt ids -> verifier rewards, and its
data position. Everything is generated here: word-problem JSONL in GSM8K's
layout and a BPE tokenizer trained on it (tasks/word_problems.py); the
references are the files read back with json and the tokenizer called
directly."""
import json
import os
import re

import ml_collections
import numpy as np
import pytest

from foremoe_jax import config as config_lib
from foremoe_jax.tasks import get_task, rewards, word_problems
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.tasks import dataset as dataset_lib
from foremoe_jax.tasks.dataset import DatasetTask
from foremoe_jax.tasks.hf_tokenizer import HFTokenizer

TEMPLATE = 'Q: {prompt}\nA: '


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  out = tmp_path_factory.mktemp('word_problems')
  paths = word_problems.make_dataset(str(out), num_train=120, num_eval=16,
                                     seed=1, vocab_size=300)
  paths['dir'] = str(out)
  return paths


def make(data, **kw):
  args = dict(train_path=data['train'], eval_path=data['eval'],
              tokenizer_path=data['dir'], answer_marker='####',
              prompt_template=TEMPLATE, reward='numeric', max_prompt_len=48,
              max_completion_len=16)
  return DatasetTask(**{**args, **kw})


def records(path):
  return [json.loads(l) for l in open(path)]


def test_prompts_are_the_tokenized_questions_left_padded(data):
  task = make(data)
  tok = HFTokenizer.from_path(data['dir'])
  prompts = task.sample_prompts(None, 8)
  assert prompts.shape == (8, 48) and prompts.dtype == np.int32
  questions = {r['question'] for r in records(data['train'])}
  for row in prompts:
    start = int(np.argmax(row != tok.pad_id))
    assert (row[:start] == tok.pad_id).all() and start > 0
    ids = row[start:].tolist()
    assert ids[0] == tok.bos_id
    text = tok.decode(ids)
    assert text.startswith('Q: ') and text.endswith('\nA: ')
    assert text[3:-4] in questions
    assert ids[1:] == tok.encode(TEMPLATE.format(prompt=text[3:-4]))
  assert task.pad_id == tok.pad_id and task.eos_id == tok.eos_id
  assert task.vocab_size == tok.vocab_size and task.pads_prompts


def test_an_epoch_draws_every_fitting_record_once_then_reshuffles(data):
  task = make(data)
  n = task.num_records - task.num_skipped
  first = [task.decode(p) for p in task.sample_prompts(None, n)]
  second = [task.decode(p) for p in task.sample_prompts(None, n)]
  tok = HFTokenizer.from_path(data['dir'])
  fitting = [TEMPLATE.format(prompt=r['question'])
             for r in records(data['train'])
             if len(tok.encode(TEMPLATE.format(prompt=r['question']))) < 48]
  assert sorted(first) == sorted(fitting) == sorted(second)
  assert first != second  # A new order each epoch.


def test_skipped_prompts_are_counted_and_an_all_long_file_is_refused(data):
  tok = HFTokenizer.from_path(data['dir'])
  lens = [len(tok.encode(TEMPLATE.format(prompt=r['question']))) + 1
          for r in records(data['train'])]
  limit = int(np.median(lens))
  task = make(data, max_prompt_len=limit)
  assert task.num_skipped == sum(l > limit for l in lens) > 0
  assert f'{120 - task.num_skipped} of 120 records used' in task.describe()
  assert (task.sample_prompts(None, 50) != task.pad_id).sum(1).max() <= limit
  with pytest.raises(ValueError, match='no prompt fits max_prompt_len'):
    make(data, max_prompt_len=min(lens) - 1)


def test_data_position_round_trips_and_resumes_the_same_stream(data):
  a = make(data)
  a.sample_prompts(None, 5)
  a.supervised_batch(None, 3)
  state = json.loads(json.dumps(a.data_state()))
  assert state == dict(position=5, sft_position=3, num_records=120)
  want = [a.sample_prompts(None, 7) for _ in range(30)]  # Past an epoch.
  want_sft = a.supervised_batch(None, 4)
  b = make(data)
  b.load_data_state(state)
  for w in want:
    np.testing.assert_array_equal(b.sample_prompts(None, 7), w)
  for x, y in zip(b.supervised_batch(None, 4), want_sft):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match='different file'):
    make(data).load_data_state(dict(state, num_records=99))


def test_rewards_score_decoded_text_against_the_reference(data):
  task = make(data)
  tok = task.tokenizer
  prompts = task.sample_prompts(None, 6)
  refs = task.references(prompts)
  by_q = {r['question']: r['answer'] for r in records(data['train'])}
  for p, ref in zip(prompts, refs):
    q = task.decode(p)[3:-4]
    assert ref == by_q[q].split('####')[-1].strip()
  c = task.completion_len
  comps = np.full((6, c), task.pad_id, np.int32)
  texts = [f'{r} #### {r}' if i % 3 == 0 else str(r) if i % 3 == 1
           else f'{int(r) + 1}' for i, r in enumerate(refs)]
  for i, t in enumerate(texts):
    ids = tok.encode(t) + [task.eos_id]
    comps[i, :len(ids)] = ids
  want = np.array([1.0, 1.0, 0.0] * 2, np.float32)
  np.testing.assert_array_equal(task.reward(prompts, comps), want)
  # lengths cut a completion: an empty answer scores 0.
  lengths = np.where(np.arange(6) == 0, 0, c)
  np.testing.assert_array_equal(task.reward(prompts, comps, lengths),
                                np.where(np.arange(6) == 0, 0.0, want))
  with pytest.raises(KeyError, match="not one of this task's prompts"):
    task.reward(np.full_like(prompts, 5), comps)


def test_a_prompt_repeated_with_another_answer_is_left_out(data, tmp_path):
  """reward() finds a reference by the prompt's ids, so of two records
  with one question and different answers only the first is scored (and
  drawn); the second is left out of RL, counted, and so is an eval record
  repeating a training question with a third answer. Before, the table
  held whichever was drawn last, and every sample of that question was
  scored against it."""
  rows = records(data['train'])[:6]
  q = rows[0]['question']
  train = rows + [dict(rows[0], answer='#### 999')]  # Same question.
  # An eval record repeating a training one with its answer is fine.
  evals = [dict(rows[0], answer='#### 777'), rows[1]]
  paths = {}
  for name, recs in (('train', train), ('eval', evals)):
    paths[name] = str(tmp_path / f'{name}.jsonl')
    with open(paths[name], 'w') as f:
      f.writelines(json.dumps(r) + '\n' for r in recs)
  task = make(data, train_path=paths['train'], eval_path=paths['eval'])
  assert (task.num_conflicting, task.num_eval_conflicting) == (1, 1)
  assert 'left out of RL' in task.describe()
  want = rows[0]['answer'].split('####')[-1].strip()
  kept = task.num_records - task.num_skipped - task.num_conflicting
  assert kept >= 2
  drawn = task.sample_prompts(None, kept * 4)  # Four epochs.
  texts = [task.decode(p)[3:-4] for p in drawn]
  assert texts.count(q) == 4
  refs = task.references(drawn)
  assert {r for t, r in zip(texts, refs) if t == q} == {want}
  evals_drawn = task.eval_prompts(8, seed=0)
  assert len(evals_drawn) == 1
  assert task.decode(evals_drawn[0])[3:-4] == rows[1]['question']
  # The warm start still trains on every record.
  assert task.num_sft_skipped == 0


def test_a_registered_reward_is_called_with_text_and_reference(data):
  seen = []

  def length_reward(text, ref):
    seen.append((text, ref))
    return float(len(text))
  rewards.register_reward('test_length', length_reward)
  try:
    task = make(data, reward='test_length', reward_range=(0.0, 20.0))
    prompts = task.sample_prompts(None, 2)
    ids = task.tokenizer.encode('42') + [task.eos_id, 7, 7]
    comps = np.array([ids, ids], np.int32)
    np.testing.assert_array_equal(task.reward(prompts, comps), [2.0, 2.0])
    assert seen == [('42', r) for r in task.references(prompts)]
    assert task.reward_range == (0.0, 20.0)
  finally:
    rewards._REWARDS.pop('test_length')  # pylint: disable=protected-access


def test_supervised_batch_is_prompt_then_solution_and_eos(data):
  task = make(data)
  tokens, mask = task.supervised_batch(None, 4)
  p, c = task.prompt_len, task.completion_len
  assert tokens.shape == mask.shape == (4, p + c)
  by_q = {r['question']: r['answer'] for r in records(data['train'])}
  for row, m in zip(tokens, mask):
    q = task.decode(row[:p])[3:-4]
    want = task.tokenizer.encode(by_q[q]) + [task.eos_id]
    np.testing.assert_array_equal(row[p:p + len(want)], want)
    assert (row[p + len(want):] == task.pad_id).all()
    np.testing.assert_array_equal(m, np.r_[np.zeros(p), np.ones(len(want)),
                                           np.zeros(c - len(want))])


def test_sft_prompt_loss_adds_every_prompt_token_after_the_first(data):
  plain, with_prompt = make(data), make(data, sft_prompt_loss=True)
  tokens, mask = plain.supervised_batch(None, 4)
  tokens2, mask2 = with_prompt.supervised_batch(None, 4)
  np.testing.assert_array_equal(tokens2, tokens)  # The same stream.
  p = plain.prompt_len
  np.testing.assert_array_equal(mask2[:, p:], mask[:, p:])
  for row, m in zip(tokens, mask2):
    n_real = int((row[:p] != plain.pad_id).sum())  # BOS + the prompt.
    assert row[p - n_real] == plain.tokenizer.bos_id
    # Left PADs and BOS (nothing real before it) carry no loss.
    np.testing.assert_array_equal(
        m[:p], np.r_[np.zeros(p - n_real + 1), np.ones(n_real - 1)])


def test_a_pad_that_is_the_bos_is_refused(data):
  """Leading PADs are hidden, so a BOS that is also PAD (one special token
  for all three, or a config naming BOS as PAD) would vanish from every
  prompt: refused, naming the token; add_bos=False, or another PAD, runs."""
  with pytest.raises(ValueError, match=r"'<s>'\), which is also the PAD"):
    make(data, pad_token='<s>')
  assert make(data, pad_token='<s>', add_bos=False).pad_id == (
      make(data).tokenizer.bos_id)
  task = make(data, pad_token='</s>')
  assert task.pad_id == task.eos_id and task.sample_prompts(None, 2).shape


def test_prompt_targets_keep_a_pad_id_inside_the_prompt():
  # PAD = 0 (an EOS standing in for PAD): the leading zeros are padding, the
  # zero after real text is a prompt token, a target, and so is the token
  # after it. Hand-computed: targets are the real tokens after the first.
  prompts = np.array([[0, 0, 5, 6, 0, 7],
                      [4, 0, 0, 8, 9, 3],
                      [0, 0, 0, 0, 0, 2]])
  np.testing.assert_array_equal(
      dataset_lib.prompt_targets(prompts, 0),
      [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
  # The sampler's validity agrees: a target is valid and follows a valid one.
  valid = sampler_lib.prompt_valid(prompts, 0)
  assert (dataset_lib.prompt_targets(prompts, 0)[:, 1:]
          == (valid[:, 1:] & valid[:, :-1])).all()


def test_context_facts_hide_the_problem_among_other_names():
  rng = np.random.default_rng(3)
  for r in word_problems.generate(rng, 50, context_facts=6):
    sentences = r['question'].split('. ')
    facts, rest = sentences[:7], '. '.join(sentences[7:])
    assert len(facts) == 7 and rest.endswith('?')
    a, op, b = r['answer'].split(' ')[:3]
    name = rest.split(' ')[0]
    # Exactly one fact names the problem's person, and it holds a.
    mine = [f for f in facts if f.split(' ')[0] == name]
    assert len(mine) == 1
    assert mine[0].split(' ')[2] == a, r
    assert re.findall(r'\d+', rest) == [b]
    # The answer is the operation on the numbers, as in the short problems.
    want = {'+': int(a) + int(b), '-': int(a) - int(b),
            '*': int(a) * int(b)}[op]
    assert r['answer'] == f'{a} {op} {b} = {want} #### {want}'
    assert int(a) >= 1 and int(b) >= 1 and want >= 0
  with pytest.raises(ValueError, match='context_facts'):
    word_problems.generate(rng, 1, context_facts=-1)


def test_eval_prompts_come_from_the_eval_file_in_order(data):
  task = make(data, max_prompt_len=64)  # Every eval prompt fits.
  got = [task.decode(p)[3:-4] for p in task.eval_prompts(5, seed=0)]
  assert got == [r['question'] for r in records(data['eval'])[:5]]
  no_eval = make(data, eval_path='')
  assert no_eval.eval_prompts(5, seed=0).shape == (5, 48)
  # Eval references are known to reward, like the training prompts'.
  assert task.references(task.eval_prompts(2, seed=0)) == [
      r['answer'].split('####')[-1].strip()
      for r in records(data['eval'])[:2]]
  assert no_eval.data_state()['position'] == 0  # Not the training stream.


def test_parquet_json_list_and_jsonl_give_the_same_task(data, tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  recs = records(data['train'])
  pq.write_table(pa.Table.from_pylist(recs), tmp_path / 'train.parquet')
  (tmp_path / 'train.json').write_text(json.dumps(recs))
  want = make(data).sample_prompts(None, 9)
  for name in ('train.parquet', 'train.json'):
    got = make(data, train_path=str(tmp_path / name)).sample_prompts(None, 9)
    np.testing.assert_array_equal(got, want)


def test_bad_inputs_fail_with_a_clear_message(data, tmp_path):
  with pytest.raises(ValueError, match='does not exist'):
    make(data, train_path=str(tmp_path / 'missing.jsonl'))
  with pytest.raises(ValueError, match="no field 'problem'"):
    make(data, prompt_field='problem')
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"question": "a", "answer": "1"}\nnot json\n')
  with pytest.raises(ValueError, match='bad.jsonl:2'):
    make(data, train_path=str(bad))
  with pytest.raises(ValueError, match='tokenizer'):
    make(data, tokenizer_path='')
  with pytest.raises(ValueError, match='Did you mean'):
    make(data, reward='exact_mach')
  with pytest.raises(ValueError, match='must contain'):
    make(data, prompt_template='Q:')


def _tokenizer_with_template(data, tmp_path, template):
  """A copy of the dataset's tokenizer directory whose tokenizer_config.json
  holds `template` as its chat template."""
  d = tmp_path / 'tok'
  d.mkdir()
  (d / 'tokenizer.json').write_bytes(open(data['tokenizer'], 'rb').read())
  cfg = json.load(open(os.path.join(data['dir'], 'tokenizer_config.json')))
  (d / 'tokenizer_config.json').write_text(json.dumps(
      dict(cfg, chat_template=template)))
  return d


def test_chat_template_renders_the_question_as_a_user_turn(data, tmp_path):
  template = ('{% for m in messages %}[{{ m.role }}] {{ m.content }}\n'
              '{% endfor %}{% if add_generation_prompt %}[assistant] '
              '{% endif %}')
  d = _tokenizer_with_template(data, tmp_path, template)
  task = make(data, tokenizer_path=str(d), chat_template='auto',
              prompt_template='{prompt}', max_prompt_len=64)
  text = task.decode(task.sample_prompts(None, 1)[0])
  q = text[len('[user] '):-len('\n[assistant] ')]
  assert text == f'[user] {q}\n[assistant] '
  assert q in {r['question'] for r in records(data['train'])}


def _dataset_config(data, **model):
  import importlib  # pylint: disable=g-import-not-at-top
  cfg = importlib.import_module('configs.tiny_dataset').get_config()
  cfg.task_kwargs.train_path = data['train']
  cfg.task_kwargs.eval_path = data['eval']
  cfg.task_kwargs.tokenizer_path = data['dir']
  for k, v in model.items():
    cfg.model[k] = v
  return cfg


def test_config_validation_knows_the_dataset_task(data):
  config_lib.validate_config(_dataset_config(data))
  assert isinstance(get_task('dataset', **_dataset_config(data).task_kwargs),
                    DatasetTask)
  # MSA masks padding keys (docs/design.md §6.9): left-padded prompts pass.
  config_lib.validate_config(_dataset_config(data, attention_type='msa',
                                             first_sparse_layer=1))
  with pytest.raises(config_lib.ConfigError, match='model.vocab_size'):
    config_lib.validate_config(_dataset_config(data, vocab_size=64))
  cfg = _dataset_config(data)
  cfg.task_kwargs.train_path = '/nonexistent.jsonl'
  with pytest.raises(config_lib.ConfigError, match='task_kwargs: .*exist'):
    config_lib.validate_config(cfg)


def test_without_a_tokenizer_path_the_imported_checkpoints_is_used(data):
  from foremoe_jax.tasks import task_from_config  # pylint: disable=g-import-not-at-top
  cfg = _dataset_config(data)
  cfg.task_kwargs.tokenizer_path = ''
  with pytest.raises(ValueError, match='tokenizer'):
    task_from_config(cfg)
  cfg.init_from_hf = data['dir']  # A checkpoint directory ships tokenizer.json.
  task = task_from_config(cfg)
  assert task.vocab_size == HFTokenizer.from_path(data['dir']).vocab_size


def test_reward_workers_give_the_in_process_rewards(data):
  tasks = [make(data, reward='math'), make(data, reward='math',
                                           reward_workers=2)]
  got = []
  for task in tasks:
    prompts = task.sample_prompts(None, 12)
    refs = task.references(prompts)
    comps = np.full((12, task.completion_len), task.pad_id, np.int32)
    for i, r in enumerate(refs):
      ids = task.tokenizer.encode(r if i % 2 else str(int(r) + 3))
      comps[i, :len(ids) + 1] = ids + [task.eos_id]
    got.append(task.reward(prompts, comps))
    task.close()
  np.testing.assert_array_equal(got[1], got[0])
  np.testing.assert_array_equal(got[0], np.arange(12) % 2)
  assert tasks[1].last_reward_timeouts == 0


def test_reward_timeout_scores_the_bottom_of_the_range(data):
  task = make(data, reward='math', reward_range=(-1.0, 1.0), reward_workers=1,
              reward_timeout_s=2.5)
  assert (task._scorer.timeout_s, task._scorer.timeout_score) == (2.5, -1.0)  # pylint: disable=protected-access
  task.close()
  assert make(data)._scorer.timeout_s is None  # 0: no limit.  # pylint: disable=protected-access
  with pytest.raises(ValueError, match='reward_workers >= 1'):
    make(data, reward_timeout_s=2.5)


def test_chat_template_kwargs_reach_the_template(data, tmp_path):
  # A thinking switch in the style of Qwen3's template, and a namespace and
  # a reversed loop as real templates use them.
  template = ('{%- set ns = namespace(n=0) %}'
              '{%- for m in messages[::-1] %}{%- set ns.n = ns.n + 1 %}'
              '{%- endfor %}'
              '{%- for m in messages %}<{{ m.role }}>{{ m.content }}'
              '{%- endfor %}[{{ ns.n }}]'
              '{%- if add_generation_prompt %}<a>{%- if think is defined and '
              'think is false %}(no thinking){%- endif %}{%- endif %}')
  d = _tokenizer_with_template(data, tmp_path, template)
  kw = dict(tokenizer_path=str(d), chat_template='auto',
            prompt_template='{prompt}', max_prompt_len=96, eval_path='')
  plain = make(data, **kw).sample_prompts(None, 1)[0]
  task = make(data, chat_template_kwargs='{"think": false}',
              system_prompt='Be brief.', **kw)
  text = task.decode(task.sample_prompts(None, 1)[0])
  q = task.decode(plain)[len('<user>'):-len('[1]<a>')]
  assert text == f'<system>Be brief.<user>{q}[2]<a>(no thinking)'
  # The same as a dict in a Python config (a ConfigDict by then).
  cfg = ml_collections.ConfigDict(dict(kwargs=dict(think=False)))
  task = make(data, chat_template_kwargs=cfg.kwargs, system_prompt='Be brief.',
              **kw)
  assert task.decode(task.sample_prompts(None, 1)[0]) == text
  with pytest.raises(ValueError, match='JSON object'):
    make(data, chat_template_kwargs='{think: false}', **kw)
  with pytest.raises(ValueError, match='need a chat template'):
    make(data, chat_template_kwargs='{"think": false}')


def test_a_stop_token_ends_the_completion_the_reward_reads(data, tmp_path):
  """The text after a stop id is not scored: '7<stop> 8' is '7'. Stop ids
  come from generation_config.json unless stop_tokens (JSON) overrides."""
  base = make(data)
  tok = base.tokenizer
  prompts = base.sample_prompts(None, 2)
  refs = base.references(prompts)
  stop = tok.bos_id  # Any vocabulary id; BOS is one the text never holds.
  comps = np.full((2, base.completion_len), base.pad_id, np.int32)
  for i, r in enumerate(refs):
    ids = tok.encode(str(r)) + [stop] + tok.encode(f' {int(r) + 1}')
    comps[i, :len(ids)] = ids
  assert base.stop_ids == ()
  np.testing.assert_array_equal(base.reward(prompts, comps), [0.0, 0.0])
  bos = tok.bos_token
  task = make(data, stop_tokens=json.dumps([bos]))
  assert task.stop_ids == (stop,)
  np.testing.assert_array_equal(task.reward(prompts, comps), [1.0, 1.0])
  # The same from a generation_config.json beside the tokenizer.
  d = _tokenizer_with_template(data, tmp_path, None)
  (d / 'generation_config.json').write_text(
      json.dumps({'eos_token_id': [tok.eos_id, stop]}))
  assert make(data, tokenizer_path=str(d)).stop_ids == (stop,)
  assert make(data, tokenizer_path=str(d), stop_tokens='[]').stop_ids == ()
  with pytest.raises(ValueError, match='stop_tokens'):
    make(data, stop_tokens='<|im_end|>')
