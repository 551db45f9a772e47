"""Reward registry and the built-in verifiers (exact_match, numeric, math)."""
from __future__ import annotations

import sys
import textwrap
import threading

import pytest

from foremoe_jax.tasks import rewards
from foremoe_jax.tasks.rewards import answer_after_marker, get_reward
from foremoe_jax.tasks.rewards import register_reward, reward_names

BUILTINS = ('exact_match', 'math', 'numeric')


@pytest.fixture
def clean_registry():
  """Yields a list; names appended to it are unregistered afterwards.

  Built-ins a test overwrites are restored too, so no test leaks into another.
  """
  saved = dict(rewards._REWARDS)  # pylint: disable=protected-access
  added = []
  yield added
  for name in added:
    rewards._REWARDS.pop(name, None)  # pylint: disable=protected-access
  rewards._REWARDS.update(saved)  # pylint: disable=protected-access
  assert reward_names() == sorted(saved)


# Built-ins.


def test_builtins_registered():
  assert set(BUILTINS) <= set(reward_names())
  assert reward_names() == sorted(reward_names())


@pytest.mark.parametrize('completion, reference, expected', [
    ('42', '42', 1.0),
    ('  42\n', '42', 1.0),
    ('the  answer\tis\n\n 7', 'the answer is 7', 1.0),
    ('the answer is 7', 'the answer is 8', 0.0),
    ('theansweris 7', 'the answer is 7', 0.0),  # Whitespace is not dropped.
    ('', '', 1.0),
    ('', '0', 0.0),
])
def test_exact_match(completion, reference, expected):
  assert get_reward('exact_match')(completion, reference) == expected


@pytest.mark.parametrize('completion, reference, expected', [
    ('so the total is 1,234 dollars', '1234', 1.0),
    ('1234', '#### 1,234', 1.0),
    ('it drops to -17 degrees', '-17', 1.0),
    ('it drops to 17 degrees', '-17', 0.0),
    ('2023-2024 season: 5 wins', '5', 1.0),  # A dash is not a minus sign.
    ('pi is about 3.14159.', '3.14159', 1.0),
    ('half is .5', '0.5', 1.0),
    ('first 3, then 4, finally 10', '10', 1.0),  # The last number counts.
    ('first 10, then 3', '10', 0.0),
    ('1000000.0000001', '1000000', 1.0),  # Within 1e-6 relative.
    ('1000002', '1000000', 0.0),  # 2e-6 relative: outside.
    ('about 6.02e23 atoms', '602000000000000000000000', 1.0),
    ('the rate is 1E-6 per s', '0.000001', 1.0),
    ('1e5', '1', 0.0),  # The exponent belongs to the number.
    ('it drops to \u221217 degrees', '-17', 1.0),  # Unicode minus sign.
    ('it drops to \u221217 degrees', '17', 0.0),
    ('no number here', '3', 0.0),
    ('3', 'no reference number', 0.0),
    ('', '', 0.0),
])
def test_numeric(completion, reference, expected):
  assert get_reward('numeric')(completion, reference) == expected


@pytest.mark.parametrize('text, expected', [
    ('She has 9 - 2 = 7 apples.\n#### 7', '7'),
    ('#### 1,234', '1234'),
    ('a #### b\n####  1,234,567 \n', '1234567'),  # The last marker counts.
    ('  72  ', '72'),  # No marker: the stripped text.
    ('#### 3, then 4', '3, then 4'),  # Prose commas are not thousands.
])
def test_answer_after_marker(text, expected):
  assert answer_after_marker(text) == expected


def test_answer_after_marker_custom_marker():
  assert answer_after_marker('work... ANSWER: 12,000', marker='ANSWER:') == (
      '12000')


# math (math-verify imported only by these tests, through the reward).


@pytest.mark.parametrize('completion, reference, expected', [
    ('$\\frac{1}{2}$', '0.5', 1.0),
    ('0.5', '\\frac{1}{2}', 1.0),
    ('The answer is $\\boxed{72}$', '72', 1.0),
    ('The answer is $\\boxed{71}$', '72', 0.0),
    ('$x^2 + 2x + 1$', '(x+1)^2', 1.0),  # Bare LaTeX reference.
    ('$x^2 + 2x + 1$', '$(x+1)^2$', 1.0),
    ('$x^2 + 2x + 2$', '(x+1)^2', 0.0),
    ('I do not know', '72', 0.0),  # Nothing to parse.
    ('72', '', 0.0),  # Empty reference.
])
def test_math(completion, reference, expected):
  assert get_reward('math')(completion, reference) == expected


