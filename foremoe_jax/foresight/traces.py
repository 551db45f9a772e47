"""Load traces: per-micro-step expert loads over several RL steps, on disk.

A trace is what the planner is benchmarked and tested on. It sits between the
routing record and the planner: either (a) real loads, one ``[M, L, D, E]``
array per RL step as ``foremoe_jax.foresight.loads`` computes them from the
sampler's routing record, stacked with ``trace_from_step_loads``; or (b) a
synthetic trace from ``synthetic_trace``, whose parameters live in
``SyntheticTraceConfig``. Either saves to and loads from one ``.npz``.

Shape letters: R RL steps, M micro-steps, L layers, D source (EP) devices,
E experts, K domains.

The synthetic model (all numpy, deterministic given the seed):

* Per layer l, expert popularity logits ``g[l, e] ~ N(0, 1)``; per domain k
  they shift to ``h[l, k, e] = g[l, e] + domain_spread * N(0, 1)``. Domains
  are the task mix of RL prompts (maths, code, ...): each favours its own
  experts.
* A temperature per layer, ``tau[l]``, turns logits into the domain's expert
  distribution ``softmax(tau[l] * h[l, k])``. ``tau[l]`` is solved (bisection)
  so that the step-level distribution, the domain mixture, puts a share
  ``hot_share[l]`` on its hottest expert, with ``hot_share[l]`` spread evenly
  over ``hot_share_range`` across layers: the skew differs per layer and
  matches the public Qwen3-30B-A3B figure (hottest expert 4-6% of a layer's
  selections at 128 experts, top-8, where uniform is 0.78%).
* Each sequence draws a domain, then its own expert distribution
  ``Dirichlet(seq_concentration * p_domain)`` (capped at 1/top_k per expert,
  since a token picks an expert at most once): a small concentration means a
  sequence's tokens pile onto few experts, which is the per-sequence
  correlation that makes micro-step loads swing while step totals stay
  stable. The same domain holds in every layer of a sequence.
* A sequence's ``tokens * top_k`` selections are a multinomial draw from its
  distribution, no expert taking more than ``tokens`` (the excess drawn
  again over experts with room). Lengths are log-normal around
  ``tokens_per_seq``.
* Every source device's micro-batch holds ``seqs_per_microbatch`` sequences
  (RL configs use 1-8); a micro-step's loads on source d are its sequences'
  counts summed.
"""
from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

import numpy as np

from foremoe_jax.foresight import composition


@dataclasses.dataclass(frozen=True)
class SyntheticTraceConfig:
  """Parameters of the synthetic Qwen3-like load trace (see module doc)."""

  num_steps: int = 4
  """RL steps (R). Step-level loads are stable across them."""
  num_microsteps: int = 8
  """Gradient-accumulation micro-steps per RL step (M)."""
  num_layers: int = 8
  """MoE layers (L)."""
  num_experts: int = 128
  """Routed experts per layer (E)."""
  top_k: int = 8
  """Experts each token selects."""
  num_devices: int = 8
  """Source (EP) devices (D); each holds one micro-batch per micro-step."""
  seqs_per_microbatch: int = 2
  """Sequences in one device's micro-batch (RL configs: 1-8)."""
  tokens_per_seq: int = 1024
  """Median sequence length in tokens."""
  tokens_per_seq_sigma: float = 0.5
  """Log-normal spread of sequence lengths (0 gives fixed lengths)."""
  num_domains: int = 8
  """Prompt domains; each has its own expert popularity."""
  domain_spread: float = 1.0
  """Std of the per-domain shift of the expert logits."""
  seq_concentration: float = 8.0
  """Dirichlet concentration of a sequence's expert distribution around its
  domain's; smaller means stronger per-sequence correlation of expert
  choice."""
  hot_share_range: tuple[float, float] = (0.04, 0.06)
  """Step-level share of each layer's hottest expert, spread over layers."""
  balance_device_tokens: bool = False
  """Lay each micro-step's sequences out over the devices with
  `composition.balance_device_tokens` (as the trainer does with
  rl.balance_device_tokens) instead of in draw order."""
  balance_step_tokens: bool = False
  """Choose each step's micro-steps too, with
  `composition.balance_step_tokens` (rl.balance_step_tokens); takes
  precedence over balance_device_tokens."""
  seed: int = 0

  def __post_init__(self):
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f'top_k = {self.top_k} must be in [1, num_experts].')
    lo, hi = self.hot_share_range
    if not 1.0 / self.num_experts < lo <= hi < 1.0:
      raise ValueError(f'hot_share_range {self.hot_share_range} must lie in '
                       f'(1/E, 1) with lo <= hi.')
    for name in ('num_steps', 'num_microsteps', 'num_layers', 'num_devices',
                 'seqs_per_microbatch', 'tokens_per_seq', 'num_domains'):
      if getattr(self, name) < 1:
        raise ValueError(f'{name} must be >= 1.')


