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


class _EventFile:
  """One event file written on the caller's thread: an event is in the
  file when its add_* returns, and on disk after `flush`.

  tensorboardX's SummaryWriter hands events to a queue that a thread of
  its own writes out, and its flush flushes the file, not the queue: a
  step logged and flushed could still be in the queue when the process
  died (or when a reader looked; a test saw a step missing). The same
  file format, from tensorboardX's own writer of event records and its
  summary builders, and the same methods as the SummaryWriter calls used
  here.
  """

  def __init__(self, logdir: str, purge_step: int | None):
    # pylint: disable=g-import-not-at-top
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2
    from tensorboardX import summary
    self._pb, self._summary = event_pb2, summary
    os.makedirs(logdir, exist_ok=True)
    # The file name holds the creation time in seconds; a second writer
    # made within the same second (a rerun, a test) would write over the
    # first's file. The nanoseconds in the suffix keep them apart and order
    # them (`read_scalars`). The file starts with its version event.
    self._file = EventsWriter(os.path.join(logdir, 'events'),
                              f'.{time.time_ns()}')
    if purge_step is not None:
      # What TensorBoard reads as a restart at purge_step: it hides the
      # earlier files' events at that step or later (as SummaryWriter's
      # purge_step writes it).
      pb = self._pb
      self._event(pb.Event(step=purge_step, file_version='brain.Event:2'))
      self._event(pb.Event(step=purge_step, session_log=pb.SessionLog(
          status=pb.SessionLog.START)))
    # TensorBoard's default histogram buckets (SummaryWriter's 'tensorflow'
    # bins): +-1e-12 growing by 10% to 1e20, and 0.
    edges, v = [], 1e-12
    while v < 1e20:
      edges.append(v)
      v *= 1.1
    self._bins = [-e for e in reversed(edges)] + [0] + edges

  def _event(self, event):
    event.wall_time = time.time()
    self._file.write_event(event)

  def _add(self, summary, step: int):
    self._event(self._pb.Event(summary=summary, step=int(step)))

  def add_scalar(self, tag: str, value: float, step: int):
    self._add(self._summary.scalar(tag, value), step)

  def add_histogram(self, tag: str, values, step: int):
    self._add(self._summary.histogram(tag, values, self._bins), step)

  def add_image(self, tag: str, image, step: int, dataformats: str):
    self._add(self._summary.image(tag, image, dataformats=dataformats), step)

  def add_text(self, tag: str, text: str, step: int):
    self._add(self._summary.text(tag, text), step)

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


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
    if not available():
      if warn:
        print(MISSING, file=sys.stderr, flush=True)
      self._w = None
      return
    self._w = _EventFile(self.logdir, purge_step)

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
    # `_EventFile` writes as it is called, so this flush has all of them.
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
