"""Every notebook runs top to bottom in a real kernel (nbclient), as a user
runs it, and its plots come out inline; and it is committed with the
outputs of such a run, so a reader sees them without running it."""
import glob
import json
import os

import pytest

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, 'notebooks', '*.ipynb')))


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_in_a_kernel_with_inline_plots(path, monkeypatch,
                                                     tmp_path):
  nbclient = pytest.importorskip('nbclient')
  nbformat = pytest.importorskip('nbformat')
  # The kernel inherits this environment: the repository on its path and
  # 8 simulated devices before jax is imported. Its temporary files (the
  # quickstart's workdir, 3 MB) go to the test's folder, not to /tmp,
  # where every run used to leave one.
  monkeypatch.setenv('PYTHONPATH', ROOT)
  monkeypatch.setenv('TMPDIR', str(tmp_path))
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8 '
                     + conftest.CPU_TEST_XLA_FLAGS)
  # The quickstart's RL section on a small budget (two warm-start steps:
  # the section's path and plots are those of a longer one).
  monkeypatch.setenv('QUICKSTART_WARMSTART_STEPS', '2')
  monkeypatch.setenv('QUICKSTART_RL_STEPS', '2')
  monkeypatch.setenv('QUICKSTART_EVAL_PROMPTS', '0')
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name='python3',
                                   resources={'metadata': {'path': ROOT}})
  client.execute()  # Raises CellExecutionError, with the cell, on failure.
  outputs = [o for c in nb.cells if c.cell_type == 'code' for o in c.outputs]
  text = ''.join(o.get('text', '') for o in outputs if o.output_type == 'stream')
  assert 'foremoe' in text
  images = [o for o in outputs if 'image/png' in o.get('data', {})]
  assert images, 'no inline plot'
  if os.path.basename(path) == 'quickstart.ipynb':
    # The RL section ran its steps and shows the run's plots.
    assert 'step 2: reward ' in text, text[-2000:]
    assert len(images) >= 3, len(images)


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_committed_with_its_outputs(path):
  """What GitHub renders: every code cell ran once, in order, in one kernel
  (`jupyter execute --inplace`, notebooks/README.md), with no error and with
  its plots; and the file stays small enough to open."""
  with open(path, encoding='utf-8') as f:
    nb = json.load(f)
  code = [c for c in nb['cells'] if c['cell_type'] == 'code']
  assert [c['execution_count'] for c in code] == \
      list(range(1, len(code) + 1)), 're-run it: jupyter execute --inplace'
  outputs = [o for c in code for o in c['outputs']]
  assert not [o for o in outputs if o['output_type'] == 'error']
  images = [o for o in outputs if 'image/png' in o.get('data', {})]
  if os.path.basename(path) == 'quickstart.ipynb':
    assert len(images) >= 5, len(images)  # The heatmap and the run's plots.
  assert images
  assert os.path.getsize(path) < 1_000_000
