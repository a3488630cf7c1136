"""Checks of the notebooks as nbval and nbdev read them: a marker nbval would not parse, or an export cell that a
test run would execute, fails here instead of silently doing nothing (or rewriting the package mid-suite)."""
import re
from pathlib import Path
import nbformat, pytest
from nbval.plugin import comment_markers

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT/'nbs').rglob('*.ipynb'))
MARKERISH = re.compile(r'NBVAL|PYTEST_VALIDATE', re.IGNORECASE)

def _code_cells(path):
    nb = nbformat.read(path, as_version=4)
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == 'code']

def bad_markers(source:str) -> list:
    "Comment lines that look like an nbval marker but are not exactly one (nbval matches the whole comment)"
    comments = [l.strip() for l in source.splitlines() if l.strip().startswith('#')]
    return [l for l in comments if MARKERISH.search(l) and l.lstrip('#').strip() not in comment_markers]

def test_bad_markers_found():
    assert bad_markers('# NBVAL_IGNORE_OUTPUT (bf16 figures vary)\nx') == ['# NBVAL_IGNORE_OUTPUT (bf16 figures vary)']
    assert bad_markers('#nbval_skip\n# NBVAL_IGNORE_OUTPUT\n  #  NBVAL_SKIP  ') == ['#nbval_skip']
    assert bad_markers('x = "NBVAL in a string"') == []

@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT/'nbs')))
def test_markers_are_exact(path):
    bad = [(i, l) for i, src in _code_cells(path) for l in bad_markers(src)]
    assert not bad, f"{path.name}: nbval ignores these markers (put the marker alone on its comment line, the reason on the line above): {bad}"

@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT/'nbs')))
def test_export_cells_never_run_under_test(path):
    bad = [i for i, src in _code_cells(path) if 'nbdev_export(' in src and not re.search(r'^#\|\s*eval:\s*false\s*$', src, re.M)]
    assert not bad, f"{path.name}: cells {bad} call nbdev_export() without '#| eval: false'; a test run would rewrite molt_nb/ while other notebooks import it"
