"""Verifiers for text tasks, looked up by name from configs.

Sits at the far end of the data flow: a text task turns its problems into
prompt ids for the sampler, the sampler's completions are decoded back to text,
and a reward function from this module scores each completion against the
task's reference answer (the verifier in the RL step, before the GRPO
advantages). Configs name a verifier with a string (`reward = 'math'`), so a
new verifier is either registered here with `register_reward` or given as an
import path, 'pkg.module:function'.

Every reward function has the signature
  (completion_text, reference_answer) -> float
and must not raise on malformed model output: a completion that cannot be
read simply scores 0.0.
"""
from __future__ import annotations

import difflib
import importlib
import math
import re
import threading
from typing import Callable

RewardFn = Callable[[str, str], float]

# Name -> reward function. The one piece of module state: filled by the
# built-ins below at import time and by `register_reward` calls (usually at
# import time of the module defining a verifier). Not locked, since
# registration is expected before any sampling threads start.
_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str, fn: RewardFn | None = None, *,
                    overwrite: bool = False):
  """Registers `fn` under `name`; also usable as `@register_reward(name)`.

  Args:
    name: The name configs use. May not contain ':', which marks an import
      path in `get_reward`.
    fn: The reward function. Leave out to get a decorator.
    overwrite: Replace an existing registration instead of raising.

  Returns:
    `fn` itself, or a decorator that registers and returns its argument.

  Raises:
    ValueError: `name` is taken (and not `overwrite`), empty or holds ':'.
    TypeError: `fn` is not callable.
  """
  if not isinstance(name, str) or not name or ':' in name:
    raise ValueError(f'reward name {name!r} must be a non-empty string '
                     "without ':' (':' marks an import path).")

  def register(f: RewardFn) -> RewardFn:
    if not callable(f):
      raise TypeError(f'reward {name!r} must be callable, got {f!r}.')
    if name in _REWARDS and not overwrite:
      raise ValueError(f'reward {name!r} is already registered; pass '
                       'overwrite=True to replace it.')
    _REWARDS[name] = f
    return f

  if fn is None:
    return register
  return register(fn)


def reward_names() -> list[str]:
  """Registered reward names, sorted."""
  return sorted(_REWARDS)


def get_reward(name: str) -> RewardFn:
  """The reward function called `name`, or the one at import path `name`.

  Args:
    name: A registered name ('math'), or 'pkg.module:function' where the part
      after ':' may be a dotted attribute path ('pkg.mod:Class.method').

  Returns:
    The reward function.

  Raises:
    ValueError: Unknown name (the message suggests the nearest registered
      one), or an import path whose module or attribute is missing or not
      callable.
  """
  if ':' in name:
    return _import_reward(name)
  if name in _REWARDS:
    return _REWARDS[name]
  close = difflib.get_close_matches(name, _REWARDS, n=1)
  hint = f' Did you mean {close[0]!r}?' if close else ''
  raise ValueError(f'unknown reward {name!r}.{hint} Known rewards: '
                   f'{reward_names()}; or give an import path '
                   "'pkg.module:function'.")


def _import_reward(path: str) -> RewardFn:
  """Imports 'pkg.module:attr.path' and checks that it is callable."""
  module_name, _, attr_path = path.partition(':')
  if not module_name or not attr_path:
    raise ValueError(f"reward import path {path!r} must look like "
                     "'pkg.module:function'.")
  try:
    obj = importlib.import_module(module_name)
  except ImportError as err:
    raise ValueError(f'reward import path {path!r}: cannot import module '
                     f'{module_name!r} ({err}).') from err
  for attr in attr_path.split('.'):
    if not hasattr(obj, attr):
      raise ValueError(f'reward import path {path!r}: {module_name!r} has no '
                       f'attribute {attr_path!r}.')
    obj = getattr(obj, attr)
  if not callable(obj):
    raise ValueError(f'reward import path {path!r} names {obj!r}, which is '
                     'not callable.')
  return obj


# Text helpers.


