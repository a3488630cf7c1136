"""What a live dashboard costs a run: one run, its dashboard polling and not polling in alternating windows.

The recipe is launched once through the controller (a detached orchestrator actor on a private local Ray, as a
notebook does), so start-up and run-to-run variance do not enter the comparison. A `Dashboard` is opened on it
in this process (standing in for the notebook kernel, on the same cores as the run). After a warm-up, windows of
`--window` seconds alternate: off, on, off, on, ..., off. In an "on" window this process does what the dashboard's
own poll thread does every `--refresh` seconds (`Dashboard.poll_once`: fetch the new metrics rows, redraw the curves,
fetch and draw the newest step's samples); in an "off" window it does nothing. Each window's rate is the
rollouts trained per second between its first and last step, from the run's own metrics clock. Each "on" window
is compared with the mean of the two "off" windows around it, so drift cancels; the result is the median of
those ratios. Short windows, many pairs: the run's own rate wanders by +-10% over tens of seconds. Not measured:
sending the widgets' new values to a browser (here no front end is attached, so ipywidgets drops them) and the
browser's own drawing; in a notebook both add to the dashboard's cost on the machine that runs the kernel.

    .venv/bin/python bench/controller.py [--window 3] [--pairs 40] [--refresh 1.0] [--smooth 0.6] [--compare]
        [--append bench/RESULTS.md]
"""

import argparse, datetime, os, platform, random, resource, statistics, tempfile, time
from pathlib import Path
from molt_nb.config import load_config
from molt_nb.controller import connect, launch
from molt_nb.widgets import Dashboard

ROOT = Path(__file__).resolve().parents[1]


def rate(m, first: int, last: int) -> float:
    "Rollouts trained per second over steps first+1..last (the metrics' clock)"
    w = m[(m.step > first) & (m.step <= last)]
    t = m.set_index('step').time
    return float(w.rollouts.sum() / (t[last] - t[first]))


