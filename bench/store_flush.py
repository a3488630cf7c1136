"""What a run store's flush costs as the run grows: `RunStore.flush` after `loop.flush_every` new metrics rows, at 1k
and 20k rows logged, rows of 55 float columns (a 1-engine run's row: engines add 5 columns each), and what reading
the metrics back costs (`RunStore.metrics`, what the dashboard polls). Median of --reps flushes, no samples.

    .venv/bin/python bench/store_flush.py [--rows 1000,20000] [--reps 5] [--flush-every 50]
"""

import argparse, platform, statistics, tempfile, time

from molt_nb.store import RunStore

COLUMNS = 55


def row(step: int) -> dict:
    "A metrics row: `step` and 54 float metrics named like the loop's"
    out = dict(step=step)
    out |= {f"section{i % 6}/metric{i}": step / (i + 1) for i in range(COLUMNS - 1)}
    return out


def bench(rows: int, reps: int, flush_every: int) -> dict:
    "Median seconds of a flush after `flush_every` new rows, and of a read, with about `rows` rows logged"
    store = RunStore(tempfile.mkdtemp())
    for step in range(rows - reps * flush_every):
        store.log(row(step))
    store.flush()
    flushes, reads = [], []
    for rep in range(reps):
        for _ in range(flush_every):
            store.log(row(len(store.rows)))
        start = time.perf_counter()
        store.flush()
        flushes.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert len(store.metrics()) == len(store.rows)
        reads.append(time.perf_counter() - start)
    return dict(flush_ms=1e3 * statistics.median(flushes), read_ms=1e3 * statistics.median(reads))


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--rows', default='1000,20000')
    p.add_argument('--reps', type=int, default=5)
    p.add_argument('--flush-every', type=int, default=50)
    a = p.parse_args()
    print(f"{platform.processor() or platform.machine()}, {COLUMNS} columns, a flush every {a.flush_every} rows")
    for n in map(int, a.rows.split(',')):
        r = bench(n, a.reps, a.flush_every)
        print(f"{n:>6} rows: flush {r['flush_ms']:7.1f} ms  read {r['read_ms']:7.1f} ms")


if __name__ == '__main__':
    main()
