"""Load traces of another family than ``traces.synthetic_trace``: Zipf + Dirichlet.

The planner's own synthetic traces (``foremoe_jax.foresight.traces``) were
used to tune it, so its scores on them may flatter it. This module makes
traces from a different model, for the benchmark's "alt" configurations
(``planner.evaluate.alt_configs``, ``experiments/bench_planner.py
--alt_traces``). It outputs the same ``traces.Trace`` (loads_RMLDE int64
[R steps, M micro-steps, L layers, D source devices, E experts]), so
everything downstream is unchanged. numpy only, no jax; every draw comes
from ``np.random.default_rng(cfg.seed)``.

The model (``ZipfDirichletConfig``, ``zipf_dirichlet_trace``):

* Popularity per layer l is Zipf: the expert of rank i (1-based) gets
  ``p[l, e] ~ i ** -zipf_exponent``, ranks a fresh random permutation of the
  experts per layer. At E=128 the hottest expert's share of the popularity
  is 6.5% (s=0.6), 18.4% (s=1.0), 36% (s=1.4); a token gives one expert at
  most one of its top_k selections, so the realised share is capped at
  1/top_k: at E=128, top-8 the traces show 5.3%, 10.5%, 12.4% (E=64, top-2:
  8.4%, 19%, 31%). The popularity is the same in every RL step.
* Each sequence and layer draws its own routing distribution
  ``q ~ Dirichlet(concentration * p[l])``: q has mean p, and
  `concentration` (the Dirichlet's total, c) sets how far a sequence strays
  from it. Experts holding over 1% of a sequence's mass, at E=128, s=1.0:
  ~20 (c=30), ~8 (c=3), ~2 (c=0.3, its top expert ~85% of the mass), about
  the same at E=64 and E=256; so at low c micro-steps of a few sequences
  swing far from the step average. Layers are drawn independently (no domain shared across
  layers).
* Every token of the sequence picks `top_k` distinct experts by successive
  sampling without replacement from q (each pick from q renormalised over
  the experts not yet chosen; ``topk_counts``, exact, in log space); a
  sequence's loads are the counts over its tokens, so an expert gets at
  most one selection per token. With a small concentration q has fewer
  than top_k experts of any weight, and a sequence's tokens then share
  most of their picks (the whole sequence lands on the same top_k experts).
* Each source device holds whole sequences, `seqs_per_device` of them per
  micro-step, whose lengths split the device's `tokens_per_device` at
  random (log-normal weights, spread `seq_length_sigma`, at least one token
  each); a micro-step is the group of the D x seqs_per_device sequences on
  the devices. Every (micro-step, layer, device) row so sums to
  tokens_per_device * top_k.

How it differs from ``traces.synthetic_trace``: popularity is a Zipf law in
rank (hottest shares from 4% to 31%) instead of softmax-of-Gaussian logits
calibrated to a 4-6% hottest share; there are no prompt domains (a
sequence's skew is independent noise around the layer's popularity, drawn
afresh in every layer, where the synthetic model keeps one domain through
all layers and Dirichlet-perturbs the domain's distribution); top-k
distinctness is sampled exactly per token, where the synthetic model caps
the sequence distribution at 1/top_k and draws its selections as one
multinomial (with replacement, so a sparse sequence still spreads over
many experts; here it cannot); and the per-device token count is fixed
(the synthetic model's sequence lengths are free log-normal, so devices
differ in tokens).

Sizes: the benchmark's alt configurations (``planner.evaluate.
alt_trace_configs``) use 2,048 tokens per device and micro-step (2
sequences), 4 layers, 3 RL steps (the first a warm-up) and 4 micro-steps:
36 traces (E=64 D=8 top-2; E=128 D=8, E=128 D=16, E=256 D=32 top-8; each
with s in {0.6, 1.0, 1.4} and c in {0.3, 3, 30}) generate in about 1-1.5
minutes and plan (all methods, 1 and 2 redundant slots) in well under one
more on 2 shared CPU cores. Generation is ~1 s per layer at E=256, D=32,
top-8 (6.3 M picks, a binary search each).

Shape letters: R RL steps, M micro-steps, L layers, D source devices,
E experts, Q sequences, T tokens.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from foremoe_jax.foresight import traces


@dataclasses.dataclass(frozen=True)
class ZipfDirichletConfig:
  """Parameters of the Zipf-popularity, Dirichlet-per-sequence trace."""

  num_steps: int = 3
  """RL steps (R)."""
  num_microsteps: int = 4
  """Micro-steps per RL step (M)."""
  num_layers: int = 4
  """MoE layers (L)."""
  num_experts: int = 128
  """Routed experts per layer (E)."""
  top_k: int = 8
  """Distinct experts each token selects."""
  num_devices: int = 8
  """Source devices (D); each holds whole sequences."""
  tokens_per_device: int = 2048
  """Tokens on each device per micro-step (exact)."""
  seqs_per_device: int = 2
  """Sequences per device and micro-step."""
  seq_length_sigma: float = 0.5
  """Log-normal spread of the weights splitting a device's tokens over its
  sequences (0: equal lengths)."""
  zipf_exponent: float = 1.0
  """s: the expert of popularity rank i gets weight i ** -s."""
  concentration: float = 3.0
  """c: each sequence's routing is Dirichlet(c * p) (c the Dirichlet's total
  concentration); lower c, stronger per-sequence skew."""
  seed: int = 0

  def __post_init__(self):
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f'top_k = {self.top_k} must be in [1, num_experts].')
    for name in ('num_steps', 'num_microsteps', 'num_layers', 'num_devices',
                 'seqs_per_device'):
      if getattr(self, name) < 1:
        raise ValueError(f'{name} must be >= 1.')
    if self.tokens_per_device < self.seqs_per_device:
      raise ValueError('tokens_per_device must be >= seqs_per_device.')
    if self.zipf_exponent < 0 or self.concentration <= 0:
      raise ValueError('zipf_exponent must be >= 0 and concentration > 0.')


def zipf_popularity(num_layers: int, num_experts: int, exponent: float,
                    rng: np.random.Generator) -> np.ndarray:
  """Per-layer Zipf popularity p_LE (rows sum to 1), ranks permuted per
  layer so each layer has its own hot experts."""
  w_E = np.arange(1, num_experts + 1, dtype=np.float64) ** -float(exponent)
  w_E /= w_E.sum()
  return np.stack([w_E[rng.permutation(num_experts)]
                   for _ in range(num_layers)])


def sequence_log_distributions(p_E: np.ndarray, concentration: float,
                               num_seqs: int, rng: np.random.Generator
                               ) -> np.ndarray:
  """log q_QE, q ~ Dirichlet(concentration * p_E), one row per sequence.

  In log space because small concentrations put most experts' mass far
  below float64's range, and their order still decides a token's later
  picks: log Gamma(a) = log Gamma(a + 1) + log(U) / a, U uniform in (0, 1].
  """
  alpha_E = concentration * np.asarray(p_E, np.float64)
  shape = (num_seqs, alpha_E.size)
  logg_QE = (np.log(rng.standard_gamma(alpha_E + 1.0, size=shape))
             + np.log1p(-rng.random(shape)) / alpha_E)
  return logg_QE - _logsumexp(logg_QE)


def _logsumexp(x_NE: np.ndarray) -> np.ndarray:
  top_N1 = x_NE.max(axis=1, keepdims=True)
  return top_N1 + np.log(np.exp(x_NE - top_N1).sum(axis=1, keepdims=True))


def topk_counts(logq_QE: np.ndarray, tokens_Q: np.ndarray, top_k: int,
                rng: np.random.Generator) -> np.ndarray:
  """Per-sequence expert counts when each of a sequence's tokens picks
  `top_k` distinct experts by successive sampling from its row of
  q = exp(logq) (each pick drawn from q renormalised over the experts the
  token has not picked yet): counts_QE int64, rows summing to
  tokens * top_k, no entry above the sequence's tokens.

  Exact, in log space (small Dirichlet concentrations put most experts far
  below float64's range, and their order still decides a token's later
  picks). Each sequence's experts are ranked by q, descending, with suffix
  sums T_r = sum of q over ranks >= r. A pick draws x uniform in
  [0, T_j0), j0 the token's first rank not yet picked, takes the rank r
  with T_{r+1} <= x < T_r (binary search on log T), and redraws while r is
  already picked: the accepted rank is q renormalised over the unpicked
  ranks. Every picked rank past j0 weighs at most q at rank j0, so a try
  succeeds with probability >= 1 / top_k, and log T has the same relative
  precision however small the mass left.
  """
  logq_QE = np.asarray(logq_QE, np.float64)
  num_seqs, num_experts = logq_QE.shape
  tokens_Q = np.asarray(tokens_Q, np.int64)
  if top_k > num_experts:
    raise ValueError(f'top_k = {top_k} > {num_experts} experts.')
  expert_QR = np.argsort(-logq_QE, axis=1, kind='stable')  # Rank -> expert.
  logq_QR = np.take_along_axis(logq_QE, expert_QR, axis=1)
  # log T: [Q, E + 1] with log T_E = -inf, flattened for fast gathers.
  width = num_experts + 1
  logt_QR = np.full((num_seqs, width), -np.inf)
  logt_QR[:, :-1] = np.logaddexp.accumulate(logq_QR[:, ::-1], axis=1)[:, ::-1]
  logt = logt_QR.ravel()
  seq_T = np.repeat(np.arange(num_seqs), tokens_Q)
  base_T = seq_T * width
  rank_TK = np.full((seq_T.size, top_k), -1, np.int64)
  first_T = np.zeros(seq_T.size, np.int64)  # j0: first rank not picked.
  steps = int(np.ceil(np.log2(width)))
  for j in range(top_k):
    pending = np.arange(seq_T.size)
    while pending.size:
      base = base_T[pending]
      lo = base + first_T[pending]
      logx = np.log1p(-rng.random(pending.size)) + logt[lo]
      hi = base + num_experts
      for _ in range(steps):  # Largest r with log T_r > log x.
        mid = (lo + hi) >> 1
        above = logt[mid] > logx
        lo = np.where(above, mid, lo)
        hi = np.where(above, hi, mid)
      rank = lo - base
      taken = (rank_TK[pending, :j] == rank[:, None]).any(axis=1)
      rank_TK[pending[~taken], j] = rank[~taken]
      pending = pending[taken]
    advance = np.flatnonzero(rank_TK[:, j] == first_T)
    while advance.size:
      first_T[advance] += 1
      advance = advance[(rank_TK[advance, :j + 1]
                         == first_T[advance, None]).any(axis=1)]
  expert_TK = expert_QR[seq_T[:, None], rank_TK]
  flat_T = (seq_T[:, None] * num_experts + expert_TK).ravel()
  return np.bincount(flat_T, minlength=num_seqs * num_experts).reshape(
      num_seqs, num_experts).astype(np.int64)


def split_tokens(total: int, parts: int, sigma: float,
                 rng: np.random.Generator) -> np.ndarray:
  """`parts` positive integers summing to `total`, in proportion to
  log-normal weights (largest remainder rounding)."""
  w = np.exp(sigma * rng.standard_normal(parts))
  share = (total - parts) * w / w.sum()
  out = np.floor(share).astype(np.int64)
  rest = (total - parts) - int(out.sum())
  out[np.argsort(share - out)[::-1][:rest]] += 1
  return out + 1


def zipf_dirichlet_trace(cfg: ZipfDirichletConfig) -> traces.Trace:
  """The trace of the module docstring's model; meta records `cfg`, the
  source 'alt:zipf_dirichlet' and the hottest popularity share per layer."""
  rng = np.random.default_rng(cfg.seed)
  R, M, L, D, E = (cfg.num_steps, cfg.num_microsteps, cfg.num_layers,
                   cfg.num_devices, cfg.num_experts)
  B = cfg.seqs_per_device
  p_LE = zipf_popularity(L, E, cfg.zipf_exponent, rng)
  tokens_RMDB = np.stack([
      split_tokens(cfg.tokens_per_device, B, cfg.seq_length_sigma, rng)
      for _ in range(R * M * D)]).reshape(R, M, D, B)
  tokens_Q = tokens_RMDB.ravel()
  loads_QLE = np.empty((tokens_Q.size, L, E), np.int64)
  for l in range(L):
    logq_QE = sequence_log_distributions(p_LE[l], cfg.concentration,
                                         tokens_Q.size, rng)
    loads_QLE[:, l] = topk_counts(logq_QE, tokens_Q, cfg.top_k, rng)
  loads_RMLDE = (loads_QLE.reshape(R, M, D, B, L, E).sum(axis=3)
                 .transpose(0, 1, 3, 2, 4))
  meta = json.loads(json.dumps({
      'source': 'alt:zipf_dirichlet', **dataclasses.asdict(cfg),
      'popularity_hottest_share_L': p_LE.max(axis=1).tolist()}))
  return traces.Trace(np.ascontiguousarray(loads_RMLDE), meta)


def microstep_expert_skew(loads_MLDE: np.ndarray) -> float:
  """Mean over (micro-step, layer) of max/mean expert load (sources summed):
  how uneven the experts a micro-step routes to are, before placement."""
  w_MLE = np.asarray(loads_MLDE, np.float64).sum(axis=-2)
  return float((w_MLE.max(-1) / np.maximum(w_MLE.mean(-1), 1e-12)).mean())
