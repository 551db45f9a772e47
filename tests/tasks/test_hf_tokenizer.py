"""HFTokenizer on a small byte-level BPE trained here, not downloaded."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from foremoe_jax.tasks.hf_tokenizer import HFTokenizer

SPECIALS = ['<pad>', '<s>', '</s>', '<|im_start|>', '<|im_end|>']
CHATML = ('{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}'
          '<|im_end|>\n{% endfor %}{% if add_generation_prompt %}'
          '<|im_start|>assistant\n{% endif %}')
WORDS = ('the cat dog sat on a mat and ran to big red blue house tree what is '
         'plus minus times answer equals').split()


def _sentences(rng, n):
  return [' '.join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
          + f' {rng.randrange(10000)}.' for _ in range(n)]


def _train(specials=tuple(SPECIALS)):
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300, special_tokens=list(specials),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  tok.train_from_iterator(_sentences(random.Random(0), 400), trainer)
  return tok


@pytest.fixture(scope='module')
def trained():
  return _train()


@pytest.fixture
def tok_dir(tmp_path, trained):
  """A checkpoint-like directory holding only tokenizer.json."""
  trained.save(str(tmp_path / 'tokenizer.json'))
  return tmp_path


def _write_config(directory, config):
  (directory / 'tokenizer_config.json').write_text(json.dumps(config))


def test_from_file_and_directory_agree(tok_dir, trained):
  from_dir = HFTokenizer.from_path(tok_dir)
  from_file = HFTokenizer.from_path(tok_dir / 'tokenizer.json')
  from_str = HFTokenizer.from_path(str(tok_dir))
  for tok in (from_dir, from_file, from_str):
    assert tok.vocab_size == trained.get_vocab_size(with_added_tokens=True)
    # No config: the vocabulary's common names are used.
    assert tok.eos_id == trained.token_to_id('</s>')
    assert tok.bos_id == trained.token_to_id('<s>')
    assert tok.pad_id == trained.token_to_id('<pad>')
  text = 'the red cat ran 42.'
  assert from_dir.encode(text) == from_file.encode(text) == (
      trained.encode(text, add_special_tokens=False).ids)


def test_saved_truncation_and_padding_are_ignored(tmp_path, trained):
  """A tokenizer.json saved with truncation and padding on (transformers'
  save_pretrained keeps the last call's) encodes whole, unpadded texts:
  the ids equal a clean tokenizer's, however long."""
  clean = HFTokenizer.from_path(_saved(tmp_path / 'clean', trained))
  texts = _sentences(random.Random(1), 6)
  want = clean.encode_batch(texts)
  assert max(map(len, want)) > 4 and len(set(map(len, want))) > 1
  cut = Tokenizer.from_str(trained.to_str())
  cut.enable_truncation(max_length=4)
  cut.enable_padding(pad_id=0, pad_token='<pad>', length=64)
  tok = HFTokenizer.from_path(_saved(tmp_path / 'cut', cut))
  assert tok.encode_batch(texts) == want
  assert [tok.encode(t) for t in texts] == want


def _saved(directory, tokenizer):
  directory.mkdir()
  tokenizer.save(str(directory / 'tokenizer.json'))
  return directory


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match='nothing_here'):
    HFTokenizer.from_path(tmp_path / 'nothing_here')
  with pytest.raises(FileNotFoundError, match='tokenizer.json'):
    HFTokenizer.from_path(tmp_path)  # A directory without the file.


def test_roundtrip_held_out_text(tok_dir):
  tok = HFTokenizer.from_path(tok_dir)
  held_out = _sentences(random.Random(1), 20) + [
      'words never seen: zebra quokka, ünïcödé ✓ 日本',
      '  leading and trailing spaces\n\tand tabs  ']
  for text in held_out:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, np.int32)) == text
  batch = tok.encode_batch(held_out)
  assert batch == [tok.encode(t) for t in held_out]


def test_decode_stops_at_eos_and_skips_specials(tok_dir):
  tok = HFTokenizer.from_path(tok_dir)
  answer, after = tok.encode('the answer is 7'), tok.encode(' junk after')
  ids = [tok.bos_id] + answer + [tok.eos_id] + after + [tok.pad_id] * 3
  assert tok.decode(ids) == 'the answer is 7'
  # Without stopping, EOS/PAD/BOS are dropped but the rest is kept.
  assert tok.decode(ids, stop_at_eos=False) == 'the answer is 7 junk after'
  # Left-padded prompt rows, 2-D arrays flattened as in CharTokenizer.
  row = np.asarray([[tok.pad_id, tok.pad_id, tok.bos_id] + answer])
  assert tok.decode(row) == 'the answer is 7'


