"""Micro-batch composition: which samples go into which micro-step.

Sits between the verifier and the foresight loads: after rollout, the step's
B samples are split into M equal micro-batches; `loads.microstep_loads` then
counts what each micro-step will dispatch.

When composition leaves the gradient alone. The update sums the micro-steps'
gradients (rl/step.py `update_grads`), which equals the full-batch gradient
exactly (up to float summation order) when every term of the loss is a sum
over sequences with a normaliser that does not depend on the split. That
holds for the GRPO policy loss and its KL penalty (`rl.grpo.policy_loss`:
each sequence's token mean over its loss mask, summed and divided by the
step's sequence count B, with advantages computed over the whole step before
splitting) and for the MSA indexer KL (weighted the same way). It also needs
the dispatch to be dropless (the capacity bucket comes from the foresight),
since which assignments overflow a cell depends on which tokens share it.
It fails for per-micro-batch terms: the Switch balance loss
(`model.aux_loss_coef > 0`) is E * sum_e f_e P_e over the micro-batch's own
tokens, a product of two micro-batch means, so its gradient depends on which
samples share a micro-batch; with that loss on, another composition
changes that term's gradient (the routers' and, through their inputs, the
layers' below them). With it off (the default), composition is free to
serve load balance.

Shape letters: B samples, L MoE layers, E experts, M micro-batches.

Balance objective: for micro-batch m, load[m, l, e] is the assignments its
samples route to expert e in layer l, and cost(m) = sum_l max_e load[m, l, e]
(layers run one after another, and each waits for its hottest expert, whose
tokens no placement can split below max_e / replicas). `balance=True`
minimises max_m cost(m) greedily, largest sample first (LPT scheduling): each
sample, in order of its own cost sum_l max_e counts[b, l, e] (ties broken by
a permutation drawn from `seed`), goes to the micro-batch with room whose cost
after adding it is least (ties: lower current cost, then lower index). The
result is kept only if its max cost beats the in-order composition, so
balancing never makes the objective worse. Plain numpy.
"""
from __future__ import annotations

import bisect

import numpy as np

from foremoe_jax.foresight.loads import sample_expert_counts


def max_expert_loads(counts_BLE: np.ndarray, microbatches) -> np.ndarray:
  """int64 [M, L]: the hottest expert's load per micro-batch and layer."""
  counts_BLE = np.asarray(counts_BLE, np.int64)
  return np.stack([counts_BLE[np.asarray(idx, np.int64)].sum(0).max(-1)
                   for idx in microbatches])


def compose_microbatches(num_samples: int, num_microbatches: int, *,
                         routes: np.ndarray | None = None,
                         valid: np.ndarray | None = None,
                         num_experts: int | None = None,
                         balance: bool = False,
                         seed: int = 0,
                         counts_BLE: np.ndarray | None = None
                         ) -> list[np.ndarray]:
  """M int64 arrays of B / M sample indices each, ascending within each.

  balance=False keeps order: micro-batch m is samples [m B/M, (m+1) B/M).
  balance=True needs the routing record (`routes` [L, B, T, K], optional
  `valid` [B, T]), or its per-sample counts `counts_BLE` (the sampler's),
  and evens expert load across micro-batches (see the module docstring).
  num_experts defaults to the largest valid expert id + 1.
  Deterministic for a given record and seed.
  """
  if num_microbatches < 1 or num_samples % num_microbatches:
    raise ValueError(f'{num_samples} samples do not split into '
                     f'{num_microbatches} equal micro-batches.')
  per_mb = num_samples // num_microbatches
  in_order = [np.arange(m * per_mb, (m + 1) * per_mb, dtype=np.int64)
              for m in range(num_microbatches)]
  if not balance:
    return in_order
  if counts_BLE is not None:
    counts_BLE = np.asarray(counts_BLE, np.int64)
    return _best_of(counts_BLE, in_order, num_microbatches, per_mb, seed)
  if routes is None:
    raise ValueError('balance=True needs the routing record `routes` or '
                     'its per-sample counts `counts_BLE`.')
  routes = np.asarray(routes)
  if routes.ndim != 4 or routes.shape[1] != num_samples:
    raise ValueError(f'routes must be [L, B={num_samples}, T, K]; got '
                     f'{routes.shape}.')
  if num_experts is None:
    ids = routes if valid is None else routes[:, np.asarray(valid, bool)]
    num_experts = int(ids.max()) + 1 if ids.size else 1
  counts_BLE = sample_expert_counts(routes, valid, num_experts)
  return _best_of(counts_BLE, in_order, num_microbatches, per_mb, seed)