class Trace(NamedTuple):
  """Exact loads of several RL steps, plus how they were made."""

  loads_RMLDE: np.ndarray  # int64 [R, M, L, D, E]
  meta: dict  # JSON-able description (generator config or source)

  @property
  def num_steps(self) -> int:
    return int(self.loads_RMLDE.shape[0])

  def step(self, r: int) -> np.ndarray:
    """Loads of RL step r: [M, L, D, E], the planner's input."""
    return self.loads_RMLDE[r]


def trace_from_step_loads(step_loads, meta: dict | None = None) -> Trace:
  """Stacks per-step loads [M, L, D, E] (e.g. from foresight.loads) into a trace."""
  loads_RMLDE = np.stack([np.asarray(x, np.int64) for x in step_loads])
  if loads_RMLDE.ndim != 5:
    raise ValueError(f'each step must be [M, L, D, E]; got '
                     f'{loads_RMLDE.shape[1:]}.')
  return Trace(loads_RMLDE, _jsonable(meta or {'source': 'routing records'}))


def _jsonable(meta: dict) -> dict:
  """The meta as it will read back from disk (tuples become lists)."""
  return json.loads(json.dumps(meta))


def save_trace(path: str, trace: Trace) -> None:
  np.savez_compressed(path, loads_RMLDE=trace.loads_RMLDE,
                      meta=np.array(json.dumps(trace.meta)))


def load_trace(path: str) -> Trace:
  with np.load(path, allow_pickle=False) as f:
    return Trace(f['loads_RMLDE'].astype(np.int64), json.loads(str(f['meta'])))


def _softmax(z, axis=-1):
  z = z - z.max(axis=axis, keepdims=True)
  p = np.exp(z)
  return p / p.sum(axis=axis, keepdims=True)


def _cap_simplex(p, cap):
  """Caps each row's entries at `cap`, giving the excess to the rest in
  proportion (a token picks an expert at most once, so an expert can take at
  most 1/top_k of a sequence's selections): min(cap, c * p) with the scale
  c >= 1 that makes the row sum to 1, solved exactly over the sorted row.

  A row whose mass sits on fewer than 1/cap entries (the others ~0) has no
  mass to scale up: a floor of 1e-12 per entry spreads its excess evenly,
  as a token's other choices would spread."""
  p = np.asarray(p, np.float64) + 1e-12
  p = p / p.sum(axis=-1, keepdims=True)
  s = -np.sort(-p, axis=-1)  # Descending.
  n = s.shape[-1]
  # With the j largest capped, the rest scale by c_j = (1 - j cap) / tail_j;
  # the answer is the least j whose largest uncapped entry stays <= cap.
  tail = np.cumsum(s[..., ::-1], axis=-1)[..., ::-1]  # sum of s[j:].
  j = np.arange(n)
  c = np.where(j * cap < 1, (1 - j * cap) / np.maximum(tail, 1e-300), np.inf)
  ok = c * s <= cap * (1 + 1e-12)
  first = np.argmax(ok, axis=-1)[..., None]
  scale = np.take_along_axis(c, first, axis=-1)
  out = np.minimum(cap, scale * p)
  return out / out.sum(axis=-1, keepdims=True)


def _distinct_counts(n_Q, p_QE, top_k, rng):
  """Each sequence's selections per expert: n * top_k multinomial draws from
  its (capped) distribution, then any expert over n (a token picks an
  expert at most once) gives its excess to experts with room, by a draw
  weighted by their share, until none is over."""
  counts = rng.multinomial(n_Q * top_k, p_QE)
  for _ in range(64):
    over_QE = np.maximum(counts - n_Q[:, None], 0)
    rows = np.flatnonzero(over_QE.any(axis=1))
    if not rows.size:
      return counts
    for q in rows:
      counts[q] -= over_QE[q]
      room = n_Q[q] - counts[q]
      w = p_QE[q] * (room > 0)
      extra = rng.multinomial(over_QE[q].sum(), w / w.sum())
      counts[q] += extra
  raise RuntimeError('could not spread a sequence\'s selections over '
                     'distinct experts')


def step_expert_distribution(h_KE, tau):
  """Step-level expert distribution: the (uniform) mixture of domains."""
  return _softmax(tau * h_KE).mean(axis=0)


def calibrate_temperature(h_KE, hot_share, lo=0.0, hi=50.0, iters=60):
  """tau such that the mixture's hottest expert has share `hot_share`."""
  for _ in range(iters):
    mid = 0.5 * (lo + hi)
    if step_expert_distribution(h_KE, mid).max() < hot_share:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


