"""pytest setup shared by nbval and tests/.

nbval runs every notebook once (`make nbval`); two changes to the notebooks as it reads them make that run
what `nbdev-test` would be (in memory: the files are untouched):
- nbdev-clean strips execution counts but keeps outputs; nbval then fails every cell with a stored
  output ("Unrun reference cell has outputs"). Renumbering the cells as they are read fixes it.
- A cell marked `#| eval: false` (no test may run it: an `nbdev_export()` run under test would rewrite the
  package while other notebooks import it) or with one of `[tool.nbdev] tst_flags` (`#| gpu`, `#| slow`, ...:
  run them with `nbdev-test --flags gpu` where they can run) is skipped, as nbdev-test skips it.
"""
import re
from pathlib import Path
import nbval.plugin as _nbval
from nbdev.config import get_config

_read = _nbval.nbformat.read
_FLAGS = "|".join(map(re.escape, get_config(Path(__file__).parent).tst_flags.split()))
SKIPPED = re.compile(rf"^\s*#\|\s*(eval\s*:\s*false|{_FLAGS})\s*$", re.MULTILINE | re.IGNORECASE)


def _read_for_nbval(*args, **kwargs):
    nb = _read(*args, **kwargs)
    for i, cell in enumerate(nb.cells, 1):
        if cell.cell_type != "code": continue
        if cell.get("outputs") and cell.get("execution_count") is None:
            cell.execution_count = i
        if SKIPPED.search(cell.source):
            cell.metadata["tags"] = [*cell.metadata.get("tags", []), "nbval-skip"]
    return nb


_nbval.nbformat.read = _read_for_nbval