def _best_of(counts_BLE, in_order, num_microbatches, per_mb, seed):
  """The greedy composition when it beats the in-order one, else in order."""
  balanced = _greedy_composition(counts_BLE, num_microbatches, per_mb, seed)
  if (max_expert_loads(counts_BLE, balanced).sum(1).max()
      < max_expert_loads(counts_BLE, in_order).sum(1).max()):
    return balanced
  return in_order


def _greedy_composition(counts_BLE, num_microbatches, per_mb, seed):
  """Largest-first greedy assignment; see the module docstring."""
  num_samples, num_layers, num_experts = counts_BLE.shape
  own_cost_B = counts_BLE.max(-1).sum(-1)
  tie_B = np.random.default_rng(seed).permutation(num_samples)
  order = np.lexsort((tie_B, -own_cost_B))  # Last key is the primary one.
  load_MLE = np.zeros((num_microbatches, num_layers, num_experts), np.int64)
  cost_M = np.zeros(num_microbatches, np.int64)
  members = [[] for _ in range(num_microbatches)]
  for b in order:
    new_cost_M = (load_MLE + counts_BLE[b]).max(-1).sum(-1)
    full_M = np.array([len(mb) >= per_mb for mb in members])
    new_cost_M = np.where(full_M, np.iinfo(np.int64).max, new_cost_M)
    m = np.lexsort((np.arange(num_microbatches), cost_M, new_cost_M))[0]
    members[m].append(b)
    load_MLE[m] += counts_BLE[b]
    cost_M[m] = new_cost_M[m]
  return [np.sort(np.asarray(mb, np.int64)) for mb in members]


def device_token_loads(tokens_B, microbatches, num_devices: int) -> np.ndarray:
  """int64 [M, D]: tokens each device holds per micro-step, device d holding
  the d-th of D equal consecutive chunks of a micro-batch (the RL step's
  layout)."""
  tokens_B = np.asarray(tokens_B, np.int64)
  return np.stack([tokens_B[np.asarray(mb, np.int64)].reshape(
      num_devices, -1).sum(1) for mb in microbatches])


def balance_device_tokens(microbatches, tokens_B,
                          num_devices: int) -> list[np.ndarray]:
  """The same micro-batches, each reordered so that its D consecutive
  chunks (one per device) hold nearly equal token counts.

  A device sends its own tokens' expert rows, so the device holding the
  most valid tokens bounds every all-to-all of the micro-step however the
  experts are placed; RL completions vary in length, and sequences laid
  out in order leave some devices holding several times the mean. Within
  each micro-batch, sequences go largest first to the device with room
  whose count is lowest (LPT with B / D sequences per device; ties: lower
  device); the order is kept where it is already no worse. Only the order
  changes: which micro-step holds a sample (the composition) does not, and
  the loss is a sum over sequences, so the step's gradient does not
  either. verl's `balance_batch` evens tokens over data-parallel ranks the
  same way.

  tokens_B: [B] tokens of each sample that route (valid positions).
  Returns M int64 arrays, device-major (chunk d is device d's samples,
  ascending within it).
  """
  tokens_B = np.asarray(tokens_B, np.int64)
  out = []
  for mb in microbatches:
    mb = np.asarray(mb, np.int64).reshape(-1)
    if len(mb) % num_devices:
      raise ValueError(f'a micro-batch of {len(mb)} samples does not split '
                       f'into whole sequences over {num_devices} devices.')
    per = len(mb) // num_devices
    bins, load_D = _lpt_bins(mb, tokens_B, num_devices, per)
    if load_D.max() < tokens_B[mb].reshape(num_devices, per).sum(1).max():
      out.append(np.concatenate(bins))
    else:
      out.append(mb)
  return out


def _lpt_bins(samples, tokens_B, num_bins: int, per: int):
  """`samples` into `num_bins` bins of `per` each: largest first into the
  emptiest bin with room (ties: the lower sample index, the lower bin).
  Returns (bins, each an ascending int64 array; int64 [num_bins] loads)."""
  samples = np.asarray(samples, np.int64)
  t = tokens_B[samples]
  load_K = np.zeros(num_bins, np.int64)
  count_K = np.zeros(num_bins, np.int64)
  bins = [[] for _ in range(num_bins)]
  for i in np.lexsort((samples, -t)):
    room = np.flatnonzero(count_K < per)
    k = int(room[np.argmin(load_K[room])])
    bins[k].append(samples[i])
    load_K[k] += t[i]
    count_K[k] += 1
  return [np.sort(np.asarray(b, np.int64)) for b in bins], load_K


