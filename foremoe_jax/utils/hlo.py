"""Reading compiled HLO text: which collectives a compiled step holds.

Used by the tests and benchmarks that prove the RL step moves expert weights
by exact-size exchanges only (no all-gather of an [E, ...] tensor), outside
any conditional.
"""
from __future__ import annotations

import functools
import re

import numpy as np

_ALL_GATHER = re.compile(
    r'= ([a-z0-9]+)\[([0-9,]*)\][^ ]* all-gather(-start)?\(')
_BYTES = {'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4, 'f64': 8,
          's8': 1, 'u8': 1, 'pred': 1}


def all_gathers(hlo_text: str) -> list[tuple[str, int]]:
  """(dtype, element count) of the result of every all-gather."""
  out = []
  for m in _ALL_GATHER.finditer(hlo_text):
    dims = [int(x) for x in m.group(2).split(',') if x]
    out.append((m.group(1), int(np.prod(dims)) if dims else 1))
  return out


def all_gather_bytes(hlo_text: str, min_elements: int = 0) -> int:
  """Bytes gathered by all-gathers whose result has >= min_elements."""
  return sum(n * _BYTES.get(dtype, 4) for dtype, n in all_gathers(hlo_text)
             if n >= min_elements)


_COMPUTATION = re.compile(r'^(?:ENTRY )?%([^\s(]+) \(.*\{\s*$')
_CALLED = re.compile(r'(?:calls|to_apply|body|condition)=%([^\s,)]+)'
                     r'|branch_computations=\{([^}]*)\}')
_ALL_REDUCE = re.compile(r'%([^\s=]+) = (.+?) all-reduce(?:-start)?\(')
_SHAPE = re.compile(r'([a-z0-9]+)\[([0-9,]*)\]')
_MATMUL = re.compile(r' (?:dot|convolution)\(')


@functools.lru_cache(maxsize=4)
def _computations(hlo_text: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines (shared by the calls on one
  text, which only read it: a compiled step's text is megabytes)."""
  out, name = {}, None
  for line in hlo_text.split('\n'):
    m = _COMPUTATION.match(line)
    if m:
      name = m.group(1)
      out[name] = []
    elif name is not None:
      if line.strip() == '}':
        name = None
      else:
        out[name].append(line)
  return out


def _called(line: str) -> list[str]:
  if '=%' not in line and 'branch_computations=' not in line:
    return []  # (An instruction's own name is '%x = ...', with a space.)
  names = []
  for m in _CALLED.finditer(line):
    if m.group(1):
      names.append(m.group(1))
    else:
      names += [x.strip().lstrip('%') for x in m.group(2).split(',')]
  return names


def loop_computations(hlo_text: str) -> set[str]:
  """Names of the computations that run inside a while loop's body
  (transitively: everything a loop body calls)."""
  comps = _computations(hlo_text)
  todo = [b for lines in comps.values() for line in lines
          if ' while(' in line
          for b in re.findall(r'body=%([^\s,)]+)', line)]
  seen = set()
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for line in comps[c]:
      todo += _called(line)
  return seen


_COLLECTIVE = re.compile(
    r' (ragged-all-to-all|all-to-all|collective-permute|all-gather|all-reduce'
    r'|reduce-scatter)(?:-start)?\(')


def conditional_computations(hlo_text: str) -> set[str]:
  """Names of the computations that run inside a conditional's branch
  (transitively: everything a branch calls)."""
  comps = _computations(hlo_text)
  todo = []
  for lines in comps.values():
    for line in lines:
      if ' conditional(' not in line:
        continue
      todo += re.findall(r'(?:true|false)_computation=%([^\s,)]+)', line)
      m = re.search(r'branch_computations=\{([^}]*)\}', line)
      if m:
        todo += [x.strip().lstrip('%') for x in m.group(1).split(',')]
  seen = set()
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for line in comps[c]:
      todo += _called(line)
  return seen


def collectives(hlo_text: str) -> list[dict]:
  """Every collective: its kind ('all-to-all', 'collective-permute', ...),
  its computation, and whether it sits inside a conditional's branch
  (where XLA schedules it within the branch, so it cannot overlap work
  outside) or inside a loop."""
  in_cond = conditional_computations(hlo_text)
  in_loop = loop_computations(hlo_text)
  out = []
  for comp, lines in _computations(hlo_text).items():
    for line in lines:
      m = _COLLECTIVE.search(line)
      if m:
        out.append(dict(kind=m.group(1), computation=comp,
                        in_conditional=comp in in_cond,
                        in_loop=comp in in_loop))
  return out


def compute_computations(hlo_text: str) -> set[str]:
  """Names of the computations that run a matmul (a dot or convolution):
  among their own instructions, in a fusion or call they make, or in a
  loop or conditional they run. The latency-hiding scheduler orders one
  computation's instructions, so an asynchronous collective may overlap
  the matmuls its computation runs, a whole loop over layers included
  while that loop is one instruction of it; a collective in a computation
  not listed here (the body of a loop of transfers alone) can overlap no
  matmul, since a loop's collectives cannot leave its body."""
  comps = _computations(hlo_text)
  own = {c: any(_MATMUL.search(line) for line in lines)
         for c, lines in comps.items()}
  callees = {c: {f for line in lines for f in _called(line)}
             for c, lines in comps.items()}
  has_dot = {}

  def dots(c):
    if c not in has_dot:
      has_dot[c] = False  # Cycles (there are none) count as no matmul.
      has_dot[c] = own.get(c, False) or any(dots(f) for f in callees.get(c, ()))
    return has_dot[c]
  return {c for c in comps if dots(c)}


def _group_size(line: str) -> int:
  """Devices in each replica group of a collective (0: not stated).

  Three spellings: explicit groups `{{0,1},...}`, iota groups `[G,N]<=...`,
  and (XLA from jax 0.11) mesh axes `mesh['data'=2,'expert'=4] {'data'}`,
  whose groups span the named axes."""
  m = re.search(r'replica_groups=\{\{([0-9,]*)\}', line)
  if m:
    return len(m.group(1).split(','))
  m = re.search(r'replica_groups=\[([0-9]+),([0-9]+)\]', line)
  if m:
    return int(m.group(2))
  m = re.search(r'replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}', line)
  if m:
    sizes = {name: int(size) for name, size in
             re.findall(r"'([^']+)'=([0-9]+)", m.group(1))}
    return int(np.prod([sizes[a] for a in re.findall(r"'([^']+)'",
                                                     m.group(2))]))
  return 0


def all_reduces(hlo_text: str) -> list[dict]:
  """Every all-reduce: its name, operand dtypes and total elements, the
  devices per replica group, and whether it runs inside a loop (once per
  iteration) or once."""
  in_loop = loop_computations(hlo_text)
  out = []
  for comp, lines in _computations(hlo_text).items():
    for line in lines:
      m = _ALL_REDUCE.search(line)
      if not m:
        continue
      shapes = _SHAPE.findall(m.group(2))
      out.append(dict(
          name=m.group(1), computation=comp, in_loop=comp in in_loop,
          group_size=_group_size(line),
          dtypes=[d for d, _ in shapes],
          elements=sum(int(np.prod([int(x) for x in dims.split(',') if x]))
                       if dims else 1 for _, dims in shapes)))
  return out
