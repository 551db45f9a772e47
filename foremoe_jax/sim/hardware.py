"""Hardware profiles: the constants the cluster simulator turns work into time.

A profile describes one accelerator and how it is wired: achievable matmul
throughput, memory bandwidth, and the two network tiers (inside a node, and
between nodes), each with a bandwidth per device and a per-message latency.
Vendor peak numbers are the starting point; `matmul_efficiency` is the share
of peak a grouped expert GEMM of RL-sized batches reaches (an assumption,
stated per profile). `calibrate.cpu_profile` measures the same fields on this
machine instead of assuming them.

Published figures used (per device, one direction):
  H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 at 900 GB/s
    bidirectional (450 GB/s each way), one 400 Gb/s ConnectX-7 NIC per GPU
    (50 GB/s) in a DGX/HGX H100 node of 8.
  H800: the H100 die with NVLink cut to 400 GB/s bidirectional; DeepSeek-V3's
    report measures about 160 GB/s NVLink and 50 GB/s InfiniBand achievable
    per GPU, and those achieved numbers are used.
  TPU v5p: 459 TFLOP/s bf16, 2.765 TB/s HBM2e, 4800 Gb/s (600 GB/s) of ICI
    per chip over 6 links of a 3D torus; no node tier. An all-to-all on a
    torus pays the mean hop count, so its per-chip bandwidth is the ICI
    bandwidth over the mean number of hops (see `a2a_bandwidth`).
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """One device type and its network, all rates per device."""

  name: str
  peak_flops_per_s: float
  """Dense bf16 (f32 on CPU) matmul peak."""
  matmul_efficiency: float
  """Share of peak an expert GEMM reaches (assumption or measured)."""
  hbm_bw: float
  """Bytes/s of device memory (weight reads, copies, optimizer)."""
  devices_per_node: int
  """Devices on the fast tier (NVLink); 0 means every device (one tier)."""
  intra_bw: float
  """Bytes/s one device sends (or receives) to peers in its node."""
  intra_latency_s: float
  inter_bw: float
  """Bytes/s one device sends (or receives) to other nodes."""
  inter_latency_s: float
  layer_overhead_s: float = 0.0
  """Fixed seconds per layer and pass (kernel launches, small ops)."""
  forward_layer_overhead_s: float | None = None
  """Fixed seconds per layer of a forward-only pass (the recompute); None
  means `layer_overhead_s`. Measured apart on CPU, where the update's
  fixed cost per layer also carries its gradient bookkeeping."""
  forward_flops_per_s: float | None = None
  """Achieved FLOP/s of a forward-only pass, experts and the rest; None
  means the update's rates. Measured apart on CPU, where a backward runs
  at another rate than its forward (the tile loop's transposes)."""
  nonexpert_efficiency: float | None = None
  """Share of peak for the non-expert part (attention, norms, head); None
  means the same as `matmul_efficiency`."""
  transfer_overlap: float = 1.0
  """Share of a micro-step's compute that expert moves can hide under: 1 on
  GPUs/TPUs (copy engines and ICI DMAs run beside compute), 0 where
  collectives are synchronous (the XLA CPU backend)."""
  copy_bw: float | None = None
  """Bytes/s of one point-to-point expert copy when it differs from the
  tier's rate (measured on CPU, where a permute and an all-to-all cost
  differently); None: the tier's (a torus link on TPU)."""
  copy_latency_s: float | None = None
  torus: bool = False
  emulated_exchange: bool = False
  """The exact dispatch's ragged all-to-all is emulated by an all-to-all
  of fixed chunks (XLA:CPU has no ragged-all-to-all): every (source,
  destination) pair moves the per-cell bound, whatever it holds."""
  tiled_gemm: bool = False
  """The exact dispatch's grouped GEMM runs whole tiles per slot
  (`grouped_swiglu` 'tiles_lockstep', the CPU default): a device computes
  each slot's rows rounded up to the tile (`default_tile` of its bucket),
  so a placement that spreads an expert over more slots pays more partial
  tiles. False: rows as they arrive (`ragged_dot` on GPU/TPU)."""
  tile_overhead_s: float = 0.0
  """With `tiled_gemm`: fixed seconds per tile and pass, whatever the
  tile's rows (its loop step; in the backward, the weight gradient of a
  tile is a whole [M, F] matrix per weight, written and added into the
  slot's sum). Tiles grow with the bucket (`default_tile`), so without
  this term a fit on large buckets prices small ones' rows too low."""
  forward_tile_overhead_s: float | None = None
  """With `tiled_gemm`: fixed seconds per tile of a forward-only pass (the
  recompute); None means `tile_overhead_s`. Measured apart on CPU, where
  the update's per-tile cost is mostly its backward's (a tile's weight
  gradients written and added into the slot's sum) and a forward tile is
  a slice and two GEMMs."""
  hbm_bytes: float = 80e9
  """Device memory (H100/H800: 80 GB)."""
  """All devices on one 3D torus (TPU ICI): all-to-all pays the hop count."""
  notes: str = ''

  def __post_init__(self):
    for f in ('peak_flops_per_s', 'hbm_bw', 'intra_bw', 'inter_bw'):
      if getattr(self, f) <= 0:
        raise ValueError(f'{self.name}: {f} must be > 0.')
    if not 0 < self.matmul_efficiency <= 1:
      raise ValueError(f'{self.name}: matmul_efficiency must be in (0, 1].')
    if not 0 <= self.transfer_overlap <= 1:
      raise ValueError(f'{self.name}: transfer_overlap must be in [0, 1].')

  def forward_profile(self) -> 'HardwareProfile':
    """This profile as a forward-only pass sees it (the recompute's): its
    forward rate and per-layer overhead where they are set apart."""
    out = self
    if self.forward_flops_per_s is not None:
      out = dataclasses.replace(out, peak_flops_per_s=self.forward_flops_per_s,
                                matmul_efficiency=1.0,
                                nonexpert_efficiency=None)
    if self.forward_layer_overhead_s is not None:
      out = dataclasses.replace(out,
                                layer_overhead_s=self.forward_layer_overhead_s)
    if self.forward_tile_overhead_s is not None:
      out = dataclasses.replace(out,
                                tile_overhead_s=self.forward_tile_overhead_s)
    return out

  @property
  def flops_per_s(self) -> float:
    return self.peak_flops_per_s * self.matmul_efficiency

  @property
  def nonexpert_flops_per_s(self) -> float:
    eff = (self.matmul_efficiency if self.nonexpert_efficiency is None
           else self.nonexpert_efficiency)
    return self.peak_flops_per_s * eff

  def node_size(self, num_devices: int) -> int:
    """Devices per node in a group of `num_devices` (never more than it)."""
    if self.devices_per_node <= 0:
      return num_devices
    return min(self.devices_per_node, num_devices)

  def a2a_bandwidth(self, num_devices: int) -> tuple[float, float]:
    """(intra, inter) bytes/s per device in an all-to-all over the group."""
    if not self.torus:
      return self.intra_bw, self.inter_bw
    bw = self.intra_bw / mean_torus_hops(num_devices)
    return bw, bw


def mean_torus_hops(num_devices: int) -> float:
  """Mean shortest-path hops between two chips of a cubic 3D torus with
  wraparound (k chips per side, k = D^(1/3); k/4 hops per dimension)."""
  k = max(1.0, num_devices ** (1.0 / 3.0))
  return max(1.0, 3.0 * k / 4.0)


H100 = HardwareProfile(
    name='h100', peak_flops_per_s=989e12, matmul_efficiency=0.6,
    hbm_bw=3.35e12, devices_per_node=8, intra_bw=450e9, intra_latency_s=5e-6,
    inter_bw=50e9, inter_latency_s=10e-6, layer_overhead_s=100e-6,
    notes='DGX/HGX H100 node of 8: NVLink 4 (450 GB/s each way), one '
          '400 Gb/s NIC per GPU; 60% of peak for grouped expert GEMMs and '
          '100 us of launches per layer and pass are assumptions.')

H800 = HardwareProfile(
    name='h800', peak_flops_per_s=989e12, matmul_efficiency=0.6,
    hbm_bw=3.35e12, devices_per_node=8, intra_bw=160e9, intra_latency_s=5e-6,
    inter_bw=50e9, inter_latency_s=10e-6, layer_overhead_s=100e-6,
    notes='H800 node of 8 with the achieved NVLink (160 GB/s) and IB '
          '(50 GB/s) rates DeepSeek-V3 reports; compute as H100.')

TPU_V5P = HardwareProfile(
    name='tpu_v5p', peak_flops_per_s=459e12, matmul_efficiency=0.6,
    hbm_bw=2.765e12, devices_per_node=0, intra_bw=600e9, intra_latency_s=5e-6,
    inter_bw=600e9, inter_latency_s=5e-6, layer_overhead_s=50e-6, torus=True,
    hbm_bytes=95e9,
    notes='TPU v5p slice: one 3D-torus ICI tier, 600 GB/s per chip over 6 '
          'links; all-to-all divided by the mean hop count; a point-to-point '
          'expert copy gets one link (100 GB/s).')

PROFILES = {p.name: p for p in (H100, H800, TPU_V5P)}


def get_profile(name: str) -> HardwareProfile:
  if name not in PROFILES:
    raise ValueError(f'unknown hardware profile {name!r}; pick from '
                     f'{sorted(PROFILES)}.')
  return PROFILES[name]


def link_bandwidth(profile: HardwareProfile, inter_node: bool) -> float:
  """Bytes/s of one point-to-point copy (an expert move): a torus copy gets
  one of the chip's 6 links."""
  if profile.copy_bw is not None:
    return profile.copy_bw
  if profile.torus:
    return profile.intra_bw / 6.0
  return profile.inter_bw if inter_node else profile.intra_bw


def describe(profile: HardwareProfile) -> dict:
  d = dataclasses.asdict(profile)
  d['flops_per_s'] = profile.flops_per_s
  return {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
          for k, v in d.items()}


def link_latency(profile: HardwareProfile, inter_node: bool) -> float:
  if profile.copy_latency_s is not None:
    return profile.copy_latency_s
  return profile.inter_latency_s if inter_node else profile.intra_latency_s
