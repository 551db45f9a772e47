"""Inputs and checks shared by the MSA tests.

A plain module (not a conftest) so tests import its helpers by name. The
brute-force selection here is deliberately loop-and-numpy, independent of the
vectorised reference it checks.

Letter key: B batch, T query tokens, S key tokens, H query heads, G groups,
D head dim, I index head dim, K selected blocks.
"""
import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from pallas_kernels.msa import gpu_static

# (b, t, s, g, r, d, di, block, top_k, q_offset): small shapes that still
# cover GQA (r > 1), K below and above the number of blocks, lengths that are
# not multiples of the block size and a chunked-prefill offset.
SHAPES = {
    'gqa': (2, 96, 96, 2, 2, 16, 8, 16, 3, 0),
    'ragged_chunk': (1, 40, 100, 2, 3, 16, 8, 16, 4, 60),
}


# A context in which Triton kernels lower for CUDA on a host with no GPU.
cuda_lowering = gpu_static.cuda_lowering


def with_cuda_lowering(test):
  """Runs `test` inside cuda_lowering()."""
  @functools.wraps(test)
  def wrapped(*args, **kwargs):
    with cuda_lowering():
      return test(*args, **kwargs)
  return wrapped


def make_inputs(b, t, s, g, r, d, di, *, dtype=jnp.float32, seed=0):
  """(q_BTHD, k_BSGD, v_BSGD, qi_BTGI, ki_BSI, w_BTHD) from a normal draw.

  Normal draws are tie-free with probability one, so selections are unique.
  """
  ks = jax.random.split(jax.random.key(seed), 6)
  n = jax.random.normal
  return (n(ks[0], (b, t, g * r, d)).astype(dtype),
          n(ks[1], (b, s, g, d)).astype(dtype),
          n(ks[2], (b, s, g, d)).astype(dtype),
          n(ks[3], (b, t, g, di)), n(ks[4], (b, s, di)),
          n(ks[5], (b, t, g * r, d)).astype(jnp.float32))


def assert_close(actual, expected, tol, what=''):
  """max |a - e| <= tol * max(1, max |e|): absolute for O(1) values."""
  a = np.asarray(jnp.asarray(actual, jnp.float32))
  e = np.asarray(jnp.asarray(expected, jnp.float32))
  assert a.shape == e.shape, (what, a.shape, e.shape)
  err = np.max(np.abs(a - e)) if a.size else 0.0
  bound = tol * max(1.0, float(np.max(np.abs(e))) if e.size else 1.0)
  assert err <= bound, f'{what}: max abs err {err:.3g} > {bound:.3g}'


def brute_force_selection(qi_BTGI, ki_BSI, block_size, top_k, q_offset,
                          valid_BS=None):
  """docs/design.md §6.1-6.3 with Python loops over (b, g, t) and numpy.

  valid_BS (§6.9): padding keys score -inf; a block with no valid key is
  never kept (its slot is -1).
  """
  qi = np.asarray(qi_BTGI, np.float64)
  ki = np.asarray(ki_BSI, np.float64)
  valid = (np.ones(ki.shape[:2], bool) if valid_BS is None
           else np.asarray(valid_BS, bool))
  b, t, g, di = qi.shape
  out = np.full((b, g, t, top_k), -1, np.int32)
  for bb in range(b):
    for gg in range(g):
      for tt in range(t):
        pos = tt + q_offset
        local = pos // block_size
        logits = ki[bb, :pos + 1] @ qi[bb, tt, gg] / np.sqrt(di)
        logits = np.where(valid[bb, :pos + 1], logits, -np.inf)
        scores = [logits[n * block_size:(n + 1) * block_size].max()
                  for n in range(local)]
        # Stable sort on -score: lower block id first among ties.
        earlier = sorted(range(local), key=lambda n: (-scores[n], n))
        keep = [n if scores[n] > -np.inf else -1
                for n in earlier[:top_k - 1]]
        row = keep + [local]
        out[bb, gg, tt, :len(row)] = row
  return out


def check_selection_invariants(sel_BGTK, block_size, q_offset):
  """No duplicates, local block last among the valid, ids below visible."""
  sel = np.asarray(sel_BGTK)
  b, g, t, k = sel.shape
  for bb in range(b):
    for gg in range(g):
      for tt in range(t):
        row = sel[bb, gg, tt]
        valid = row[row >= 0]
        local = (tt + q_offset) // block_size
        n_valid = min(local + 1, k)
        assert len(valid) == n_valid, (bb, gg, tt, row)
        assert np.all(row[:n_valid] >= 0) and np.all(row[n_valid:] == -1), row
        assert len(set(valid.tolist())) == len(valid), f'duplicate in {row}'
        assert valid[-1] == local, f'local {local} not last in {row}'
        assert np.all(valid <= local), f'invisible block in {row}'


