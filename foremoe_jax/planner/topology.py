"""What the planner knows about the machine: device layout and costs.

Inputs of every planner (``foremoe_jax.planner.foremoe`` and the baselines):
the expert-parallel devices grouped into nodes with a fixed number of slots
each, and a cost model that turns token counts and expert copies into
seconds, so that a placement's gain (less straggler compute) and its cost
(expert weights copied between micro-steps) are compared in one unit.

Slot ``j`` lives on device ``j // slots_per_device``; device ``d`` on node
``d // devices_per_node`` (nodes are consecutive device ids).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Topology:
  """Nodes x devices per node, each device with `slots_per_device` slots."""

  num_nodes: int
  devices_per_node: int
  slots_per_device: int

  def __post_init__(self):
    for name in ('num_nodes', 'devices_per_node', 'slots_per_device'):
      if getattr(self, name) < 1:
        raise ValueError(f'Topology.{name} must be >= 1.')

  @property
  def num_devices(self) -> int:
    return self.num_nodes * self.devices_per_node

  @property
  def num_slots(self) -> int:
    return self.num_devices * self.slots_per_device

  def device_of_slot(self) -> np.ndarray:
    """int [S]."""
    return np.arange(self.num_slots) // self.slots_per_device

  def node_of_device(self) -> np.ndarray:
    """int [D]."""
    return np.arange(self.num_devices) // self.devices_per_node

  def check_experts(self, num_experts: int) -> None:
    if self.num_slots < num_experts:
      raise ValueError(f'{self.num_slots} slots cannot hold {num_experts} '
                       f'experts: raise slots_per_device.')


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds per token of expert compute and per expert copied.

  Defaults describe a Qwen3-30B-A3B expert (d_model 2048, d_ff 768, bf16) on
  an H100-class node; see ``from_expert_shape``.
  """

  token_time_s: float = 7.08e-8
  """Forward + backward time of one token-assignment in one expert, one
  layer (the straggler's compute is its load times this)."""
  bytes_per_expert: float = 9.44e6
  """Bytes copied to place one replica (weights only: gradients are summed
  back onto the canonical expert, optimizer state never moves)."""
  intra_node_bw: float = 3.5e11
  """Bytes/s one device receives from a peer in its node (NVLink-class)."""
  inter_node_bw: float = 5e10
  """Bytes/s one device receives from another node (400 Gb/s NIC)."""
  overlap: float = 0.5
  """Fraction of a micro-step's expert compute that transfers can hide
  under (the overlap window); copies beyond it would stall the step."""
  grad_bytes_per_expert: float | None = None
  """Bytes of a replica's accumulated gradient sent home when it leaves
  (f32 accumulation: twice the bytes of bf16 weights); None: the same as
  `bytes_per_expert`."""
  row_bytes: float = 0.0
  """Bytes of one token-assignment's activation row in the dispatch
  all-to-all (d_model x activation bytes). A placement decides which rows
  cross devices and nodes, so when this is > 0 the choice between ForeMoE
  and foresight_split per layer prices the all-to-alls too (0: compute and
  copies only)."""
  a2a_passes: int = 4
  """All-to-alls of one layer per micro-step in the update: dispatch and
  combine forward, their transposes backward."""

  def __post_init__(self):
    if self.token_time_s <= 0 or self.bytes_per_expert < 0:
      raise ValueError('token_time_s must be > 0, bytes_per_expert >= 0.')
    if self.intra_node_bw <= 0 or self.inter_node_bw <= 0:
      raise ValueError('bandwidths must be > 0.')
    if self.grad_bytes_per_expert is not None and self.grad_bytes_per_expert < 0:
      raise ValueError('grad_bytes_per_expert must be >= 0.')
    if not 0.0 <= self.overlap <= 1.0:
      raise ValueError(f'overlap = {self.overlap} must be in [0, 1].')
    if self.row_bytes < 0 or self.a2a_passes < 0:
      raise ValueError('row_bytes and a2a_passes must be >= 0.')

  @classmethod
  def from_expert_shape(cls, d_model: int, d_ff: int, bytes_per_param=2,
                        flops_per_s=4e14, grad_bytes_per_param=4,
                        **kwargs) -> 'CostModel':
    """A SwiGLU expert has 3 d_model x d_ff matrices; fwd + bwd costs 6 flops
    per parameter per token (2 forward, 4 backward). Gradients accumulate
    in f32 (4 bytes per parameter) whatever the weights' dtype."""
    params = 3 * d_model * d_ff
    return cls(token_time_s=6.0 * params / flops_per_s,
               bytes_per_expert=float(params * bytes_per_param),
               grad_bytes_per_expert=float(params * grad_bytes_per_param),
               **kwargs)

  def all_to_all_s(self, cells_LSD, node_D) -> np.ndarray:
    """Seconds of one layer's all-to-alls in one micro-step: [L]. cells
    [L, source, destination] rows; a device's time is its busier direction,
    rows to its own node over `intra_node_bw` and to other nodes over
    `inter_node_bw`, the two tiers in parallel (the diagonal stays local);
    times `a2a_passes`. Zero when `row_bytes` is 0."""
    cells = np.asarray(cells_LSD, np.float64) * self.row_bytes
    num_layers = cells.shape[0]
    if not self.row_bytes or cells.shape[-1] == 1:
      return np.zeros(num_layers)
    node_D = np.asarray(node_D)
    same = node_D[:, None] == node_D[None, :]
    intra = same & ~np.eye(len(node_D), dtype=bool)
    out = np.zeros(num_layers)
    for x in (cells, cells.transpose(0, 2, 1)):  # Sends, then receives.
      t = np.maximum((x * intra).sum(axis=2) / self.intra_node_bw,
                     (x * ~same).sum(axis=2) / self.inter_node_bw)
      out = np.maximum(out, t.max(axis=1))
    return self.a2a_passes * out

  def move_time_s(self, inter_node):
    """Seconds to copy one expert, per move (array-friendly)."""
    bw = np.where(inter_node, self.inter_node_bw, self.intra_node_bw)
    return self.bytes_per_expert / bw

  def move_tokens(self, inter_node):
    """A move's cost in token-assignments of straggler compute."""
    return self.move_time_s(inter_node) / self.token_time_s

  @property
  def grad_bytes(self) -> float:
    """Bytes of one expert's gradient sent home."""
    return (self.bytes_per_expert if self.grad_bytes_per_expert is None
            else self.grad_bytes_per_expert)

  @property
  def return_factor(self) -> float:
    """A copy's full price over its weights alone: the copy plus, later,
    its gradient sent home."""
    return 1.0 + self.grad_bytes / max(self.bytes_per_expert, 1e-30)

  def return_tokens(self, inter_node):
    """Sending one expert's gradient home, in token-assignments."""
    bw = np.where(inter_node, self.inter_node_bw, self.intra_node_bw)
    return self.grad_bytes / bw / self.token_time_s
