"""What a live dashboard costs a run: the same run with and without a `Dashboard` attached, side by side.

Each trial launches the same recipe through the controller (a detached orchestrator actor on a private local Ray)
and measures rollouts trained per second over the steps after the second (the first includes start-up). The
dashboard arm attaches `Dashboard(run, refresh_s=...)`, which polls the run's metrics and the newest step's
samples from its own thread and redraws its plots, as in a notebook. Arms alternate (off, on, off, on, ...) so
drift on a shared machine hits both; the result is the ratio of the medians.

    .venv/bin/python bench/controller.py [--steps 60] [--trials 3] [--refresh 1.0] [--append bench/RESULTS.md]
"""
import argparse, datetime, os, platform, statistics, tempfile, time
from pathlib import Path
from molt_nb.config import load_config
from molt_nb.controller import connect, launch
from molt_nb.widgets import Dashboard

ROOT = Path(__file__).resolve().parents[1]

def trial(recipe:str, steps:int, dashboard:bool, refresh:float, n:int) -> dict:
    cfg = load_config(recipe, [f'loop.steps={steps}', 'loop.eval_tasks=8', f'run_dir="{tempfile.mkdtemp()}"'])
    run = launch(cfg, name=f"bench-{n}")
    dash = Dashboard(run, refresh_s=refresh) if dashboard else None
    run.wait(timeout=1800)
    m = run.metrics()
    redraws = len(dash.metrics) if dash else 0
    if dash: dash.close()
    run.kill()
    m = m[m.step > 1]
    return dict(samples_per_s=float(m.rollouts.iloc[1:].sum() / (m.time.iloc[-1] - m.time.iloc[0])),
                step_samples_per_s=float(m.samples_per_s.median()), steps=int(m.step.max()), rows_seen=redraws)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--recipe', default=str(ROOT/'recipes'/'parity'))
    ap.add_argument('--steps', type=int, default=60)
    ap.add_argument('--trials', type=int, default=3)
    ap.add_argument('--refresh', type=float, default=1.0)
    ap.add_argument('--append')
    a = ap.parse_args()
    connect(temp_dir=tempfile.mkdtemp(prefix='molt-bench-'))
    out = {False: [], True: []}
    for i in range(a.trials):
        for dash in (False, True):
            r = trial(a.recipe, a.steps, dash, a.refresh, 2 * i + dash)
            out[dash].append(r)
            print(f"trial {i} dashboard={'on ' if dash else 'off'}: {r['samples_per_s']:.1f} rollouts/s (median step {r['step_samples_per_s']:.1f}), dashboard saw {r['rows_seen']} rows", flush=True)
    off, on = (statistics.median(r['samples_per_s'] for r in out[k]) for k in (False, True))
    ratio = on / off
    verdict = 'met' if ratio > 0.97 else 'NOT met'
    print(f"median rollouts/s: off {off:.1f}, on {on:.1f}; on/off {ratio:.3f} (goal: dashboard costs < 3%: {verdict})")
    if a.append:
        rows = '\n'.join(f"| {i} | {out[False][i]['samples_per_s']:.1f} | {out[True][i]['samples_per_s']:.1f} | {out[True][i]['rows_seen']} |" for i in range(a.trials))
        text = f"""

## Controller: what a live dashboard costs ({datetime.date.today()})

`.venv/bin/python bench/controller.py --steps {a.steps} --trials {a.trials} --refresh {a.refresh}` on {platform.node() or 'this machine'} ({os.cpu_count()} cores, shared; no GPU):
recipes/parity launched through `molt_nb.controller.launch` on a private local Ray, {a.steps} steps per trial, arms alternating;
the dashboard arm polls metrics and the newest step's samples every {a.refresh} s and redraws its plots in a thread of the driver.
Rollouts trained per second over steps 3..{a.steps} (from the metrics' clock):

| trial | no dashboard | dashboard | metrics rows the dashboard drew |
|---|---|---|---|
{rows}

Median: {off:.1f} without, {on:.1f} with; with/without = {ratio:.3f}. Goal (the dashboard costs under 3% of samples/s): {verdict}.
"""
        with open(a.append, 'a') as f: f.write(text)

if __name__ == '__main__': main()
