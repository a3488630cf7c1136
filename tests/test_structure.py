"""The package's shape, read from the generated modules' syntax trees (nothing is imported): no module imports a
private name from another, no import cycle (function-level imports included), and the controller runs nothing on
the cluster."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / 'molt_nb'


def modules(root: Path = PKG) -> dict:
    "module name -> its syntax tree, for every generated module of the package"
    return {
        p.stem: ast.parse(p.read_text()) for p in sorted(root.glob('*.py')) if p.stem not in ('__init__', '_modidx')
    }


def imports(tree: ast.Module, known: set) -> list:
    "(line, module, names) of each import of a package module, at any depth (function-level imports too)"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or '').split('.')
            if node.level == 1 and parts[0] in known:
                out.append((node.lineno, parts[0], [a.name for a in node.names]))
            elif node.level == 0 and parts[0] == 'molt_nb' and len(parts) > 1 and parts[1] in known:
                out.append((node.lineno, parts[1], [a.name for a in node.names]))
            elif (node.level == 1 and not node.module) or (node.level == 0 and node.module == 'molt_nb'):
                out += [(node.lineno, a.name, []) for a in node.names if a.name in known]  # from . import x
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split('.')
                if parts[0] == 'molt_nb' and len(parts) > 1 and parts[1] in known:
                    out.append((node.lineno, parts[1], []))
    return out


def private_imports(mods: dict) -> list:
    "'module:line imports _name from other' for each private name imported across modules"
    return [
        f"molt_nb/{m}.py:{line} imports {n} from molt_nb.{other}"
        for m, tree in mods.items()
        for line, other, names in imports(tree, set(mods))
        for n in names
        if n.startswith('_') and other != m
    ]


def cycles(mods: dict) -> list:
    "Every import cycle between modules, as 'a -> b -> a' (each cycle once, from its smallest module)"
    graph = {m: sorted({other for _, other, _ in imports(t, set(mods)) if other != m}) for m, t in mods.items()}
    found = set()

    def walk(start, node, path):
        for nxt in graph[node]:
            if nxt == start:
                found.add(' -> '.join(path + [start]))
            elif nxt not in path and nxt > start:
                walk(start, nxt, path + [nxt])

    for m in graph:
        walk(m, m, [m])
    return sorted(found)


def test_no_module_imports_a_private_name_from_another():
    bad = private_imports(modules())
    assert not bad, "make these names public (no leading underscore) where they are defined:\n" + '\n'.join(bad)


def test_no_import_cycle():
    found = cycles(modules())
    assert not found, (
        "import cycles (function-level imports count): move what both sides use into a module both import\n"
        + '\n'.join(found)
    )


def test_controller_defines_no_class_that_runs_on_the_cluster():
    "The kernel's module holds the client handle only: what runs on the cluster lives in steering and the loop"
    tree = modules()['controller']
    classes = sorted(n.name for n in tree.body if isinstance(n, ast.ClassDef))
    assert classes == ['Run'], f"controller defines {classes}: only the `Run` handle belongs there"
    launches = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == 'launch']
    assert launches == ['launch'], launches


def test_one_launch_and_one_run_in_the_package():
    "One launch path and one Run handle: the CLI, the notebooks and the tests all use controller.launch"
    mods = modules()
    where = lambda kind, name: sorted(
        m for m, t in mods.items() for n in t.body if isinstance(n, kind) and n.name == name
    )
    assert where(ast.FunctionDef, 'launch') == ['controller']
    assert where(ast.ClassDef, 'Run') == ['controller']


def long_lines(path: Path) -> list:
    "'file:line' of each line over 120 characters, but the `__all__` nbdev writes (it wraps at 120 after its prefix)"
    lines, out, in_all = path.read_text().splitlines(), [], False
    for i, line in enumerate(lines, 1):
        in_all = line.startswith('__all__ = [') or (in_all and not lines[i - 2].endswith(']'))
        if len(line) > 120 and not in_all:
            out.append(f"molt_nb/{path.name}:{i}")
    return out


def test_no_line_over_120_characters():
    long = [x for p in sorted(PKG.glob('*.py')) if p.stem != '_modidx' for x in long_lines(p)]
    assert not long, 'lines over 120 characters (split them in the notebook):\n' + '\n'.join(long[:20])


def test_the_checks_catch_what_they_look_for(tmp_path):
    "Each check fails on a package made to break it"
    (tmp_path / 'a.py').write_text("from .b import _hidden\n")
    (tmp_path / 'b.py').write_text("def f():\n    from molt_nb.c import g\n")
    (tmp_path / 'c.py').write_text("from molt_nb import b\n")
    mods = modules(tmp_path)
    assert private_imports(mods) == ['molt_nb/a.py:1 imports _hidden from molt_nb.b']
    assert cycles(mods) == ['b -> c -> b']
    (tmp_path / 'd.py').write_text("__all__ = ['" + 'x' * 130 + "',\n           'y']\nz = '" + 'z' * 130 + "'\n")
    assert long_lines(tmp_path / 'd.py') == ['molt_nb/d.py:3']
