"""TensorBoard event files of a run, beside metrics.jsonl.

`TensorBoardWriter.write(step, record)` logs every number of a metrics
record as a scalar under `<phase>/<name>` (a list of numbers, such as the
per-micro-step max/mean, as `<phase>/<name>/<i>`), and a `device_load_MD`
record as one histogram of the per-device load per micro-step plus its
max/mean, an `expert_tokens_LE` record (tokens per MoE layer and expert,
foresight/expert_load.py) as one histogram per layer plus an image of the
layer x expert heatmap (the Images tab), and a `samples` record (decoded
prompts and completions) as a markdown table under the Text tab.
`tensorboard --logdir <workdir>/tensorboard` shows the run live, one run
per phase. Host-side; tensorboardX is imported when the writer is made,
and without it the writer says so (unless warn=False) and writes nothing
(metrics.jsonl stays complete).
In a multi-process run only process 0 writes.

The trainer gives each phase its own run (`tensorboard/warmstart`,
`tensorboard/msa_distill`, `tensorboard/rl`: `phase_dir`) and opens it with
`purge_step`, the first step it is about to write: TensorBoard then hides
the events a crashed attempt wrote at that step or later, so a resumed run
shows each step once. Per-phase runs keep that purge from reaching another
phase's steps (the warm start's step 100 is not the RL phase's).

`read_scalars` parses the event files back (the TFRecord framing and the
Event proto that tensorboardX ships), purging as TensorBoard does, for tests
and notebooks.
"""
from __future__ import annotations

import glob
import math
import os
import struct
import sys
import time

import numpy as np

from foremoe_jax.foresight import expert_load
from foremoe_jax.utils import distributed

TB_DIR = 'tensorboard'


def _numbers(value):
  if isinstance(value, bool):
    return None
  if isinstance(value, (int, float)) and math.isfinite(value):
    return float(value)
  return None


def phase_dir(phase: str) -> str:
  """The subdirectory of a workdir that holds one phase's run."""
  return os.path.join(TB_DIR, phase)


def available() -> bool:
  """Whether tensorboardX can be imported (else writers write nothing)."""
  try:
    import tensorboardX  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


MISSING = ('tensorboardX is not installed: no TensorBoard events (pip install '
           'tensorboardX); the .jsonl files have every metric')


class TensorBoardWriter:

  def __init__(self, workdir: str, subdir: str = TB_DIR, *,
               purge_step: int | None = None, warn: bool = True):
    """Events under workdir/subdir.

    Args:
      workdir: The run's directory.
      subdir: The run's TensorBoard directory inside it.
      purge_step: The first step this writer will log: events an earlier
        writer left in the directory at that step or later are hidden
        (a resumed run's steps past its checkpoint). None hides nothing.
      warn: Say on stderr when tensorboardX is missing.
    """
    self.logdir = os.path.join(workdir, subdir)
    if not distributed.is_primary():  # Process 0 logs for all.
      self._w = None
      return
    try:
      import tensorboardX  # pylint: disable=g-import-not-at-top
    except ImportError:
      if warn:
        print(MISSING, file=sys.stderr, flush=True)
      self._w = None
      return
    # The file name holds the creation time in seconds; a second writer
    # made within the same second (a rerun, a test) would write over the
    # first's file. The nanoseconds in the suffix keep them apart and order
    # them (`read_scalars`).
    self._w = tensorboardX.SummaryWriter(
        self.logdir, flush_secs=10, purge_step=purge_step,
        filename_suffix=f'.{time.time_ns()}')

  def write(self, step: int, record: dict) -> None:
    if self._w is None:
      return
    phase = record.get('phase', 'run')
    for name, value in record.items():
      if name == 'samples':  # Decoded samples (trainer.samples_for_log).
        self._samples(step, value)
        continue
      if name == 'device_load_MD':
        self._device_loads(step, phase, np.asarray(value, np.float64))
        continue
      if name == expert_load.TOKENS_KEY:
        self._expert_tokens(step, phase, np.asarray(value, np.float64))
        continue
      x = _numbers(value)
      if x is not None:
        self._w.add_scalar(f'{phase}/{name}', x, step)
      elif isinstance(value, (list, tuple)) and value and all(
          _numbers(v) is not None for v in value):
        for i, v in enumerate(value):
          self._w.add_scalar(f'{phase}/{name}/{i}', float(v), step)
    # On disk each step, as metrics.jsonl is: a crash must not lose steps
    # its checkpoint holds (the resumed run does not log them again).
    self._w.flush()

  def _samples(self, step, samples):
    """A markdown table of the samples, under TensorBoard's Text tab."""
    cell = lambda x: str(x).replace('|', '\\|').replace('\n', '<br>')
    rows = ['| prompt | completion | reference | reward |', '|---|---|---|---|']
    rows += [f"| {cell(s['prompt'])} | {cell(s['completion'])} | "
             f"{cell(s['reference'] or '')} | {s['reward']:.3g} |"
             for s in samples]
    self._w.add_text('rl/samples', '\n'.join(rows), step)

  def _device_loads(self, step, phase, load_MD):
    for m, load_D in enumerate(load_MD):
      self._w.add_histogram(f'{phase}/device_load/microstep_{m}', load_D, step)
      mean = load_D.mean()
      if mean > 0:
        self._w.add_scalar(f'{phase}/device_load_max_over_mean/microstep_{m}',
                           float(load_D.max() / mean), step)

  def _expert_tokens(self, step, phase, tokens_LE):
    for layer, tokens_E in enumerate(tokens_LE):
      self._w.add_histogram(f'{phase}/expert_tokens/moe_layer_{layer}',
                            tokens_E, step)
    self._w.add_image(f'{phase}/expert_load_heatmap',
                      expert_load.heatmap_rgb(tokens_LE), step,
                      dataformats='HWC')

  def flush(self) -> None:
    if self._w is not None:
      self._w.flush()

  def close(self) -> None:
    if self._w is not None:
      self._w.close()
      self._w = None


def _created_ns(path: str) -> int:
  """When an event file was made, from its name: 'events.out.tfevents.<s>.
  <host>[.<ns>]', the nanoseconds suffix being this writer's."""
  parts = os.path.basename(path).split('.')
  if len(parts) > 5 and parts[-1].isdigit():
    return int(parts[-1])
  return int(parts[3]) * 10**9 if len(parts) > 3 and parts[3].isdigit() else 0


def _records(path: str):
  """Payloads of a TFRecord file: u64 length, u32 crc, data, u32 crc."""
  with open(path, 'rb') as f:
    data = f.read()
  i = 0
  while i + 12 <= len(data):
    (n,) = struct.unpack('<Q', data[i:i + 8])
    yield data[i + 12:i + 12 + n]
    i += 12 + n + 4


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} of every scalar in the logdir's files (not
  its subdirectories), in the order written. A writer's session start at
  step s (its `purge_step`) drops the values read so far at s or later, as
  TensorBoard hides them."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  out: dict[str, list[tuple[int, float]]] = {}
  paths = glob.glob(os.path.join(logdir, 'events.out.tfevents.*'))
  paths.sort(key=lambda p: (_created_ns(p), p))
  for path in paths:
    for payload in _records(path):
      event = event_pb2.Event.FromString(payload)
      if (event.HasField('session_log')
          and event.session_log.status == event_pb2.SessionLog.START):
        out = {tag: [(s, v) for s, v in values if s < event.step]
               for tag, values in out.items()}
      for v in event.summary.value:
        if v.HasField('simple_value'):
          out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out
