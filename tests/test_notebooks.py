"""Every notebook's code cells run top to bottom in a fresh process."""
import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, 'notebooks', '*.ipynb')))


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
  nb = json.load(open(path))
  source = '\n\n'.join(''.join(c['source']) for c in nb['cells']
                       if c['cell_type'] == 'code')
  script = tmp_path / 'nb.py'
  script.write_text(source)
  env = dict(os.environ, NOTEBOOK_FIG=str(tmp_path / 'fig.png'),
             PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'foremoe' in out.stdout
  assert (tmp_path / 'fig.png').exists()
