"""Checks of the notebooks as nbval and nbdev read them: a marker nbval would not parse, or an export cell that a
test run would execute, fails here instead of silently doing nothing (or rewriting the package mid-suite)."""

import os, re, subprocess, sys
from pathlib import Path
import nbformat, pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output
from nbval.plugin import comment_markers

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / 'nbs').rglob('*.ipynb'))
MARKERISH = re.compile(r'NBVAL|PYTEST_VALIDATE', re.IGNORECASE)
EVAL_FALSE = re.compile(r'^\s*#\|\s*eval\s*:\s*false\s*$', re.MULTILINE | re.IGNORECASE)


def _code_cells(path):
    nb = nbformat.read(path, as_version=4)
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == 'code']


def bad_markers(source: str) -> list:
    "Lines with what looks like an nbval marker that nbval ignores: it reads whole comment lines, exactly a marker"

    def ignored(line):
        line = line.strip()
        if line.startswith('#'):
            return line.lstrip('#').strip() not in comment_markers
        return '#' in line and bool(MARKERISH.search(line.split('#', 1)[1]))  # a marker after code

    return [l.strip() for l in source.splitlines() if MARKERISH.search(l) and ignored(l)]


def test_bad_markers_found():
    assert bad_markers('# NBVAL_IGNORE_OUTPUT (bf16 figures vary)\nx') == ['# NBVAL_IGNORE_OUTPUT (bf16 figures vary)']
    assert bad_markers('#nbval_skip\n# NBVAL_IGNORE_OUTPUT\n  #  NBVAL_SKIP  ') == ['#nbval_skip']
    assert bad_markers('x = "NBVAL in a string"') == []
    assert bad_markers('x = 1  # NBVAL_IGNORE_OUTPUT') == ['x = 1  # NBVAL_IGNORE_OUTPUT']


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT / 'nbs')))
def test_markers_are_exact(path):
    bad = [(i, l) for i, src in _code_cells(path) for l in bad_markers(src)]
    assert not bad, (
        f"{path.name}: nbval ignores these markers (put the marker alone on its comment line, "
        f"the reason on the line above): {bad}"
    )


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT / 'nbs')))
def test_export_cells_never_run_under_test(path):
    bad = [i for i, src in _code_cells(path) if 'nbdev_export(' in src and not EVAL_FALSE.search(src)]
    assert not bad, (
        f"{path.name}: cells {bad} call nbdev_export() without '#| eval: false'; "
        "a test run would rewrite molt_nb/ while other notebooks import it"
    )


def test_nbval_failures_name_the_notebook_cell_without_ansi(tmp_path):
    "Real nbval, through pytest with the checkout's conftest: failures named by the cell's place and id, no colours"
    nb = new_notebook(
        cells=[
            new_markdown_cell('# A notebook', id='title'),
            new_code_cell('1 + 1', id='right', outputs=[new_output('execute_result', {'text/plain': '2'})]),
            new_markdown_cell('Prose between the cells, which nbval does not count.', id='prose'),
            new_code_cell(
                'print("computed")', id='wrong', outputs=[new_output('stream', name='stdout', text='stored\n')]
            ),
            new_code_cell('def f(): return 1 / 0\nf()', id='raises'),
        ]
    )
    nbformat.write(nb, tmp_path / 'tiny.ipynb')
    env = {k: v for k, v in os.environ.items() if k not in ('PY_COLORS', 'FORCE_COLOR')}  # as in a CI log
    r = subprocess.run(
        [
            sys.executable,
            '-m',
            'pytest',
            '-p',
            'conftest',
            '--nbval',
            str(tmp_path / 'tiny.ipynb'),
            '--nbval-sanitize-with',
            str(ROOT / 'nbval_sanitize.cfg'),
            '-p',
            'no:cacheprovider',
            '--rootdir',
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1 and '2 failed, 1 passed' in out, out
    assert '\x1b' not in out, out
    assert 'tiny.ipynb::Cell 4 (id wrong)' in out and 'tiny.ipynb::Cell 5 (id raises)' in out, out
    assert 'Cell 4: Cell outputs differ' in out and 'Cell 5: Cell execution caused an exception' in out, out
    assert '- computed\n' in out and '+ stored\n' in out and 'ZeroDivisionError: division by zero' in out, out
