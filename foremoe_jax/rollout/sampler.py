"""The sampler: prompts -> completions, their log-probs and the routing record.

First stage of the RL step (docs/design.md §2). One prefill call runs the
prompts through the model and fills a preallocated KV cache; a jit'd
`lax.while_loop` then decodes one token per step over that cache (donated, so
it is updated in place) until every sequence has emitted EOS or
`max_new_tokens` are out.
Along the way it records, for every MoE layer, the top-k experts of every
token fed to the model: the routing record that foresight turns into exact
per-micro-step loads and that recompute/update replay (R3).

Shape letters: N prompts, G generations per prompt, B = N * G samples
(padded to Bp rows inside, see below), P prompt tokens, C completion tokens
(= max_new_tokens), T = P + C, V vocab, L MoE layers, K top-k, E experts.
Inside jit, arrays named _B hold the Bp rows, and X is a column axis one
longer than T (tokens) or C (log-probs), for the extra call's throwaway
sample.

Position conventions (what RL must reproduce):
  * tokens_BT[:, :P] is the prompt, tokens_BT[:, P:] the completion
    (completion_BC); after a sequence's EOS the sampler writes PAD.
  * logp_BC[b, c] = log_softmax(logits)[tokens_BT[b, P + c]], with logits the
    model's *raw* output (temperature 1, no top-k/top-p) at position P + c - 1,
    i.e. given tokens_BT[b, :P + c]. This is what the old-policy recompute
    reproduces: a forward over tokens_BT[:, :-1] gives logits_B(T-1)V whose
    shifted log-probs at [:, P - 1:] equal logp_BC on valid positions. The
    sampling distribution itself (temperature, top-k, top-p, greedy) is NOT
    what logp_BC measures. 0 where the completion token is not valid.
  * routes_LBTK[l, b, t] = top-k expert ids of tokens_BT[b, t] at MoE layer l,
    for every t in [0, T), position T - 1 included: the decode loop makes one
    extra model call on the last sampled token when a sequence runs to
    max_new_tokens, so the record covers every valid position, and RL, which
    feeds tokens_BT[:, :-1], replays routes_LBTK[:, :, :-1]. Invalid positions
    hold the router's choice for the PAD fed there, or 0 (a legal expert id)
    where nothing was fed because the whole batch had finished: never use
    them.
  * valid_BT = prompt positions and completion positions up to and including
    EOS (or all C when there is no EOS). Padding tokens are not dispatched to
    experts while sampling, matching what recompute does with valid_BT.
  * Prompts of different lengths come left-padded with PAD to one width P
    (dataset tasks): a prompt's leading PADs are not valid, so dense
    attention never sees them as keys and the experts never see them (see
    `prompt_valid`). Generated tasks have no leading PADs and every prompt
    position is valid.

Batch padding: the expert-parallel layer needs every call's token count to
split over the mesh's devices, and a decode step feeds one token per row, so
the B rows are padded to a multiple of the device count with invalid rows
(never dispatched, dropped before returning).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax import config as config_lib
from foremoe_jax.foresight import device_counts
from foremoe_jax.model import expert_parallel
from foremoe_jax.tasks.tokenizer import EOS_ID, PAD_ID
from foremoe_jax.utils import distributed


@dataclasses.dataclass(frozen=True)
class Rollout:
  """One batch of samples. See the module docstring.

  Everything is on the host (numpy) except the routing record, which stays
  on device for the RL step to replay (`routes_device_LBTK`); the host gets
  its per-sample counts (`counts_BLE`, what the planner needs), and
  `routes_LBTK` copies the record to the host only when asked.
  """

  tokens_BT: np.ndarray  # int32: prompt + completion, PAD after EOS.
  completion_BC: np.ndarray  # int32: tokens_BT[:, P:].
  logp_BC: np.ndarray  # float32: log_softmax(raw logits)[token]; 0 if invalid.
  lengths_B: np.ndarray  # int32: completion tokens, EOS included.
  done_B: np.ndarray  # bool: the completion holds an EOS.
  valid_BT: np.ndarray  # bool: prompt + completion up to and including EOS.
  prompt_len: int  # P.
  decode_steps: int  # Model calls after prefill (< C when all stop early).
  # int8/int16/int32 routing record [L, Bp, T, K] on device, rows padded to
  # the mesh (sample b is row b); None when not recorded.
  routes_device_LBTK: jax.Array | None = None
  # int64 [B, L, E]: each sample's valid assignments per layer and expert
  # over the positions the RL step feeds (0..T-2), counted on device.
  counts_BLE: np.ndarray | None = None

  @functools.cached_property
  def routes_LBTK(self) -> np.ndarray | None:
    """The routing record on the host, [L, B, T, K] (a copy, made once)."""
    if self.routes_device_LBTK is None:
      return None
    routes = distributed.to_host(self.routes_device_LBTK)
    return routes[:, :self.tokens_BT.shape[0]]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings; one compile per distinct value.

  temperature == 0 or greedy=True: argmax. top_k = 0 and top_p = 1 are off.
  A completion ends at eos_id or at any of stop_ids (a checkpoint's other
  end-of-turn ids). record_routes=False skips the routing record (for
  measuring its cost).
  """

  max_new_tokens: int
  num_generations: int = 1
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False
  eos_id: int = EOS_ID
  pad_id: int = PAD_ID
  record_routes: bool = True
  stop_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(
          f'max_new_tokens must be >= 1, got {self.max_new_tokens}.')
    if self.num_generations < 1:
      raise ValueError(
          f'num_generations must be >= 1, got {self.num_generations}.')
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}.')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0 (0 = off), got {self.top_k}.')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}.')
    # A tuple of ints, so the params stay hashable (a static jit argument).
    object.__setattr__(self, 'stop_ids',
                       tuple(int(i) for i in self.stop_ids))

  @property
  def is_greedy(self) -> bool:
    return self.greedy or self.temperature == 0


