"""Benchmark results on disk: `results/<bench>.json`, one file per benchmark.

Each benchmark prints its run info first and its result last; `save` also
writes both to `results/<bench>.json` together with the command that produced
them, so `experiments.render_results` can rebuild the README's tables with
the command, machine and versions beside each one, and a test can check
that the README still says what the files say.

File layout: {"bench", "command", "run": run_info(...), "result": {...}}.
The write goes through a temporary file and a rename, so an interrupted run
never leaves a half-written result behind.
"""
from __future__ import annotations

import json
import os
import shlex
import sys

DEFAULT_DIR = 'results'


def command_line(argv: list[str] | None = None) -> str:
  """The `python -m experiments.X ...` command of this process."""
  argv = list(sys.argv if argv is None else argv)
  prog = argv[0] if argv else ''
  # `python -m experiments.X` leaves the module's file path in argv[0].
  if prog.endswith('.py'):
    folder, name = os.path.split(os.path.abspath(prog))
    if os.path.basename(folder) == 'experiments':
      prog = f'-m experiments.{name[:-3]}'
  # Where the file was written is not part of what ran: a run written to a
  # scratch folder and copied into results/ names the command that
  # regenerates it in place.
  args, skip = [], False
  for a in argv[1:]:
    if skip:
      skip = False
    elif a == '--results_dir':
      skip = True
    elif not a.startswith('--results_dir='):
      args.append(a)
  return ' '.join(['python', prog, *map(shlex.quote, args)]).strip()


def _plain(x):
  """json.dump's fallback: numpy scalars and arrays as numbers, else str."""
  if hasattr(x, 'tolist'):
    return x.tolist()
  return str(x)


def path_for(bench: str, results_dir: str = DEFAULT_DIR) -> str:
  return os.path.join(results_dir, f'{bench}.json')


def save(bench: str, run: dict, result: dict, *,
         results_dir: str | None = DEFAULT_DIR,
         argv: list[str] | None = None,
         command: str | None = None) -> str | None:
  """Writes results/<bench>.json atomically; returns its path (None: off).
  command: what regenerates it, when not this process's `python -m`
  (e.g. a make target)."""
  if not results_dir:
    return None
  os.makedirs(results_dir, exist_ok=True)
  path = path_for(bench, results_dir)
  record = {'bench': bench, 'command': command or command_line(argv),
            'run': run,
            'result': result}
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(record, f, indent=1, default=_plain)
    f.write('\n')
  os.replace(tmp, path)
  return path


def load(bench: str, results_dir: str = DEFAULT_DIR) -> dict:
  path = path_for(bench, results_dir)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f'{path} is missing: run `python -m experiments.{bench} --json` to '
        'write it.')
  with open(path) as f:
    record = json.load(f)
  for key in ('bench', 'command', 'run', 'result'):
    if key not in record:
      raise ValueError(f'{path}: no {key!r} key; it was not written by '
                       'foremoe_jax.utils.results.save.')
  return record
