"""Checks of the notebooks as nbval and nbdev read them: a marker nbval would not parse, or an export cell that a
test run would execute, fails here instead of silently doing nothing (or rewriting the package mid-suite)."""
import re
from pathlib import Path
import nbformat, pytest
from nbval.plugin import comment_markers

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT/'nbs').rglob('*.ipynb'))
MARKERISH = re.compile(r'NBVAL|PYTEST_VALIDATE', re.IGNORECASE)
EVAL_FALSE = re.compile(r'^\s*#\|\s*eval\s*:\s*false\s*$', re.MULTILINE | re.IGNORECASE)

def _code_cells(path):
    nb = nbformat.read(path, as_version=4)
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == 'code']

def bad_markers(source:str) -> list:
    "Lines with what looks like an nbval marker that nbval ignores: it reads whole comment lines, exactly a marker"
    def ignored(line):
        line = line.strip()
        if line.startswith('#'): return line.lstrip('#').strip() not in comment_markers
        return '#' in line and bool(MARKERISH.search(line.split('#', 1)[1])) # a marker after code
    return [l.strip() for l in source.splitlines() if MARKERISH.search(l) and ignored(l)]

def test_bad_markers_found():
    assert bad_markers('# NBVAL_IGNORE_OUTPUT (bf16 figures vary)\nx') == ['# NBVAL_IGNORE_OUTPUT (bf16 figures vary)']
    assert bad_markers('#nbval_skip\n# NBVAL_IGNORE_OUTPUT\n  #  NBVAL_SKIP  ') == ['#nbval_skip']
    assert bad_markers('x = "NBVAL in a string"') == []
    assert bad_markers('x = 1  # NBVAL_IGNORE_OUTPUT') == ['x = 1  # NBVAL_IGNORE_OUTPUT']

@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT/'nbs')))
def test_markers_are_exact(path):
    bad = [(i, l) for i, src in _code_cells(path) for l in bad_markers(src)]
    assert not bad, (f"{path.name}: nbval ignores these markers (put the marker alone on its comment line, "
                     f"the reason on the line above): {bad}")

@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT/'nbs')))
def test_export_cells_never_run_under_test(path):
    bad = [i for i, src in _code_cells(path) if 'nbdev_export(' in src and not EVAL_FALSE.search(src)]
    assert not bad, (f"{path.name}: cells {bad} call nbdev_export() without '#| eval: false'; "
                     "a test run would rewrite molt_nb/ while other notebooks import it")