def routes_dtype(num_experts: int):
  """Narrowest signed int holding ids [0, E): the record is L*T*K per sample."""
  if num_experts <= 127:
    return jnp.int8
  if num_experts <= 32767:
    return jnp.int16
  return jnp.int32


def sample_tokens(logits_BV, key, params: SamplingParams):
  """Next token per row from f32 logits under temperature / top-k / top-p."""
  if params.is_greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  x_BV = logits_BV.astype(jnp.float32) / params.temperature
  neg = jnp.finfo(jnp.float32).min
  if params.top_k:
    kth_B1 = jax.lax.top_k(x_BV, min(params.top_k, x_BV.shape[-1]))[0][:, -1:]
    x_BV = jnp.where(x_BV < kth_B1, neg, x_BV)
  if params.top_p < 1:
    # Nucleus: keep the smallest prefix of the sorted distribution whose mass
    # reaches top_p; a token is kept when the mass strictly before it is
    # < top_p, so the most likely token always survives.
    sorted_BV = -jnp.sort(-x_BV, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept = jnp.where(before_BV < params.top_p, sorted_BV, jnp.inf)
    x_BV = jnp.where(x_BV < kept.min(axis=-1, keepdims=True), neg, x_BV)
  return jax.random.categorical(key, x_BV, axis=-1).astype(jnp.int32)


def prompt_valid(prompts_BP, pad_id: int):
  """bool [B, P]: False at a prompt's leading PADs (left padding), True
  from its first other token on. Works on numpy and jax arrays."""
  xp = jnp if isinstance(prompts_BP, jax.Array) else np
  return xp.cumsum(prompts_BP != pad_id, axis=1) > 0


def ends(tokens, params: SamplingParams):
  """bool, tokens' shape: where a token ends its completion (EOS or a stop
  id). Works on numpy and jax arrays."""
  end = tokens == params.eos_id
  for i in params.stop_ids:
    end = end | (tokens == i)
  return end


def check_prompts(prompts_NP, pad_id: int) -> None:
  """Refuses prompts the sampler would read wrongly: only LEADING PADs are
  padding (`prompt_valid`), so a right-padded prompt's trailing PADs would
  be fed as text and the completion would follow them; an all-PAD row has
  no token to condition on."""
  prompts_NP = np.asarray(prompts_NP)
  if prompts_NP.ndim != 2 or prompts_NP.shape[1] == 0:
    raise ValueError(f'prompts must be int [N, P] with P >= 1, got shape '
                     f'{prompts_NP.shape}.')
  empty = np.flatnonzero((prompts_NP == pad_id).all(axis=1))
  if empty.size:
    raise ValueError(f'prompt rows {empty[:8].tolist()} are all PAD '
                     f'({pad_id}): every prompt needs at least one token.')
  right = np.flatnonzero(prompts_NP[:, -1] == pad_id)
  if right.size:
    raise ValueError(
        f'prompt rows {right[:8].tolist()} end with PAD ({pad_id}): prompts '
        f'must be left-padded (PADs first, the text ending at column P - 1), '
        f'since only leading PADs are hidden; a right-padded prompt would be '
        f'continued after its PADs.')


def _token_logp(logits_BV, tokens_B):
  logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]


