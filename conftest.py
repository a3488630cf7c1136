"""pytest setup shared by nbval and tests/.

nbdev-clean strips execution counts but keeps outputs; nbval then fails every cell with a stored
output ("Unrun reference cell has outputs"). Renumbering the cells as they are read fixes it.
"""
import nbval.plugin as _nbval

_read = _nbval.nbformat.read


def _read_numbered(*args, **kwargs):
    nb = _read(*args, **kwargs)
    for i, cell in enumerate(nb.cells, 1):
        if cell.cell_type == "code" and cell.get("outputs") and cell.get("execution_count") is None:
            cell.execution_count = i
    return nb


_nbval.nbformat.read = _read_numbered
