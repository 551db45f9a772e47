"""RewardPool: worker processes give the in-process scores, in order,
survive the signals a preempted job's process group gets, and stop a call
that runs past the time limit without losing the others."""
import os
import signal
import time

import numpy as np
import pytest

from foremoe_jax.tasks import rewards
from foremoe_jax.tasks.reward_pool import RewardPool


def _pairs(n, seed=0):
  rng = np.random.default_rng(seed)
  refs = [str(int(x)) for x in rng.integers(0, 100, n)]
  texts = [f'so {r} #### {r}' if rng.random() < 0.5 else f'{int(r) + 1}'
           for r in refs]
  return texts, refs


def test_workers_score_like_the_process_itself_in_order():
  texts, refs = _pairs(37)
  want = [rewards.numeric_reward(t, r) for t, r in zip(texts, refs)]
  assert 0 < sum(want) < len(want)
  pool = RewardPool(rewards.get_reward('math'), num_workers=2)
  try:
    assert pool(texts, refs) == want  # math agrees with numeric here.
    # Workers ignore SIGINT (a Ctrl-C reaches the whole process group): the
    # pool still scores afterwards.
    for w in pool._workers:  # pylint: disable=protected-access
      os.kill(w.process.pid, signal.SIGINT)
    assert pool(texts[:5], refs[:5]) == want[:5]
  finally:
    pool.close()
  assert RewardPool(rewards.numeric_reward)(texts, refs) == want
  assert RewardPool(rewards.numeric_reward, 2)([], []) == []


def test_a_function_that_cannot_travel_is_refused_up_front():
  fn = lambda text, ref: 1.0  # pylint: disable=unnecessary-lambda-assignment
  with pytest.raises(ValueError, match='importable module'):
    RewardPool(fn, num_workers=2)
  assert RewardPool(fn)(['a'], ['b']) == [1.0]  # In-process: any callable.
  with pytest.raises(ValueError, match='>= 0'):
    RewardPool(rewards.numeric_reward, -1)
  with pytest.raises(ValueError, match='references'):
    RewardPool(rewards.numeric_reward)(['a'], [])


def test_benchmark_workload_and_body():
  from foremoe_jax.benchmarks import rewards as bench  # pylint: disable=g-import-not-at-top
  texts, refs = bench.workload(10)
  scores = [rewards.numeric_reward(t, r) for t, r in zip(texts, refs)]
  assert scores == [1.0, 0.0] * 5  # Every other completion is right.
  res = bench.run(6, workers=(2,), repeats=1, reward='numeric')
  assert res['completions'] == 6 and [w['workers'] for w in res['workers']] \
      == [2]
  assert res['in_process_step_s'] > 0 and res['workers'][0]['step_s'] > 0


def misbehaving_reward(text: str, ref: str) -> float:
  """Hangs on 'hang', raises on 'raise', exits on 'die'; else exact match.
  (Top level: the workers import it by name.)"""
  if text == 'hang':
    time.sleep(600)
  if text == 'raise':
    raise ZeroDivisionError('boom')
  if text == 'die':
    os._exit(3)  # pylint: disable=protected-access
  return float(text == ref)


def test_a_call_past_the_time_limit_is_stopped_and_scored_low():
  pool = RewardPool(misbehaving_reward, 2, timeout_s=1.0, timeout_score=-1.0)
  try:
    texts = ['a', 'hang', 'b', 'x', 'hang', 'c', 'd']
    refs = ['a', 'z', 'b', 'y', 'q', 'c', 'd']
    t0 = time.monotonic()
    assert pool(texts, refs) == [1.0, -1.0, 1.0, 0.0, -1.0, 1.0, 1.0]
    # Two limits of 1 s, a replacement worker's start-up, never the 600 s.
    assert time.monotonic() - t0 < 60
    assert pool.last_timeouts == 2 and pool.num_timeouts == 2
    # The stopped workers were replaced: the next call scores as usual.
    assert pool(['a', 'b'], ['a', 'a']) == [1.0, 0.0]
    assert pool.last_timeouts == 0 and pool.num_timeouts == 2
    with pytest.raises(RuntimeError, match='(?s)completion 1.*ZeroDivision'):
      pool(['a', 'raise'], ['a', 'b'])
    with pytest.raises(RuntimeError, match=r'exited \(code 3\)'):
      pool(['die'], ['x'])
    assert pool(['a'], ['a']) == [1.0]  # Restarted after each failure.
  finally:
    pool.close()
  with pytest.raises(ValueError, match='reward_workers >= 1'):
    RewardPool(misbehaving_reward, 0, timeout_s=1.0)
  with pytest.raises(ValueError, match='> 0'):
    RewardPool(misbehaving_reward, 1, timeout_s=0.0)