class DecodeState(NamedTuple):
  """The decode loop's carry (device arrays, rows padded to Bp).

  Column P + step of tokens_BX is the next token to feed.
  """

  step: jax.Array  # int32 []: decode calls made so far.
  row_valid_B: jax.Array  # bool: a real sample, not batch padding.
  alive_B: jax.Array  # bool: the token to feed is a valid completion token.
  # int32 [Bp, T + 1]; the last column takes the throwaway sample of the
  # extra call on position T - 1.
  tokens_BX: jax.Array
  logp_BX: jax.Array  # float32 [Bp, C + 1].
  routes_LBTK: jax.Array | None  # The routing record, in routes_dtype(E).
  cache: list  # KVCache per layer, [Bp, T, G, D].


def _call_capacity(capacity, num_tokens: int, top_k: int, mesh,
                   dispatch: str):
  # A source token sends a device at most top_k rows, so the dropless
  # bound with s = top_k bounds any placement's: clamping keeps a capacity
  # dropless-equivalent and avoids padded buffers for the one-token decode
  # calls.
  if capacity is None:
    return None
  return int(min(capacity, config_lib.dropless_capacity(
      dispatch, num_tokens // mesh.size, top_k,
      mesh.shape[expert_parallel.EXPERT], top_k)))


class Sampler:
  """Jit'd prefill and decode for one model graph and one SamplingParams.

  Build once and call many times: the jitted functions live on the instance,
  so each (batch, prompt length) shape compiles once. `__call__` is
  `prefill` -> `decode` -> `rollout`; the steps are public for benchmarks.
  """

  def __init__(self, graphdef, model_cfg, mesh, params: SamplingParams,
               dispatch: str = 'exact'):
    """dispatch: the model's `parallel.dispatch` (what a capacity means)."""
    self.graphdef, self.cfg, self.mesh, self.params = (graphdef, model_cfg,
                                                       mesh, params)
    self.dispatch = dispatch
    self.record_dtype = routes_dtype(int(model_cfg.num_experts))
    # Every per-sample array is split by rows like the tokens of a one-token
    # decode call, so attention and the cache stay local to a device.
    self._rows = NamedSharding(
        mesh, P((expert_parallel.DATA, expert_parallel.EXPERT)))
    self._init_cache = jax.jit(self._init_cache_fn, static_argnums=(1, 2))
    self._prefill = jax.jit(self._prefill_fn, static_argnames=('capacity',),
                            donate_argnames=('cache',))
    self._decode = jax.jit(self._decode_fn, static_argnames=('capacity',),
                           donate_argnames=('carry',))
    self._count = device_counts.make_counter(mesh, model_cfg.num_experts)

  # Device side: pure functions of (state, batch, plan).

  def _init_cache_fn(self, state, batch: int, max_len: int):
    cache = nnx.merge(self.graphdef, state).init_cache(batch, max_len)
    return jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(a, self._rows), cache)

  def _prefill_fn(self, state, prompts_BP, row_valid_B, key, placement, cache,
                  *, capacity):
    p = self.params
    num_rows, plen = prompts_BP.shape
    model = nnx.merge(self.graphdef, state)
    valid_BP = row_valid_B[:, None] & prompt_valid(prompts_BP, p.pad_id)
    logits_BPV, aux, cache = model(
        prompts_BP, valid_BT=valid_BP, placement=placement, capacity=capacity,
        cache=cache, cache_index=0)
    tok_B = sample_tokens(logits_BPV[:, -1], jax.random.fold_in(key, 0), p)
    tok_B = jnp.where(row_valid_B, tok_B, p.pad_id)
    total = plen + p.max_new_tokens
    tokens_BX = jnp.full((num_rows, total + 1), p.pad_id, jnp.int32)
    tokens_BX = tokens_BX.at[:, :plen].set(prompts_BP).at[:, plen].set(tok_B)
    logp_BX = jnp.zeros((num_rows, p.max_new_tokens + 1), jnp.float32)
    logp_BX = logp_BX.at[:, 0].set(
        jnp.where(row_valid_B, _token_logp(logits_BPV[:, -1], tok_B), 0.0))
    routes = None
    if p.record_routes:
      num_layers, _, _, top_k = aux.routes_LBTK.shape
      routes = jnp.zeros((num_layers, num_rows, total, top_k),
                         self.record_dtype)
      routes = routes.at[:, :, :plen].set(aux.routes_LBTK.astype(routes.dtype))
      # Split by rows like the rest (never replicated: at scale the record
      # is gigabytes), and so is every decode step's update of it.
      routes = jax.lax.with_sharding_constraint(routes, NamedSharding(
          self.mesh, P(None, (expert_parallel.DATA, expert_parallel.EXPERT))))
    return DecodeState(jnp.zeros((), jnp.int32), row_valid_B, row_valid_B,
                       tokens_BX, logp_BX, routes, cache)

  def _decode_fn(self, state, carry: DecodeState, key, placement, *,
                 capacity):
    p = self.params
    plen = carry.tokens_BX.shape[1] - 1 - p.max_new_tokens
    model = nnx.merge(self.graphdef, state)

    def cond(c: DecodeState):
      return (c.step < p.max_new_tokens) & jnp.any(c.alive_B)

    def body(c: DecodeState):
      pos = plen + c.step
      tok_B1 = jax.lax.dynamic_slice_in_dim(c.tokens_BX, pos, 1, axis=1)
      logits_B1V, aux, cache = model(
          tok_B1, valid_BT=c.alive_B[:, None], placement=placement,
          capacity=capacity, cache=c.cache, cache_index=pos)
      routes = c.routes_LBTK
      if routes is not None:
        routes = jax.lax.dynamic_update_slice_in_dim(
            routes, aux.routes_LBTK.astype(routes.dtype), pos, axis=2)
      new_B = sample_tokens(logits_B1V[:, 0],
                            jax.random.fold_in(key, c.step + 1), p)
      # The next token is valid iff the one just fed was valid and not EOS.
      alive_B = c.alive_B & ~ends(tok_B1[:, 0], p)
      new_B = jnp.where(alive_B, new_B, p.pad_id)
      lp_B = jnp.where(alive_B, _token_logp(logits_B1V[:, 0], new_B), 0.0)
      tokens_BX = jax.lax.dynamic_update_slice_in_dim(
          c.tokens_BX, new_B[:, None], pos + 1, axis=1)
      logp_BX = jax.lax.dynamic_update_slice_in_dim(
          c.logp_BX, lp_B[:, None], c.step + 1, axis=1)
      return DecodeState(c.step + 1, c.row_valid_B, alive_B, tokens_BX,
                         logp_BX, routes, cache)

    return jax.lax.while_loop(cond, body, carry)

  # Host side.

  def __call__(self, state, prompts_NP, key, *, placement=None,
               capacity: int | None = None) -> Rollout:
    """Samples num_generations completions of each prompt.

    Args:
      state: the model state (from `sharding.split_model`).
      prompts_NP: int32 [N, P] prompts; shorter ones left-padded with PAD.
      key: a jax.random key.
      placement: optional Placement for the MoE layers (None = identity).
      capacity: optional static capacity of the MoE layers (a device's
        received rows, or a cell with padded dispatch); clamped per call to
        the dropless bound (None = dropless).
    Returns:
      A Rollout with B = N * num_generations rows, prompt i's samples at rows
      [i * G, (i + 1) * G) (GRPO groups are consecutive).
    """
    carry = distributed.settle(self.prefill(
        state, prompts_NP, key, placement=placement, capacity=capacity))
    carry = self.decode(state, carry, key, placement=placement,
                        capacity=capacity)
    return self.rollout(carry)

  def prefill(self, state, prompts_NP, key, *, placement=None,
              capacity: int | None = None) -> DecodeState:
    """Repeats and pads the prompts, allocates the cache, runs the prompts."""
    p = self.params
    check_prompts(prompts_NP, p.pad_id)
    prompts_BP = np.repeat(np.asarray(prompts_NP, np.int32), p.num_generations,
                           axis=0)
    num_samples, plen = prompts_BP.shape
    total = plen + p.max_new_tokens
    if total > self.cfg.max_seq_len:
      raise ValueError(
          f'prompt ({plen}) + max_new_tokens ({p.max_new_tokens}) = {total} '
          f'exceeds model.max_seq_len ({self.cfg.max_seq_len}).')
    num_rows = -(-num_samples // self.mesh.size) * self.mesh.size
    prompts_BP = np.concatenate(
        [prompts_BP, np.full((num_rows - num_samples, plen), p.pad_id,
                             np.int32)])
    row_valid_B = np.arange(num_rows) < num_samples
    # Every process holds all rows (same prompts everywhere) and fills only
    # its own devices' shards, so this also works when the mesh spans
    # processes (utils/distributed.py).
    prompts_BP, row_valid_B = (distributed.global_array(x, self._rows)
                               for x in (prompts_BP, row_valid_B))
    cache = self._init_cache(state, num_rows, total)
    return self._prefill(
        state, prompts_BP, row_valid_B, key, placement, cache,
        capacity=_call_capacity(capacity, num_rows * plen, self.cfg.top_k,
                                self.mesh, self.dispatch))

  def decode(self, state, carry: DecodeState, key, *, placement=None,
             capacity: int | None = None) -> DecodeState:
    """Runs the decode loop to the end; `carry` is donated (do not reuse)."""
    num_rows = carry.tokens_BX.shape[0]
    return self._decode(state, carry, key, placement,
                        capacity=_call_capacity(capacity, num_rows,
                                                self.cfg.top_k, self.mesh,
                                                self.dispatch))

  def rollout(self, carry: DecodeState) -> Rollout:
    """The Rollout of a finished decode, batch padding dropped: tokens and
    log-probs on the host, the routing record left on device and counted
    there (`Rollout.counts_BLE`)."""
    p = self.params
    # Gathered from every process's rows (a collective when the mesh spans
    # processes): each process's host code sees the whole rollout.
    tokens_BX, logp_BX, steps, row_valid_B = distributed.to_host(
        (carry.tokens_BX, carry.logp_BX, carry.step, carry.row_valid_B))
    num_samples = int(row_valid_B.sum())  # Padding rows come last.
    plen = tokens_BX.shape[1] - 1 - p.max_new_tokens
    tokens_BT = tokens_BX[:num_samples, :-1]
    completion_BC = tokens_BT[:, plen:]
    is_eos_BC = ends(completion_BC, p)
    done_B = is_eos_BC.any(axis=1)
    lengths_B = np.where(done_B, is_eos_BC.argmax(axis=1) + 1,
                         p.max_new_tokens).astype(np.int32)
    valid_BC = np.arange(p.max_new_tokens) < lengths_B[:, None]
    valid_BT = np.concatenate(
        [prompt_valid(tokens_BT[:, :plen], p.pad_id), valid_BC], axis=1)
    counts_BLE = None
    if carry.routes_LBTK is not None:
      # The positions the RL step feeds: every one but the last.
      fed_BT = np.zeros((tokens_BX.shape[0], tokens_BT.shape[1]), bool)
      fed_BT[:num_samples, :-1] = valid_BT[:, :-1]
      counts_BLE = device_counts.sample_counts(
          self._count, carry.routes_LBTK, fed_BT, self.mesh)[:num_samples]
    return Rollout(
        tokens_BT=tokens_BT, completion_BC=completion_BC,
        logp_BC=logp_BX[:num_samples, :-1], lengths_B=lengths_B, done_B=done_B,
        valid_BT=valid_BT, prompt_len=plen, decode_steps=int(steps),
        routes_device_LBTK=carry.routes_LBTK, counts_BLE=counts_BLE)