def answer_after_marker(text: str, marker: str = '####') -> str:
  """The text after the last `marker`, stripped, thousands commas removed.

  GSM8K's gold solutions end in '#### 72'; this turns them into the bare
  reference answer. Without the marker, the whole text (stripped) is the
  answer, so already-clean references pass through.
  """
  _, found, after = text.rpartition(marker)
  answer = after if found else text
  # Only commas between digits are thousands separators; a comma in prose
  # ('3, then 4') is kept.
  return re.sub(r'(?<=\d),(?=\d{3}\b)', '', answer.strip())


def _normalize_whitespace(text: str) -> str:
  return ' '.join(text.split())


# A number: optional minus, ASCII or Unicode's U+2212 (not when glued to a
# preceding word or digit, so the '-' in '2023-2024' is a dash, not a sign),
# digits with optional comma-grouped thousands, optional decimals, or a bare
# '.5'; then an optional exponent ('6.02e23', '1E-6').
_NUMBER_RE = re.compile(
    r'(?<![\w.])[-\u2212]?'
    r'(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)'
    r'(?:[eE][-+]?\d+(?!\w))?')


def last_number(text: str) -> float | None:
  """The last number written in `text` ('1,234.5', '-3', '.5', '2e-3'), or
  None."""
  matches = _NUMBER_RE.findall(text)
  if not matches:
    return None
  return float(matches[-1].replace(',', '').replace('\u2212', '-'))


# Built-in verifiers.


@register_reward('exact_match')
def exact_match_reward(completion: str, reference: str) -> float:
  """1.0 iff the texts agree after stripping and collapsing whitespace."""
  return float(_normalize_whitespace(completion) ==
               _normalize_whitespace(reference))


@register_reward('numeric')
def numeric_reward(completion: str, reference: str) -> float:
  """1.0 iff the last numbers of both texts agree to 1e-6 relative.

  A fast, sympy-free verifier for integer or decimal answers (GSM8K): no
  LaTeX, fractions or units. No number in either text scores 0.0.
  """
  pred = last_number(completion)
  gold = last_number(reference)
  if pred is None or gold is None:
    return 0.0
  return float(math.isclose(pred, gold, rel_tol=1e-6))


@register_reward('math')
def math_reward(completion: str, reference: str) -> float:
  """1.0 iff math-verify finds the completion's answer equal to the reference.

  Handles equivalent forms ('\\frac{1}{2}' vs '0.5', '\\boxed{72}' vs '72').
  The reference may be bare LaTeX; the completion's answer is extracted the
  math-verify way (boxed, $...$ or a plain final expression).
  Any failure to parse or compare scores 0.0.
  """
  # Imported here: math_verify pulls in sympy, too slow to load for configs
  # that never use this verifier.
  # pylint: disable=g-import-not-at-top
  import math_verify
  from math_verify.errors import TimeoutException
  # pylint: enable=g-import-not-at-top

  # math-verify bounds parsing and comparison with signal.alarm, which Python
  # only allows in the main thread: elsewhere it raises ValueError (even with
  # raise_on_error=False), which the except below would turn into a silent
  # 0.0 for every completion. Off the main thread we therefore run without a
  # timeout (None disables it; math-verify logs a one-time warning).
  timeout = 5 if threading.current_thread() is threading.main_thread() else None
  try:
    gold = math_verify.parse(reference, parsing_timeout=timeout)
    if not gold:
      # Bare LaTeX references ('(x+1)^2', as in MATH's answers) are found
      # only inside math delimiters; a reference is trusted to be an answer,
      # so wrapping it is safe (a completion is never wrapped).
      gold = math_verify.parse(f'${reference}$', parsing_timeout=timeout)
    pred = math_verify.parse(completion, parsing_timeout=timeout)
    if not gold or not pred:
      return 0.0
    return float(math_verify.verify(gold, pred, timeout_seconds=timeout))
  except (Exception, TimeoutException):  # pylint: disable=broad-except
    # Model output is arbitrary text; a verifier crash must not stop training.
    # TimeoutException derives from BaseException, so it is named explicitly
    # in case an alarm fires outside math-verify's own handlers.
    return 0.0