def cpu() -> float:
    "CPU seconds this process (the kernel's stand-in: the dashboard's polls, Ray client calls) has used"
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--recipe', default=str(ROOT / 'recipes' / 'parity'))
    ap.add_argument('--window', type=float, default=3.0)
    ap.add_argument('--pairs', type=int, default=40)
    ap.add_argument('--refresh', type=float, default=1.0)
    ap.add_argument('--smooth', type=float, default=0.0, help="the curves' smoothing (the dashboard's slider)")
    ap.add_argument('--compare', action='store_true', help="overlay a second run's curves (the run's own store)")
    ap.add_argument('--append')
    a = ap.parse_args()
    connect(temp_dir=tempfile.mkdtemp(prefix='molt-bench-'))
    cfg = load_config(
        a.recipe,
        [
            'loop.steps=1000000',
            'loop.eval_tasks=8',
            'algo.loss.is_correction.level="token"',
            f'run_dir="{tempfile.mkdtemp()}"',
        ],
    )
    run = launch(cfg, name='bench-dashboard')
    try:
        while run.status()['step'] < 20:
            time.sleep(0.5)  # warm-up: start-up and the first steps are not measured
        dash = Dashboard(
            run, refresh_s=a.refresh, live=False, smooth=a.smooth, compare={'store': cfg.run_dir} if a.compare else None
        )
        windows = []
        for w in range(2 * a.pairs + 1):
            on = bool(w % 2)
            start, cpu0, t0, rows0 = run.status()['step'], cpu(), time.perf_counter(), len(dash.metrics)
            while (
                t0 + a.window - time.perf_counter() > 0
            ):  # polls at fixed offsets inside the window, none spilling out
                if on:
                    dash.poll_once()
                time.sleep(max(0.0, min(a.refresh, t0 + a.window - time.perf_counter())))
            end, used = run.status()['step'], (cpu() - cpu0) / (time.perf_counter() - t0)
            windows.append(
                dict(on=on, first=start, last=end, cpu=used, redraws=len(dash.metrics) - rows0, errors=len(dash.errors))
            )
        m = run.metrics()
    finally:
        run.kill()
    for w in windows:
        w['rate'] = rate(m, w['first'], w['last'])
        part = m[(m.step > w['first']) & (m.step <= w['last'])]
        w['phases'] = {k: float(part[k].mean() * 1000) for k in ('time_collect', 'time_train', 'time_sync')}
    phases = {
        on_: {k: statistics.median(w['phases'][k] for w in windows if w['on'] is on_) for k in windows[0]['phases']}
        for on_ in (True, False)
    }
    print(
        'ms per step (median over windows), off -> on: '
        + ', '.join(f"{k.removeprefix('time_')} {phases[False][k]:.2f} -> {phases[True][k]:.2f}" for k in phases[True])
    )
    pairs = [
        (windows[i]['rate'], (windows[i - 1]['rate'] + windows[i + 1]['rate']) / 2)
        for i in range(1, len(windows), 2)
        if all(windows[j]['last'] > windows[j]['first'] for j in (i - 1, i, i + 1))
    ]  # a window with no step has no rate
    ratios = [on / off for on, off in pairs]
    ratio = statistics.median(ratios)
    boot = sorted(statistics.median(random.Random(i).choices(ratios, k=len(ratios))) for i in range(2000))
    lo, hi = boot[100], boot[1899]  # a 90% bootstrap interval of the median
    verdict = (
        'NOT met (the dashboard raised errors: see above)' if dash.errors else 'met' if ratio > 0.97 else 'NOT met'
    )
    for w in windows:
        print(
            f"dashboard {'on ' if w['on'] else 'off'} steps {w['first']}..{w['last']}: {w['rate']:.1f} rollouts/s, "
            f"this process {1000 * w['cpu']:.0f} ms CPU per s"
            + (f" (dashboard took in {w['redraws']} metrics rows; errors so far {w['errors']})" if w['on'] else '')
        )
    cpu_on, cpu_off = (statistics.median(w['cpu'] for w in windows if w['on'] is k) for k in (True, False))
    print(
        f"dashboard CPU: {1000 * (cpu_on - cpu_off):.0f} ms per second (median on window {1000 * cpu_on:.0f}, off "
        f"{1000 * cpu_off:.0f}), {100 * (cpu_on - cpu_off) / os.cpu_count():.1f}% of this machine's {os.cpu_count()} "
        "cores"
    )
    print(
        f"on/off per pair: {' '.join(f'{r:.3f}' for r in ratios)}; median {ratio:.3f}, 90% interval {lo:.3f}..{hi:.3f} "
        f"(goal: the dashboard costs < 3% of samples/s: {verdict})"
    )
    if a.append:
        where = platform.node() or 'this machine'
        moves = ', '.join(
            f"{k.removeprefix('time_')} {phases[False][k]:.2f} -> {phases[True][k]:.2f}" for k in phases[True]
        )
        share = 100 * (cpu_on - cpu_off) / os.cpu_count()
        command = (
            f"{' '.join(['.venv/bin/python', 'bench/controller.py', f'--window {a.window:g}', f'--pairs {a.pairs}'])} "
            f"--refresh {a.refresh:g} --smooth {a.smooth:g}{' --compare' if a.compare else ''}"
        )
        overlay = "; a second run overlaid: the run's own store, read from disk" if a.compare else ''
        text = f"""

## Controller: what a live dashboard costs ({datetime.date.today()})

`{command}` on {where} ({os.cpu_count()} cores, no GPU): recipes/{Path(a.recipe).name} launched once through
`molt_nb.controller.launch` on a private local Ray; after 20 warm-up steps, {a.window:g} s windows alternate dashboard
off / on / off ...; in an "on" window the benchmark process (the notebook kernel's stand-in, on the same 2 cores as the
run) does the dashboard's poll every {a.refresh:g} s: new metrics rows fetched, curves redrawn (smoothing
{a.smooth:g}{overlay}), the newest step's samples fetched and drawn. Rollouts trained per second, from the run's
metrics clock; each "on" window against the mean of the "off" windows on either side. The {a.pairs} pairs' on/off
ratios, sorted: {' '.join(f'{r:.2f}' for r in sorted(ratios))}.

Where a step's time goes (ms, median over windows), off -> on: {moves}.
Median on/off = {ratio:.3f} (90% bootstrap interval {lo:.3f}..{hi:.3f}).
Goal (the dashboard costs under 3% of samples/s): {verdict}.
The benchmark process used {1000 * cpu_on:.0f} ms of CPU per second with the dashboard and {1000 * cpu_off:.0f} ms
without (medians over windows): the dashboard itself costs {1000 * (cpu_on - cpu_off):.0f} ms per second,
{share:.1f}% of the machine's {os.cpu_count()} cores.
"""
        with open(a.append, 'a') as f:
            f.write(text)


if __name__ == '__main__':
    main()
