"""Reading compiled HLO text: which collectives a compiled step holds.

Used by the tests and benchmarks that prove the RL step moves expert weights
by point-to-point rounds only (no all-gather of an [E, ...] tensor).
"""
from __future__ import annotations

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