def as_sets(sel_BGTK):
  s = np.sort(np.asarray(sel_BGTK), axis=-1)
  return s


def exact_index_inputs(b, t, s, g, di, *, seed=0):
  """bf16 (qi_BTGI, ki_BSI) with entries in {-2..2}/2.

  Every product and every partial sum of an index dot is then a multiple of
  1/4 below 2^8, exact in bf16 products and f32 sums, so any summation order
  gives the same scores, and ties are plentiful: the tie rule is tested.
  """
  kq, kk = jax.random.split(jax.random.key(seed))
  draw = lambda key, shape: (jax.random.randint(key, shape, -2, 3) / 2).astype(
      jnp.bfloat16)
  return draw(kq, (b, t, g, di)), draw(kk, (b, s, di))


def masked_block_max_BNQ(qi_BTGI, ki_BSI, block_size, q_offset_B,
                         valid_BS):
  """The index score launch's output by numpy: per (token, group) row and
  key block, scale x the max of the exact logits over the block's keys
  that are valid and not after the row's token, -inf where none is;
  block-major f32 [B, N, T*G]."""
  b, t, g, di = qi_BTGI.shape
  s = ki_BSI.shape[1]
  n = -(-s // block_size)
  logits = np.einsum('btgi,bsi->btgs', np.asarray(qi_BTGI, np.float32),
                     np.asarray(ki_BSI, np.float32))
  qpos = np.asarray(q_offset_B)[:, None] + np.arange(t)[None, :]
  see = valid_BS[:, None, :] & (np.arange(s)[None, None, :] <= qpos[..., None])
  masked = np.where(see[:, :, None, :], logits, -np.inf)
  masked = np.pad(masked, ((0, 0), (0, 0), (0, 0), (0, n * block_size - s)),
                  constant_values=-np.inf)
  best = masked.reshape(b, t, g, n, block_size).max(-1)  # [B, T, G, N]
  want = np.where(np.isneginf(best), -np.inf,
                  best.astype(np.float32) * np.float32(1 / np.sqrt(di)))
  return want.transpose(0, 3, 1, 2).reshape(b, n, t * g)


def selection_margin_report(sel_BGTK, scores_BGTN, qi_BTGI, ki_BSI,
                            block_size, top_k, q_offset, eps_scale=2.0**-7):
  """(violations, flip_rate) of a selection against exact block scores.

  For each row with tau its (K-1)-th best earlier score, a low-precision
  selection may swap blocks only within eps of tau: every selected earlier
  block scores >= tau - eps and every earlier block left out <= tau + eps,
  eps = eps_scale * |qi_row| * max_j |ki_j| / sqrt(I) (2^-7 bounds the error
  of bf16 operands). flip_rate: the share of rows whose selected set differs
  from the exact top-(K-1).
  """
  sel = np.asarray(sel_BGTK)
  scores = np.asarray(scores_BGTN, np.float64)
  qn = np.linalg.norm(np.asarray(qi_BTGI, np.float64), axis=-1)  # [B, T, G]
  kmax = np.linalg.norm(np.asarray(ki_BSI, np.float64), axis=-1).max(axis=1)
  b, g, t, k = sel.shape
  off = np.broadcast_to(np.asarray(q_offset), (b,))
  violations, flips, rows = 0, 0, 0
  for bb in range(b):
    for tt in range(t):
      local = (tt + off[bb]) // block_size
      if local == 0:
        continue
      for gg in range(g):
        row = scores[bb, gg, tt, :local]
        eps = eps_scale * qn[bb, tt, gg] * kmax[bb] / np.sqrt(qi_BTGI.shape[-1])
        n_e = min(local, top_k - 1)
        picked = [x for x in sel[bb, gg, tt, :n_e] if x >= 0]
        tau = np.sort(row)[::-1][n_e - 1]
        left_out = np.setdiff1d(np.arange(local), picked)
        violations += int(np.sum(row[picked] < tau - eps))
        violations += int(np.sum(row[left_out] > tau + eps))
        exact = set(np.argsort(-row, kind='stable')[:n_e].tolist())
        flips += int(set(picked) != exact)
        rows += 1
  return violations, flips / max(rows, 1)


def array_ops_on(jaxpr, shapes) -> list:
  """[(primitive, shape)] of every operation outside a Pallas kernel, nested
  jaxprs included, that takes an operand of one of `shapes`: on a KV cache
  in decode, each is a pass over (a pad: a copy of) the whole cache."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'pallas_call':
      continue
    subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
    for sub in subs:
      out.extend(array_ops_on(sub, shapes))
    if subs:
      continue
    out.extend((eqn.primitive.name, v.aval.shape) for v in eqn.invars
               if tuple(getattr(getattr(v, 'aval', None), 'shape', ())) in shapes)
  return out
