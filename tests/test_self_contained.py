"""The repository stands on its own: nothing in it refers to files outside it.

Scans the repository's text files (`git ls-files`: tracked files plus new
ones git does not ignore; binary files and recorded traces are skipped) for
references to notes kept outside the repository, and checks that every
design cite, `docs/design.md §N` or `§N.M`, names a section that
docs/design.md has (its `## N.` and `### N.M` headings).
"""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN_DOC = 'docs/design.md'
SKIP_PREFIXES = ('results/traces/',)

# The patterns are assembled from pieces so that this file, which is
# scanned too, does not match them itself.
_UP_SHARED = re.escape('..' + '/' + 'shared')
FORBIDDEN = (
    (re.compile(_UP_SHARED), 'a path into a folder beside the repository'),
    (re.compile('shared' + '/' + 'DESIGN', re.IGNORECASE),
     'the design note outside the repository'),
    (re.compile('STYLE' + r'\.md', re.IGNORECASE),
     'a style note outside the repository (style lives in CONTRIBUTING.md)'),
    (re.compile(r'\b' + 'DESIGN' + r'\s*(?:§|\d|section\b)'),
     f'a design cite that does not name {DESIGN_DOC}'),
)
# Any file name that ends like the design document's must be that document.
_DESIGN_NAME = re.compile(r'[\w./-]*' + 'design' + r'\.md', re.IGNORECASE)
_NUM = r'(\d+(?:\.\d+)?)'
_CITE = re.compile(re.escape(DESIGN_DOC) + r'\s*§\s*' + _NUM
                   + r'(?:\s*[-–]\s*§?\s*' + _NUM + r')?')
_BARE_CITE = re.compile(r'§\s*' + _NUM + r'(?:\s*[-–]\s*§?\s*' + _NUM + r')?')


def repo_files():
  """Paths (relative to ROOT) of the tracked and not-ignored new files."""
  try:
    out = subprocess.run(
        ['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
        cwd=ROOT, capture_output=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError) as err:
    pytest.skip(f'not a git checkout ({err}); nothing to scan')
  paths = sorted({p for p in out.decode().split('\0') if p})
  return [p for p in paths if not p.startswith(SKIP_PREFIXES)
          and os.path.isfile(os.path.join(ROOT, p))]


def read_text(path):
  """The file's text, or None for a binary file."""
  with open(os.path.join(ROOT, path), 'rb') as f:
    data = f.read()
  if b'\0' in data:
    return None
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError:
    return None


def design_sections(text):
  """Section numbers of the design document: {'1', ..., '6.5', ...}."""
  sections = set(re.findall(r'^##\s+(\d+)\.\s', text, re.MULTILINE))
  sections |= set(re.findall(r'^###\s+(\d+\.\d+)\s', text, re.MULTILINE))
  return sections


def _line(text, pos):
  return text.count('\n', 0, pos) + 1


def problems_in(path, text, sections):
  """'path:line: message' for every outside reference or unknown cite."""
  out = []
  for pattern, what in FORBIDDEN:
    for m in pattern.finditer(text):
      out.append(f'{path}:{_line(text, m.start())}: {m.group(0)!r} is {what}')
  for m in _DESIGN_NAME.finditer(text):
    if m.group(0) != DESIGN_DOC:
      out.append(f'{path}:{_line(text, m.start())}: {m.group(0)!r} is not '
                 f'{DESIGN_DOC}')
  # Inside the design document a bare §N refers to itself.
  cite = _BARE_CITE if path == DESIGN_DOC else _CITE
  for m in cite.finditer(text):
    for number in filter(None, m.groups()):
      if number not in sections:
        out.append(f'{path}:{_line(text, m.start())}: {m.group(0)!r} cites '
                   f'§{number}, which {DESIGN_DOC} does not have')
  return out


@pytest.fixture(scope='module')
def sections():
  with open(os.path.join(ROOT, DESIGN_DOC), encoding='utf-8') as f:
    found = design_sections(f.read())
  assert found, f'{DESIGN_DOC} has no numbered "## N." sections'
  return found


def test_nothing_refers_outside_the_repository(sections):
  files = repo_files()
  assert DESIGN_DOC in files and 'CONTRIBUTING.md' in files
  problems = []
  for path in files:
    text = read_text(path)
    if text is not None:
      problems += problems_in(path, text, sections)
  assert not problems, '\n'.join(problems)


def test_the_scan_catches_what_it_should(sections):
  up = '..' + '/'
  bad = {
      'outside path': f'see {up}shared/notes.md',
      'outside note': 'see shared/' + 'DESIGN' + '.' + 'md',
      'style note': 'as ' + 'STYLE' + '.md says',
      'numbered cite': '(' + 'DESIGN' + ' 6.3)',
      'old file name': '(' + 'DESIGN' + '.' + 'md §4)',
      'unknown section': f'({DESIGN_DOC} §99)',
      'unknown range end': f'({DESIGN_DOC} §6.1-6.99)',
  }
  for name, text in bad.items():
    assert problems_in('x.py', text, sections), name
  good = f'({DESIGN_DOC} §6.1-6.4); shared memory; a shared expert'
  assert not problems_in('x.py', good, sections)