def _sequence_distributions(alpha_QE, top_k, rng):
  """Capped Dirichlet draws: each row is one sequence's expert distribution."""
  # Gamma draws normalised are Dirichlet; the floor keeps tiny shapes from
  # underflowing to an all-zero row.
  g_QE = rng.standard_gamma(np.maximum(alpha_QE, 1e-6)) + 1e-300
  return _cap_simplex(g_QE / g_QE.sum(axis=1, keepdims=True), 1.0 / top_k)


def domain_distributions(cfg: SyntheticTraceConfig, rng,
                         calibration_rounds: int = 3,
                         samples_per_domain: int = 64) -> np.ndarray:
  """Per layer and domain expert distributions [L, K, E], calibrated.

  The cap of 1/top_k per sequence flattens the hottest experts, so the
  temperature is re-solved a few times against a Monte-Carlo estimate of the
  capped step-level distribution (a fixed point on the target share).
  """
  L, K, E = cfg.num_layers, cfg.num_domains, cfg.num_experts
  g_LE = rng.standard_normal((L, E))
  h_LKE = g_LE[:, None, :] + cfg.domain_spread * rng.standard_normal((L, K, E))
  lo, hi = cfg.hot_share_range
  # Layers get evenly spread targets, shuffled so depth and skew are unrelated.
  goal_L = rng.permutation(np.linspace(lo, hi, L))
  aim_L = goal_L.copy()
  cal_rng = np.random.default_rng(rng.integers(2**63))
  for r in range(calibration_rounds + 1):
    tau_L = np.array([calibrate_temperature(h_LKE[l], min(aim_L[l], 0.99))
                      for l in range(L)])
    p_LKE = _softmax(tau_L[:, None, None] * h_LKE)
    if r == calibration_rounds:
      break
    for l in range(L):
      alpha = cfg.seq_concentration * np.repeat(p_LKE[l], samples_per_domain, 0)
      got = _sequence_distributions(alpha, cfg.top_k, cal_rng).mean(0).max()
      aim_L[l] *= goal_L[l] / got
  return p_LKE


def synthetic_trace(cfg: SyntheticTraceConfig) -> Trace:
  """A synthetic Qwen3-like trace; see the module docstring for the model."""
  rng = np.random.default_rng(cfg.seed)
  p_LKE = domain_distributions(cfg, rng)
  R, M, L, D, E = (cfg.num_steps, cfg.num_microsteps, cfg.num_layers,
                   cfg.num_devices, cfg.num_experts)
  B = cfg.seqs_per_microbatch
  n_seqs = R * M * D * B
  domain_Q = rng.integers(0, cfg.num_domains, n_seqs)
  tokens_Q = np.maximum(1, np.round(cfg.tokens_per_seq * np.exp(
      cfg.tokens_per_seq_sigma * rng.standard_normal(n_seqs)))).astype(np.int64)
  loads_QLE = np.empty((n_seqs, L, E), np.int64)
  for l in range(L):
    p_QE = _sequence_distributions(cfg.seq_concentration * p_LKE[l, domain_Q],
                                   cfg.top_k, rng)
    loads_QLE[:, l] = _distinct_counts(tokens_Q, p_QE, cfg.top_k, rng)
  if cfg.balance_step_tokens:
    # A step's sequences are drawn independently, so choosing its
    # micro-steps and devices is the trainer's composition, nothing more.
    per_step = M * D * B
    order = np.concatenate([
        r * per_step + np.concatenate(composition.balance_step_tokens(
            tokens_Q[r * per_step:(r + 1) * per_step], M, D))
        for r in range(R)])
    loads_QLE = loads_QLE[order]
  elif cfg.balance_device_tokens:
    # Sequences of one micro-step are drawn independently, so reordering
    # them among its devices is the trainer's layout step, nothing more.
    per_mb = D * B
    order = np.concatenate(composition.balance_device_tokens(
        [np.arange(i * per_mb, (i + 1) * per_mb) for i in range(R * M)],
        tokens_Q, D))
    loads_QLE = loads_QLE[order]
  loads_RMDBLE = loads_QLE.reshape(R, M, D, B, L, E)
  loads_RMLDE = loads_RMDBLE.sum(axis=3).transpose(0, 1, 3, 2, 4)
  meta = _jsonable({'source': 'synthetic', **dataclasses.asdict(cfg)})
  return Trace(np.ascontiguousarray(loads_RMLDE), meta)


def hottest_expert_share(loads_MLDE: np.ndarray) -> np.ndarray:
  """Step-level share of each layer's hottest expert: [L]."""
  w_LE = np.asarray(loads_MLDE, np.float64).sum(axis=(0, 2))
  return w_LE.max(axis=1) / np.maximum(w_LE.sum(axis=1), 1)
