"""Flags every benchmark shares, and the one call that ends each of them."""
import json
import os
import sys

from absl import flags

from foremoe_jax.utils import results

RESULTS_DIR = flags.DEFINE_string(
    'results_dir', results.DEFAULT_DIR,
    'Also write the run info and result to <results_dir>/<bench>.json, which '
    'experiments.render_results turns into the README tables; empty: do not.')


def finish(bench: str, run: dict, result: dict, *, subset: bool = False
           ) -> None:
  """Prints the result as the last line and saves it under --results_dir.

  subset: the run covered only part of the bench (a --calls or --sites
  filter); it is saved only where --results_dir was given, so that a quick
  look at one part does not replace the committed file (and the tables
  rendered from it) with that part.
  """
  if subset and not flags.FLAGS['results_dir'].present:
    print(f'# not saved: a part of {bench} (--results_dir=DIR saves it)',
          flush=True)
  else:
    path = results.save(bench, run, result, results_dir=RESULTS_DIR.value)
    if path:
      print(f'# saved: {path}', flush=True)
  print(json.dumps(result), flush=True)


def progress(json_mode: bool):
  """Where a benchmark's progress lines go: stdout for a run people read;
  stderr under --json, so stdout stays the setup and one JSON line while a
  long run (the RL step's repetitions, the simulator's validation) still
  shows it is alive."""
  if not json_mode:
    return print
  return lambda *a, **k: print(*a, file=sys.stderr, flush=True)


def plot_dir(out_dir: str, bench: str) -> str | None:
  """Where a benchmark's PNGs go: --out_dir when given, else a folder named
  for the benchmark beside its JSON (<results_dir>/<bench>, so
  results/<bench> by default): a run written to a scratch --results_dir
  leaves the committed plots alone. None (no plots) when neither is set."""
  if out_dir:
    return out_dir
  return os.path.join(RESULTS_DIR.value, bench) if RESULTS_DIR.value else None