def test_decode_keeps_other_added_tokens(tok_dir, trained):
  tok = HFTokenizer.from_path(tok_dir)
  ids = [trained.token_to_id('<|im_start|>')] + tok.encode('cat')
  assert tok.decode(ids) == '<|im_start|>cat'


def test_decode_drops_out_of_range_ids(tok_dir):
  tok = HFTokenizer.from_path(tok_dir)
  ids = tok.encode('big dog')
  noisy = [-1, ids[0], tok.vocab_size, *ids[1:], tok.vocab_size + 1000, -7]
  assert tok.decode(noisy) == 'big dog'
  assert tok.decode(np.asarray(noisy, np.int64)) == 'big dog'


def test_config_overrides_with_dict_tokens(tok_dir, trained):
  _write_config(tok_dir, {
      'eos_token': {'content': '<|im_end|>', 'lstrip': False,
                    'special': True},
      'pad_token': '<|im_start|>',
      'bos_token': None,  # null counts as absent: the vocab guess is used.
  })
  tok = HFTokenizer.from_path(tok_dir)
  assert tok.eos_id == trained.token_to_id('<|im_end|>')
  assert tok.pad_id == trained.token_to_id('<|im_start|>')
  assert tok.bos_id == trained.token_to_id('<s>')
  # Explicit arguments beat the config.
  tok = HFTokenizer.from_path(tok_dir, eos_token='</s>', pad_token='<pad>')
  assert tok.eos_id == trained.token_to_id('</s>')
  assert tok.pad_id == trained.token_to_id('<pad>')
  # The config also applies when loading the file rather than the directory.
  tok = HFTokenizer.from_path(tok_dir / 'tokenizer.json')
  assert tok.eos_id == trained.token_to_id('<|im_end|>')


@pytest.mark.parametrize('field', ['eos_token', 'bos_token', 'pad_token'])
def test_unknown_token_rejected(tok_dir, field):
  with pytest.raises(ValueError, match='not in the vocabulary'):
    HFTokenizer.from_path(tok_dir, **{field: '<nope>'})
  _write_config(tok_dir, {field: '<nope>'})
  with pytest.raises(ValueError, match='not in the vocabulary'):
    HFTokenizer.from_path(tok_dir)


def test_chat_template_renders_and_encodes_specials(tok_dir, trained):
  tok = HFTokenizer.from_path(tok_dir, chat_template=CHATML)
  question = 'what is 2 plus 3'
  expected = ('<|im_start|>{role}\n{content}<|im_end|>\n'.format(
      role='user', content=question) + '<|im_start|>assistant\n')
  assert tok.render_prompt(question) == expected
  with_system = tok.render_prompt(question, system_prompt='be brief')
  assert with_system == ('<|im_start|>system\nbe brief<|im_end|>\n'
                         + expected)

  start_id = trained.token_to_id('<|im_start|>')
  end_id = trained.token_to_id('<|im_end|>')
  ids = tok.encode(expected)
  # The template's markers are single special ids, not byte pieces.
  assert ids[0] == start_id
  assert ids.count(start_id) == 2 and ids.count(end_id) == 1
  assert ids[-len(tok.encode('assistant\n')) - 1] == start_id
  assert tok.encode('<|im_start|>') == [start_id]


def test_no_template_uses_text_as_is(tok_dir):
  tok = HFTokenizer.from_path(tok_dir)
  assert tok.render_prompt('2 plus 3') == '2 plus 3'
  with pytest.raises(ValueError, match='system_prompt'):
    tok.render_prompt('2 plus 3', system_prompt='be brief')


def test_template_sees_special_tokens_and_raise_exception(tok_dir):
  template = ('{% if messages[0].role == "system" %}'
              '{{ raise_exception("no system turns") }}{% endif %}'
              '{{ bos_token }}{{ messages[0].content }}{{ eos_token }}')
  tok = HFTokenizer.from_path(tok_dir, chat_template=template)
  assert tok.render_prompt('hi') == '<s>hi</s>'
  with pytest.raises(ValueError, match='no system turns'):
    tok.render_prompt('hi', system_prompt='x')


