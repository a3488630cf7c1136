"""pytest setup shared by nbval and tests/.

nbval runs every notebook once (`make nbval`); two changes to the notebooks as it reads them make that run
what `nbdev-test` would be (in memory: the files are untouched):
- nbdev-clean strips execution counts but keeps outputs; nbval then fails every cell with a stored
  output ("Unrun reference cell has outputs"). Renumbering the cells as they are read fixes it.
- A cell marked `#| eval: false` (no test may run it: an `nbdev_export()` run under test would rewrite the
  package while other notebooks import it) or with one of `[tool.nbdev] tst_flags` (`#| gpu`, `#| slow`, ...:
  run them with `nbdev-test --flags gpu` where they can run) is skipped, as nbdev-test skips it.
And its report is made readable in a CI log: a cell is named by its place in the notebook (1-based, markdown cells
counted: the execution count given above) and its cell id, where nbval counts code cells only; ANSI colour codes
(nbval's own, and the kernel's coloured tracebacks, which `--color=no` keeps) are stripped from failures.
"""
import re
from pathlib import Path

try:
    import nbval.plugin as _nbval
    from nbdev.config import get_config
except ImportError:  # a venv without the notebook tools (.venv-vllm runs tests/vllm only): nothing to patch
    _nbval = None


def _patch_nbval():
    "Install the changes above into nbval (called once, when nbval is importable)."
    global _read, _FLAGS, SKIPPED, ANSI, _collect, _repr_failure
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

    ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
    _collect, _repr_failure = _nbval.IPyNbFile.collect, _nbval.IPyNbCell.repr_failure

    def _collect_by_place(self):
        for item in _collect(self):  # the first item comes after nbval has read self.nb
            i = next(i for i, c in enumerate(self.nb.cells, 1) if c is item.cell)
            name = f"Cell {i}" + (f" (id {item.cell.id})" if item.cell.get("id") else "")
            yield _nbval.IPyNbCell.from_parent(self, name=name, cell_num=i, cell=item.cell, options=item.options)

    def _reportinfo(self):
        return self.fspath, 0, f"{self.fspath.relto(self.config.rootdir) or self.fspath}::{self.name}"

    _nbval.IPyNbFile.collect = _collect_by_place
    _nbval.IPyNbCell.reportinfo = _reportinfo
    _nbval.IPyNbCell.repr_failure = lambda self, excinfo: ANSI.sub("", _repr_failure(self, excinfo))


if _nbval is not None:
    _patch_nbval()
