"""Tasks: tokenizer, prompts, verifier and warm-start batches."""
import numpy as np
import pytest

from foremoe_jax.tasks import BOS_ID, EOS_ID, PAD_ID, CharTokenizer, get_task
from foremoe_jax.tasks import task_names

ALL_TASKS = ['addition', 'addition3', 'addition_rev', 'addition3_rev',
             'sort', 'sort5']


def _reference_answer(name, prompt_ids):
  """Answer from the ids by digit arithmetic, not via the task's strings."""
  tok = get_task(name).tokenizer
  digit_of = {tok.encode(str(d))[0]: d for d in range(10)}
  body = [int(i) for i in prompt_ids[1:-1]]  # Drop BOS and '='.
  if name.startswith('addition'):
    plus = body.index(tok.encode('+')[0])
    a = sum(digit_of[i] * 10**p for p, i in enumerate(reversed(body[:plus])))
    b = sum(digit_of[i] * 10**p
            for p, i in enumerate(reversed(body[plus + 1:])))
    return str(a + b)[::-1] if name.endswith('_rev') else str(a + b)
  return ''.join(str(d) for d in np.sort([digit_of[i] for i in body]))


def test_tokenizer_roundtrip_and_specials():
  tok = CharTokenizer('0123456789+=')
  assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
  assert tok.vocab_size == 15
  ids = tok.encode('12+7=')
  assert ids == [4, 5, 13, 10, 14]
  assert tok.decode([BOS_ID] + ids + [EOS_ID, 5, PAD_ID]) == '12+7='
  assert tok.decode(ids + [EOS_ID, 5], stop_at_eos=False) == '12+7=$2'
  with pytest.raises(ValueError, match='outside the alphabet'):
    tok.encode('1-2')


@pytest.mark.parametrize('name', ALL_TASKS)
def test_prompts_static_shape_and_deterministic(name):
  task = get_task(name)
  assert task.vocab_size <= 32
  p1 = task.sample_prompts(np.random.default_rng(7), 64)
  p2 = task.sample_prompts(np.random.default_rng(7), 64)
  p3 = task.sample_prompts(np.random.default_rng(8), 64)
  assert p1.shape == (64, task.prompt_len) and p1.dtype == np.int32
  np.testing.assert_array_equal(p1, p2)
  assert not np.array_equal(p1, p3)
  assert (p1[:, 0] == BOS_ID).all()
  assert (p1[:, 1:] >= 3).all() and (p1 < task.vocab_size).all()
  # Problems vary (not one repeated prompt).
  assert len({tuple(r) for r in p1.tolist()}) > 32


@pytest.mark.parametrize('name', ALL_TASKS)
def test_answers_match_reference(name):
  task = get_task(name)
  prompts = task.sample_prompts(0, 200)
  expected = [_reference_answer(name, p) for p in prompts]
  assert task.answers(prompts) == expected
  assert max(len(a) for a in expected) <= task.max_answer_len


def test_addition_hand_examples():
  task = get_task('addition3')
  tok = task.tokenizer
  prompts = np.array([[BOS_ID] + tok.encode(s) for s in
                      ['012+345=', '999+001=', '000+000=']], np.int32)
  assert task.answers(prompts) == ['357', '1000', '0']
  assert task.decode(prompts[0]) == '012+345='
  rev = get_task('addition3_rev')
  assert rev.answers(prompts) == ['753', '0001', '0']
  completion = np.array([tok.encode('753') + [EOS_ID, PAD_ID]])
  assert rev.reward(prompts[:1], completion)[0] == 1.0


def _addition_case(completion_text, partial_credit=0.0, lengths=None,
                   width=None):
  task = get_task('addition', partial_credit=partial_credit)
  tok = task.tokenizer
  prompt = np.array([[BOS_ID] + tok.encode('12+34=')], np.int32)  # -> '46'
  ids = [EOS_ID if c == '$' else tok.encode(c)[0] for c in completion_text]
  width = width or task.completion_len
  comp = np.full((1, width), PAD_ID, np.int32)
  comp[0, :len(ids)] = ids
  lengths = None if lengths is None else np.array([lengths])
  return float(task.reward(prompt, comp, lengths)[0])


@pytest.mark.parametrize('text, partial, lengths, width, expected', [
    ('46$', 0.0, None, None, 1.0),         # Exact.
    ('46$', 0.5, None, None, 1.0),         # Exact beats partial credit.
    ('46$9', 0.0, None, None, 1.0),        # Ids after EOS are ignored.
    ('46$', 0.0, None, 12, 1.0),           # Longer sampler buffer.
    ('47$', 0.0, None, None, 0.0),         # One digit wrong, no credit.
    ('47$', 0.5, None, None, 0.25),        # 0.5 * 1/2 digits.
    ('46', 0.5, None, None, 0.5),          # No EOS: digits right, not exact.
    ('466$', 0.5, None, None, 0.5),        # Extra digit instead of EOS.
    ('4$', 0.5, None, None, 0.25),         # Early EOS.
    ('46$', 0.5, 2, None, 0.5),            # EOS beyond `lengths` is invalid.
    ('46$', 0.5, 1, None, 0.25),           # Second digit beyond `lengths`.
    ('64$', 0.5, None, None, 0.0),         # Digits in the wrong places.
])
def test_reward_hand_cases(text, partial, lengths, width, expected):
  got = _addition_case(text, partial, lengths, width)
  assert got == pytest.approx(expected)


@pytest.mark.parametrize('name', ALL_TASKS)
def test_supervised_batch_is_rewarded_and_masked(name):
  task = get_task(name)
  tokens, mask = task.supervised_batch(np.random.default_rng(3), 32)
  assert tokens.shape == mask.shape == (32, task.sequence_len)
  assert tokens.dtype == np.int32 and mask.dtype == np.float32
  prompts = tokens[:, :task.prompt_len]
  np.testing.assert_array_equal(prompts, task.sample_prompts(3, 32))
  answers = task.answers(prompts)
  np.testing.assert_array_equal(mask.sum(1), [len(a) + 1 for a in answers])
  assert (mask[:, :task.prompt_len] == 0).all()
  for row, m, a in zip(tokens, mask, answers):
    masked = row[m > 0]
    assert masked[-1] == EOS_ID and task.decode(masked) == a
    assert (row[m == 0][task.prompt_len:] == PAD_ID).all()
  completions = tokens[:, task.prompt_len:]
  np.testing.assert_array_equal(task.reward(prompts, completions), 1.0)


def test_registry():
  assert set(ALL_TASKS) <= set(task_names())
  assert get_task('addition', num_digits=3).prompt_len == 9
  assert get_task('sort', partial_credit=0.3).partial_credit == 0.3
  with pytest.raises(ValueError, match='unknown task'):
    get_task('multiply')