def test_template_is_sandboxed(tok_dir):
  template = '{{ messages.__class__.__mro__ }}'
  tok = HFTokenizer.from_path(tok_dir, chat_template=template)
  with pytest.raises(Exception, match='unsafe|access'):
    tok.render_prompt('hi')


def test_auto_template_from_config(tok_dir):
  with pytest.raises(ValueError, match='no chat template'):
    HFTokenizer.from_path(tok_dir, chat_template='auto')
  _write_config(tok_dir, {'chat_template': CHATML})
  auto = HFTokenizer.from_path(tok_dir, chat_template='auto')
  explicit = HFTokenizer.from_path(tok_dir, chat_template=CHATML)
  assert auto.render_prompt('hello') == explicit.render_prompt('hello')
  assert auto.render_prompt('hello').startswith('<|im_start|>user\nhello')


def test_auto_template_from_jinja_file(tok_dir):
  (tok_dir / 'chat_template.jinja').write_text(CHATML)
  tok = HFTokenizer.from_path(tok_dir, chat_template='auto')
  assert tok.render_prompt('hello') == (
      '<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n')


def test_missing_eos_raises(tmp_path):
  _train(specials=('<pad>', '<s>')).save(str(tmp_path / 'tokenizer.json'))
  with pytest.raises(ValueError, match='no EOS token') as info:
    HFTokenizer.from_path(tmp_path)
  assert "'</s>'" in str(info.value)  # It lists the names tried.


def test_pad_falls_back_to_eos(tmp_path):
  trained = _train(specials=('<s>', '</s>'))
  trained.save(str(tmp_path / 'tokenizer.json'))
  tok = HFTokenizer.from_path(tmp_path)
  assert tok.pad_id == tok.eos_id == trained.token_to_id('</s>')
  ids = tok.encode('a red tree') + [tok.eos_id] + [tok.pad_id] * 4
  assert tok.decode(ids) == 'a red tree'


def test_bos_may_be_absent(tmp_path):
  trained = _train(specials=('<|endoftext|>',))
  trained.save(str(tmp_path / 'tokenizer.json'))
  tok = HFTokenizer.from_path(tmp_path, chat_template='{{ bos_token }}|'
                              '{{ messages[0].content }}')
  assert tok.bos_id is None
  assert tok.eos_id == tok.pad_id == trained.token_to_id('<|endoftext|>')
  assert tok.render_prompt('hi') == '|hi'  # bos_token renders as ''.


def test_generation_config_eos_list_gives_stop_ids(tok_dir, trained):
  """Qwen3-style: tokenizer_config names one EOS, generation_config lists
  both end ids; a completion ends at whichever comes first."""
  _write_config(tok_dir, {'eos_token': '<|im_end|>'})
  im_end, eot = trained.token_to_id('<|im_end|>'), trained.token_to_id('</s>')
  (tok_dir / 'generation_config.json').write_text(
      json.dumps({'eos_token_id': [im_end, eot], 'top_p': 0.8}))
  tok = HFTokenizer.from_path(tok_dir)
  assert tok.eos_id == im_end and tok.stop_ids == (eot,)
  answer, after = tok.encode('the answer is 7'), tok.encode(' junk')
  assert tok.decode(answer + [eot] + after + [im_end]) == 'the answer is 7'
  assert tok.decode(answer + [eot] + after, stop_at_eos=False) == (
      'the answer is 7 junk')
  # An explicit list replaces the file's; [] leaves EOS alone.
  assert HFTokenizer.from_path(tok_dir, stop_tokens=[]).stop_ids == ()
  assert HFTokenizer.from_path(
      tok_dir, stop_tokens=['<pad>']).stop_ids == (trained.token_to_id('<pad>'),)
  # A single int is the EOS itself: no further stop ids.
  (tok_dir / 'generation_config.json').write_text(
      json.dumps({'eos_token_id': im_end}))
  assert HFTokenizer.from_path(tok_dir).stop_ids == ()


@pytest.mark.parametrize('value,match', [([10 ** 6], 'not in the vocabulary'),
                                         ('</s>', 'int or a list of ints')])
def test_generation_config_bad_eos_ids_rejected(tok_dir, value, match):
  (tok_dir / 'generation_config.json').write_text(
      json.dumps({'eos_token_id': value}))
  with pytest.raises(ValueError, match=match):
    HFTokenizer.from_path(tok_dir)
  with pytest.raises(ValueError, match='list of token strings'):
    HFTokenizer.from_path(tok_dir, stop_tokens='</s>')
