"""Verifier cost per RL step: math-verify in-process vs in worker processes.

The workload is GSM8K-shaped: completions of a few sentences of working with
numbers in them, ending in '#### <answer>', half of them right. Each
configuration scores the same completions; repetitions are interleaved, so
machine noise hits every configuration alike. Pool start-up (spawning the
workers, importing sympy in each) is reported apart from the steady-state
step, because a run pays it once.
"""
from __future__ import annotations

import time

import numpy as np

from foremoe_jax.tasks import rewards
from foremoe_jax.tasks.reward_pool import RewardPool

_WORDS = ('so', 'then', 'each', 'box', 'holds', 'and', 'she', 'buys', 'more',
          'left', 'total', 'is')


def workload(n: int, seed: int = 0, sentences: int = 6):
  """(completions, references): n GSM8K-like texts, every other one right."""
  rng = np.random.default_rng(seed)
  texts, refs = [], []
  for i in range(n):
    answer = int(rng.integers(1, 1000))
    lines = []
    for _ in range(sentences):
      a, b = (int(x) for x in rng.integers(1, 100, 2))
      words = ' '.join(rng.choice(_WORDS, 5))
      lines.append(f'{words} {a} + {b} = {a + b}.')
    final = answer if i % 2 == 0 else answer + 1
    texts.append(' '.join(lines) + f' #### {final}')
    refs.append(str(answer))
  return texts, refs


def run(num_completions: int, workers: tuple[int, ...], repeats: int,
        reward: str = 'math') -> dict:
  texts, refs = workload(num_completions)
  fn = rewards.get_reward(reward)
  want = [fn(t, r) for t, r in zip(texts, refs)]  # Warm: imports sympy.
  pools, startup_s = {0: RewardPool(fn, 0)}, {}
  for w in workers:
    t0 = time.perf_counter()
    pools[w] = RewardPool(fn, w)
    assert pools[w](texts, refs) == want, 'workers scored differently'
    startup_s[w] = time.perf_counter() - t0
  times = {w: [] for w in pools}
  numeric = rewards.get_reward('numeric')
  times['numeric'] = []
  for _ in range(repeats):
    for w, pool in pools.items():
      t0 = time.perf_counter()
      pool(texts, refs)
      times[w].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for t, r in zip(texts, refs):
      numeric(t, r)
    times['numeric'].append(time.perf_counter() - t0)
  for pool in pools.values():
    pool.close()
  med = {w: float(np.median(v)) for w, v in times.items()}
  return dict(
      reward=reward, completions=num_completions,
      mean_completion_chars=float(np.mean([len(t) for t in texts])),
      in_process_step_s=med[0],
      in_process_ms_per_completion=med[0] / num_completions * 1e3,
      numeric_step_s=med['numeric'],
      workers=[dict(workers=w, step_s=med[w], speedup=med[0] / med[w],
                    first_call_with_startup_s=startup_s[w])
               for w in workers])
