"""pytest setup shared by nbval and tests/.

Two changes to the notebooks as nbval reads them (in memory; the files are untouched):
- nbdev-clean strips execution counts but keeps outputs; nbval then fails every cell with a stored
  output ("Unrun reference cell has outputs"). Renumbering the cells as they are read fixes it.
- A cell marked `#| eval: false` is one no test may run (nbdev-test skips it; an `nbdev_export()`
  run under test would rewrite the package while other notebooks import it): nbval skips it too.
"""
import re
import nbval.plugin as _nbval

_read = _nbval.nbformat.read
EVAL_FALSE = re.compile(r"^\s*#\|\s*eval\s*:\s*false\s*$", re.MULTILINE)


def _read_for_nbval(*args, **kwargs):
    nb = _read(*args, **kwargs)
    for i, cell in enumerate(nb.cells, 1):
        if cell.cell_type != "code": continue
        if cell.get("outputs") and cell.get("execution_count") is None:
            cell.execution_count = i
        if EVAL_FALSE.search(cell.source):
            cell.metadata["tags"] = [*cell.metadata.get("tags", []), "nbval-skip"]
    return nb


_nbval.nbformat.read = _read_for_nbval
