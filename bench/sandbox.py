"""The tool sandbox's per-call overhead: the sandbox before issue 16 (audit hook + `unshare --net`) vs bubblewrap.

Both run the same three programs (a print, a 20k-character print cut at 2000, a 100 ms sleep) one call at a
time, and eight calls at once; arms alternate per repetition and medians are reported with the ratio. The old
sandbox is the module as it was at commit b93c640 (read from git), loaded under another name.

    .venv/bin/python bench/sandbox.py [--reps 7] [--append bench/RESULTS.md]
"""

import argparse, asyncio, datetime, importlib.util, os, platform, statistics, subprocess, tempfile, time

from molt_nb.tools import run_python

OLD_COMMIT = 'b93c640'
PROGRAMS = dict(print='print(37 * 12)', cut='print("x" * 20000)', sleep='import time; time.sleep(0.1)')


def old_run_python():
    "run_python as it was before this issue's sandbox"
    src = subprocess.run(
        ['git', 'show', f'{OLD_COMMIT}:molt_nb/tools.py'],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ).stdout
    path = os.path.join(tempfile.mkdtemp(prefix='old-tools-'), 'old_tools.py')
    open(path, 'w').write(src)
    spec = importlib.util.spec_from_file_location('old_tools', path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.run_python


async def timed(fn, code: str, concurrent: int) -> float:
    "Seconds per call: one call, or `concurrent` at once (wall time / calls)"
    start = time.perf_counter()
    outs = await asyncio.gather(*[fn(code) for _ in range(concurrent)])
    assert all(not o.startswith(('Traceback', 'TimeoutError', 'error')) for o in outs), outs[0][:300]
    return (time.perf_counter() - start) / concurrent


async def main(reps: int) -> list:
    arms = dict(old=old_run_python(), bwrap=run_python)
    for fn in arms.values():
        await fn('pass')  # warm: the bwrap probe, page cache
    rows = []
    for name, code in PROGRAMS.items():
        for concurrent in (1, 8):
            got = {a: [] for a in arms}
            for _ in range(reps):
                for a, fn in arms.items():
                    got[a].append(await timed(fn, code, concurrent))
            old, new = statistics.median(got['old']), statistics.median(got['bwrap'])
            rows.append((name, concurrent, old * 1e3, new * 1e3, new / old))
    return rows


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--reps', type=int, default=7)
    ap.add_argument('--append', help='append the table to this markdown file')
    args = ap.parse_args()
    rows = asyncio.run(main(args.reps))
    lines = [
        f"## sandbox: per-call overhead, before issue 16 vs bubblewrap ({datetime.date.today()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, euid {os.geteuid()})",
        '',
        f"`.venv/bin/python bench/sandbox.py --reps {args.reps}`: medians of {args.reps} alternated repetitions, ms "
        "per call.",
        '',
        '| program | calls at once | old (audit hook + unshare --net) | bubblewrap | ratio |',
        '|---|---|---|---|---|',
    ]
    lines += [f"| {n} | {c} | {o:.0f} | {b:.0f} | {r:.2f} |" for n, c, o, b, r in rows]
    text = '\n'.join(lines) + '\n'
    print(text)
    if args.append:
        with open(args.append, 'a') as f:
            f.write('\n' + text)