def balance_step_tokens(tokens_B, num_microbatches: int,
                        num_devices: int) -> list[np.ndarray]:
  """M micro-batches chosen for even device token counts over the whole
  step: which micro-step holds a sample as well as its device within it.

  `balance_device_tokens` only reorders inside each micro-batch, so a
  micro-batch that drew two long completions keeps one device near twice
  the mean however its samples are laid out: on long-tailed RL lengths the
  busiest sender, summed over micro-steps, stays ~1.7x the mean. The step
  waits, micro-step after micro-step, for its busiest device, so the
  objective here is the sum over micro-steps of the largest device count,
  with every device holding P = B / (M D) samples (the update's shapes):

    micro-steps are filled one at a time, heaviest first. The largest
    sample left must run somewhere, and the least its device can then hold
    is it plus the P - 1 smallest left: that is the micro-step's cap.
    Each of its D devices takes the largest sample left, then, slot by
    slot, the largest sample that keeps the device within the cap once its
    remaining slots take the smallest samples left. So the long samples
    share a micro-step whose every device is filled up to the cap, instead
    of each long sample setting the pace of a micro-step of short ones.
    The last micro-step takes what is left, laid out largest first onto
    the emptiest device (LPT).

  Two other compositions are scored beside it, and the one with the
  lowest sum is returned (ties: the first): every sample LPT'd into M D
  devices' worth of P samples, the devices then taken D at a time heaviest
  first (contiguous runs of sorted loads minimise a sum of group maxima;
  it wins on some small steps with P >= 4), and `balance_device_tokens`
  of the in-order composition, so the result is never worse than what
  that flag alone gives. The loss is a sum over
  sequences with step-level normalisers (module docstring), so, as for
  `balance_microbatches`, another composition changes only the float
  summation order of the gradient.

  tokens_B: [B] routed tokens per sample. Returns M int64 arrays,
  device-major (chunk d is device d's samples, ascending within it).
  Deterministic (ties: the lower sample index first).
  """
  tokens_B = np.asarray(tokens_B, np.int64).reshape(-1)
  num_samples = len(tokens_B)
  num_bins = num_microbatches * num_devices
  if num_microbatches < 1 or num_devices < 1 or num_samples % num_bins:
    raise ValueError(f'{num_samples} samples do not split into '
                     f'{num_microbatches} micro-batches of whole sequences '
                     f'over {num_devices} devices.')
  per = num_samples // num_bins
  # Samples left, ascending by (tokens, -index): the largest is at the end,
  # and among equal counts the lower index is taken first.
  left = sorted(range(num_samples), key=lambda b: (tokens_B[b], -b))
  keys = [int(tokens_B[b]) for b in left]
  def take(pos):
    keys.pop(pos)
    return left.pop(pos)
  balanced = []
  for _ in range(num_microbatches - 1):
    cap = keys[-1] + sum(keys[:per - 1])
    devices = []
    for _ in range(num_devices):
      chosen = [take(len(left) - 1)]
      total = int(tokens_B[chosen[0]])
      for slot in range(1, per):
        rest = per - 1 - slot  # Slots after this one, for the smallest.
        room = cap - total - sum(keys[:rest])
        # The largest sample left that fits, outside the `rest` smallest
        # (kept for the slots after); when none does, the smallest of them.
        pos = max(rest, bisect.bisect_right(keys, room) - 1)
        total += keys[pos]
        chosen.append(take(pos))
      devices.append(np.sort(np.asarray(chosen, np.int64)))
    balanced.append(np.concatenate(devices))
  balanced += balance_device_tokens([np.asarray(left, np.int64)], tokens_B,
                                    num_devices)
  candidates = [
      balanced,
      _sorted_bins(tokens_B, num_microbatches, num_devices, per),
      balance_device_tokens(compose_microbatches(num_samples,
                                                 num_microbatches),
                            tokens_B, num_devices)]
  costs = [int(device_token_loads(tokens_B, c, num_devices).max(1).sum())
           for c in candidates]
  return candidates[int(np.argmin(costs))]


def _sorted_bins(tokens_B, num_microbatches, num_devices, per):
  """Every sample LPT'd into M D bins of `per` (`_lpt_bins`), the bins
  heaviest first, D to a micro-step."""
  num_bins = num_microbatches * num_devices
  bins, load_K = _lpt_bins(np.arange(len(tokens_B)), tokens_B, num_bins, per)
  by_load = np.lexsort((np.arange(num_bins), -load_K))
  return [np.concatenate([bins[k] for k in by_load[m * num_devices:
                                                   (m + 1) * num_devices]])
          for m in range(num_microbatches)]
