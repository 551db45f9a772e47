"""Sampler decode speed: KV cache vs recompute, and the routing record's cost.

  python -m experiments.bench_sampler --json

Tiny model on 8 simulated CPU devices, mesh (1, 8), addition prompts, batch
64 (8 prompts x 8 generations), 256 new tokens. EOS is disabled so every run
decodes all 256 tokens (a fresh model would otherwise stop at random steps).
Decode tokens/s counts sampled tokens only; prefill is outside the timers.

* cached: `Sampler.decode`, the jit'd while_loop over the donated KV cache.
* recompute (the baseline): `recompute_decode(bucket=16)`, the strongest
  decode without a cache that jit allows: each step reruns the forward on
  the filled prefix only, rounded up to a multiple of 16 columns (one loop
  per width, compiled once), over all 256 steps.
* recompute over the whole buffer: `recompute_decode(bucket=None)`, the
  fixed-length [64, 263] buffer every step (what a single compiled loop
  does). Every step costs the same, so it is timed over --recompute_steps
  steps; beside the baseline, not the headline.
* routing_record_overhead: the cached loop with the record written vs not
  (record_routes=False), as median paired time ratio - 1.
All timings are interleaved repetitions in one process; ratios are medians.

Entry point: experiments/bench_sampler.py.
"""
import functools
import time

import jax
import numpy as np
from flax import nnx

from foremoe_jax.model import sharding, transformer
from foremoe_jax.rollout import recompute, sampler as sampler_lib


def timed(fn, *args, **kw):
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args, **kw))
  return time.perf_counter() - t0


PREFIX_BUCKET = 16  # Columns: the prefix recompute's width step.


def run(cfg, mesh, prompts_NP, *, num_generations, new_tokens, repeats,
        recompute_steps) -> dict:
  model = transformer.Transformer(cfg.model, mesh, rngs=nnx.Rngs(cfg.seed))
  graphdef, state = sharding.split_model(model, mesh)
  common = dict(max_new_tokens=new_tokens, num_generations=num_generations,
                temperature=cfg.sampler.temperature, eos_id=-1)
  samplers = {rec: sampler_lib.Sampler(
      graphdef, cfg.model, mesh,
      sampler_lib.SamplingParams(record_routes=rec, **common))
              for rec in (True, False)}
  key = jax.random.key(cfg.seed)
  batch = prompts_NP.shape[0] * num_generations

  def cached_s(record):
    """(decode loop seconds, prefill + decode + host Rollout seconds)."""
    smp = samplers[record]
    t0 = time.perf_counter()
    carry = jax.block_until_ready(smp.prefill(state, prompts_NP, key))
    t1 = time.perf_counter()
    carry = jax.block_until_ready(smp.decode(state, carry, key))
    t2 = time.perf_counter()
    smp.rollout(carry)
    return t2 - t1, time.perf_counter() - t0

  recompute_fn = jax.jit(functools.partial(
      recompute.recompute_decode, graphdef,
      params=samplers[False].params, num_steps=recompute_steps))
  prefix_fn = jax.jit(functools.partial(
      recompute.recompute_decode, graphdef, params=samplers[False].params,
      bucket=PREFIX_BUCKET))
  prompts_BP = np.repeat(prompts_NP, num_generations, axis=0)
  # Warm-up (compiles), then check the two loops agree on what they decode.
  rollout = samplers[True](state, prompts_NP, key)
  assert rollout.decode_steps == new_tokens
  tokens_BT = np.asarray(recompute_fn(state, prompts_BP, key))
  plen = prompts_NP.shape[1]
  agree = float((tokens_BT[:, plen:plen + recompute_steps] ==
                 rollout.completion_BC[:, :recompute_steps]).mean())
  prefix_BT = np.asarray(prefix_fn(state, prompts_BP, key))
  prefix_agree = float((prefix_BT[:, plen:] == rollout.completion_BC).mean())
  cached_s(False)  # Compiles the no-record sampler.
  times = {'record': [], 'no_record': [], 'recompute': [], 'prefix': []}
  for i in range(repeats):
    times['record'].append(cached_s(True))
    times['no_record'].append(cached_s(False))
    if i < max(3, repeats // 2):  # The slow baselines need fewer samples.
      times['prefix'].append(timed(prefix_fn, state, prompts_BP, key))
      times['recompute'].append(timed(recompute_fn, state, prompts_BP, key))
  record_s2 = np.array(times['record'])  # [repeats, (decode, end to end)]
  no_record_s2 = np.array(times['no_record'])
  cached_tok_s = batch * new_tokens / np.median(record_s2[:, 0])
  prefix_tok_s = batch * new_tokens / np.median(times['prefix'])
  recompute_tok_s = batch * recompute_steps / np.median(times['recompute'])
  overhead_2 = np.median(record_s2 / no_record_s2, axis=0) - 1
  record_bytes = rollout.routes_LBTK.nbytes
  return dict(
      batch=batch, prompt_len=plen, new_tokens=new_tokens,
      cached_tok_s=float(cached_tok_s),
      cached_no_record_tok_s=float(batch * new_tokens
                                   / np.median(no_record_s2[:, 0])),
      # The baseline: the filled prefix, in PREFIX_BUCKET-column widths.
      recompute_prefix_tok_s=float(prefix_tok_s),
      prefix_bucket=PREFIX_BUCKET,
      speedup=float(cached_tok_s / prefix_tok_s),
      # The whole fixed buffer every step.
      recompute_tok_s=float(recompute_tok_s),
      speedup_vs_whole_buffer=float(cached_tok_s / recompute_tok_s),
      routing_record_overhead=float(overhead_2[0]),
      # Prefill + decode + moving the Rollout (record included) to the host.
      routing_record_overhead_end_to_end=float(overhead_2[1]),
      routing_record_bytes=int(record_bytes),
      routing_record_dtype=str(rollout.routes_LBTK.dtype),
      recompute_agreement=agree, recompute_prefix_agreement=prefix_agree,
      repeats=repeats, recompute_steps=recompute_steps,
      # pylint: disable-next=protected-access
      decode_compiles=samplers[True]._decode._cache_size(),
      target_speedup=5.0, target_overhead=0.10)
