"""Density of the generated modules: lines, code tokens per line, long lines, the longest functions.

    python bench/readability.py                  # the working tree's molt_nb/
    python bench/readability.py --ref aad0589    # molt_nb/ as a commit had it, side by side with the working tree

Lines are non-blank, non-comment lines; code tokens are names, operators, numbers and strings (what a reader
parses), so a docstring counts once however long it is. The issue that asked for it (17) compared with Molt's 5.1
tokens per line and nbdev's median export cell of about 10 lines.
"""

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

import pandas as pd

CODE = {tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING}


def sources(ref: str | None) -> dict:
    "module name -> its source, from the working tree or from commit `ref`"
    if ref is None:
        files = sorted(Path('molt_nb').glob('*.py'))
        return {f.stem: f.read_text() for f in files if f.stem not in ('_modidx', '__init__')}
    names = subprocess.run(
        ['git', 'ls-tree', '--name-only', ref, 'molt_nb/'], capture_output=True, text=True, check=True
    )
    out = {}
    for path in names.stdout.split():
        stem = Path(path).stem
        if path.endswith('.py') and stem not in ('_modidx', '__init__'):
            out[stem] = subprocess.run(['git', 'show', f"{ref}:{path}"], capture_output=True, text=True).stdout
    return out


def density(src: str) -> dict:
    "Lines, code tokens, tokens per line, lines over 120 characters"
    lines = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type in CODE}
    tokens = sum(t.type in CODE for t in tokenize.generate_tokens(io.StringIO(src).readline))
    long = sum(len(line) > 120 for line in src.splitlines())
    return dict(lines=len(lines), tokens=tokens, per_line=round(tokens / max(len(lines), 1), 1), over_120=long)


def functions(srcs: dict) -> pd.DataFrame:
    "Every function and method: its qualified name, lines and code tokens (tokens compare dense and formatted code)"
    rows = []
    for mod, src in srcs.items():
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ''
                    text = '\n'.join(src.splitlines()[child.lineno - 1 : child.end_lineno])
                    tokens = sum(t.type in CODE for t in tokenize.generate_tokens(io.StringIO(text).readline))
                    name = f"{mod}.{owner}{child.name}"
                    rows.append(dict(function=name, lines=child.end_lineno - child.lineno + 1, tokens=tokens))
    return pd.DataFrame(rows).sort_values('lines', ascending=False, kind='stable')


def report(srcs: dict) -> pd.DataFrame:
    df = pd.DataFrame({m: density(s) for m, s in srcs.items()}).T
    df.loc['total'] = df.sum()
    df.loc['total', 'per_line'] = round(df.loc['total', 'tokens'] / df.loc['total', 'lines'], 1)
    return df.astype({'lines': int, 'tokens': int, 'over_120': int})


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--ref', help='a commit to compare the working tree with')
    args = ap.parse_args()
    now = sources(None)
    if args.ref is None:
        print(report(now).to_string())
        print(functions(now).head(10).to_string(index=False))
    else:
        before = sources(args.ref)
        both = report(before).join(report(now), how='outer', suffixes=(' before', ' after'))
        print(both.to_string())
        tops = [functions(s).head(10).reset_index(drop=True) for s in (before, now)]
        print(pd.concat(tops, axis=1, keys=[f"longest at {args.ref}", 'longest now']).to_string())