def test_math_off_main_thread():
  """math-verify's signal.alarm timeout would fail here if left on."""
  cases = [('$\\frac{1}{2}$', '0.5', 1.0), ('$\\boxed{72}$', '72', 1.0),
           ('$\\boxed{71}$', '72', 0.0)]
  results = {}

  def work():
    assert threading.current_thread() is not threading.main_thread()
    for i, (completion, reference, _) in enumerate(cases):
      results[i] = get_reward('math')(completion, reference)

  thread = threading.Thread(target=work)
  thread.start()
  thread.join(timeout=60)
  assert not thread.is_alive()
  assert results == {i: expected for i, (_, _, expected) in enumerate(cases)}


# Registry.


def test_register_as_call_and_decorator(clean_registry):
  clean_registry.extend(['test_len_call', 'test_len_deco'])

  def by_call(completion, reference):
    return float(len(completion) == len(reference))

  assert register_reward('test_len_call', by_call) is by_call

  @register_reward('test_len_deco')
  def by_decorator(completion, reference):
    return float(len(completion) == len(reference))

  assert callable(by_decorator)  # The decorator returns the function.
  assert get_reward('test_len_call') is by_call
  assert get_reward('test_len_deco') is by_decorator
  assert {'test_len_call', 'test_len_deco'} <= set(reward_names())
  assert get_reward('test_len_deco')('abc', 'xyz') == 1.0


def test_register_duplicate_and_overwrite(clean_registry):
  clean_registry.append('test_dup')

  def first(completion, reference):
    del completion, reference
    return 0.0

  def second(completion, reference):
    del completion, reference
    return 1.0

  register_reward('test_dup', first)
  with pytest.raises(ValueError, match='already registered'):
    register_reward('test_dup', second)
  assert get_reward('test_dup') is first
  register_reward('test_dup', second, overwrite=True)
  assert get_reward('test_dup') is second


def test_overwrite_builtin(clean_registry):
  # clean_registry restores the built-in afterwards; the next test checks.
  del clean_registry
  register_reward('exact_match', lambda c, r: 0.5, overwrite=True)
  assert get_reward('exact_match')('a', 'a') == 0.5


def test_builtin_restored_after_overwrite():
  assert get_reward('exact_match')('a', 'a') == 1.0


@pytest.mark.parametrize('name', ['', 'a:b'])
def test_register_bad_name(name):
  with pytest.raises(ValueError):
    register_reward(name, lambda c, r: 0.0)


def test_register_not_callable(clean_registry):
  clean_registry.append('test_not_callable')
  with pytest.raises(TypeError):
    register_reward('test_not_callable', 3)
  assert 'test_not_callable' not in reward_names()


def test_unknown_name_suggests_nearest():
  with pytest.raises(ValueError) as info:
    get_reward('exact_mach')
  message = str(info.value)
  assert "'exact_match'?" in message  # The suggestion.
  for name in BUILTINS:
    assert repr(name) in message  # The full list.


def test_unknown_name_without_close_match():
  with pytest.raises(ValueError, match='unknown reward') as info:
    get_reward('zzzzzzzz')
  assert 'Did you mean' not in str(info.value)


# Import paths.


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
  """A module `my_test_rewards` on sys.path, unloaded afterwards."""
  name = 'my_test_rewards'
  (tmp_path / f'{name}.py').write_text(textwrap.dedent("""\
      def starts_same(completion, reference):
        return float(completion[:1] == reference[:1])

      class Holder:
        @staticmethod
        def always_one(completion, reference):
          return 1.0

      NOT_CALLABLE = 3
      """))
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, name, raising=False)
  yield name
  sys.modules.pop(name, None)


def test_import_path(reward_module):
  fn = get_reward(f'{reward_module}:starts_same')
  assert fn('apple', 'avocado') == 1.0
  assert fn('apple', 'banana') == 0.0
  assert get_reward(f'{reward_module}:Holder.always_one')('x', 'y') == 1.0
  # An import path does not register anything.
  assert f'{reward_module}:starts_same' not in reward_names()


def test_import_path_of_library_function():
  assert get_reward('foremoe_jax.tasks.rewards:numeric_reward') is (
      get_reward('numeric'))


@pytest.mark.parametrize('suffix, match', [
    (':missing', 'no attribute'),
    (':NOT_CALLABLE', 'not callable'),
    (':', 'must look like'),
])
def test_import_path_errors(reward_module, suffix, match):
  with pytest.raises(ValueError, match=match):
    get_reward(reward_module + suffix)


def test_import_path_missing_module():
  with pytest.raises(ValueError, match='cannot import module'):
    get_reward('no_such_module_xyz:fn')
