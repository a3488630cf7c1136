"""The arith recipe three ways, side by side in one run, from one shared warm start:

(a) a minimal single-process loop with no Ray: the same model, TorchEngine sampler, agent, estimator and loss
    (PolicyActor), sample -> train -> load weights, strictly in turn: the floor any framework must approach;
(b) molt-nb `sync` on Ray (trainer and orchestrator actors, strictly on-policy);
(c) molt-nb `async` on Ray (the pool samples while the trainer trains, staleness <= loop.max_staleness).

Each arm runs RL for the same wall time and reports rollouts trained per second (evaluation time excluded),
the engine's idle fraction and, on Ray, its causes (starved: groups were running and nothing was draining, yet
the engine had no request; backpressure: the pool held back; sync: paused for the weights, see
`Router.step_metrics`), and held-out accuracy at the start and the end (and the gain per minute). With --reps N
the arms alternate N times and the table shows each figure's median over the repetitions.

    .venv/bin/python bench/async.py [--seconds 90] [--seed 0] [--reps 5] [--arms a,b,c] [--append bench/RESULTS.md]
"""

import argparse, asyncio, copy, dataclasses, datetime, gc, os, platform, statistics, tempfile, time
from pathlib import Path

import torch

from molt_nb.config import load_config, build_policy
from molt_nb.core import collate
from molt_nb.engine import TorchEngine
from molt_nb.actor import PolicyActor
from molt_nb.controller import launch
from molt_nb.loop import evaluate
from molt_nb.recipe import recipe_parts
from molt_nb.train import warm_start, held_out

ROOT = Path(__file__).resolve().parents[1]


def with_(cfg, **sections):
    "cfg with fields of sections replaced: with_(cfg, loop=dict(mode='sync'))"
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


async def single_process(cfg, seconds: float) -> dict:
    "The floor: one process, one loop, no overlap, no Ray"
    torch.set_num_threads(cfg.train.threads)
    model, tok = build_policy(cfg)
    engine = TorchEngine(
        copy.deepcopy(model), seed=cfg.loop.seed, threads=cfg.rollout.threads, max_batch=cfg.rollout.max_batch
    )
    actor = PolicyActor(
        model.train(), cfg.algo, cfg.optim, cfg.train.micro_batch_rows, temperature=cfg.rollout.temperature
    )
    parts = recipe_parts(cfg, tok)  # the same runner, data order and sampling molt-nb uses
    runner, train, held, sp, r = parts.runner, parts.train_tasks, parts.eval_tasks, parts.sampling, cfg.rollout
    start_acc = await evaluate(runner, engine, held, sp)
    pos, rollouts, step, busy0, t0 = 0, 0, 0, engine.stats['busy_s'], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        trajs = await asyncio.gather(
            *[
                runner.run(engine, train[(pos + i) % len(train)], sp, f"g{pos + i}/r{j}", f"g{pos + i}", pos + i)
                for i in range(r.groups_per_step)
                for j in range(r.n_samples)
            ]
        )
        pos, rollouts, step = pos + r.groups_per_step, rollouts + len(trajs), step + 1
        actor.train_step(collate(trajs))
        await engine.load_weights(actor.full_weights(), actor.version)
    wall = time.perf_counter() - t0
    idle = 1 - (engine.stats['busy_s'] - busy0) / wall
    accs = [await evaluate(runner, engine, held, sp)]
    engine.close()
    return dict(
        steps=step,
        rollouts=rollouts,
        seconds=wall,
        samples_per_s=rollouts / wall,
        engine_idle=idle,
        start=start_acc,
        end=accs[-1],
    )


CAUSES = ('starved', 'backpressure', 'sync')


def on_ray(cfg) -> dict:
    "An arm run by molt-nb on Ray; figures from its metrics (evaluation time excluded)"
    run = launch(cfg, name=f"arm-{time.monotonic_ns()}")
    run.wait()
    m = run.metrics()
    run.kill()
    steps = m[m.step > 0]
    evals_during = (
        m.time_eval.iloc[:-1].fillna(0).sum() if 'time_eval' in m else 0.0
    )  # the last row's eval runs after its time was taken
    wall = float(m.time.max()) - float(evals_during)
    step_wall = steps.time_collect + steps.time_train + steps.time_sync
    weighted = lambda col: float((steps[col] * step_wall).sum() / step_wall.sum())  # over the steps, by their wall
    idle = weighted('engine_idle')
    evals = m['eval'].dropna()
    return dict(
        steps=int(steps.step.max()),
        rollouts=int(steps.rollouts.sum()),
        seconds=wall,
        samples_per_s=float(steps.rollouts.sum()) / wall,
        engine_idle=idle,
        **{f"idle_{k}": weighted(f"engine_idle/{k}") for k in CAUSES},
        start=float(evals.iloc[0]),
        end=float(evals.iloc[-1]),
        staleness_max=max(
            int(c.split('/')[1]) for c in m.columns if c.startswith('staleness/') and m[c].fillna(0).sum() > 0
        ),
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--seconds', type=float, default=90)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--reps', type=int, default=5, help='repetitions (the arms alternate); the table shows medians')
    p.add_argument('--arms', default='a,b,c', help='which arms to run, e.g. c for async alone')
    p.add_argument('--append', default=None)
    p.add_argument(
        '--warm', default=None, help='reuse a warm-start checkpoint directory (skips the supervised warm start)'
    )
    args = p.parse_args()
    run_root = Path(tempfile.mkdtemp(prefix='molt-bench-'))
    base = load_config(ROOT / 'recipes' / 'arith', [f'loop.seed={args.seed}', f'run_dir="{run_root / "warm"}"'])
    t = time.perf_counter()
    if args.warm:
        path = Path(args.warm)
        model, tok = build_policy(with_(base, model=dict(path=str(path))))
        warm_acc = held_out(model, base, tok)
    else:
        path, warm_acc = warm_start(base)
    print(f"warm start: {time.perf_counter() - t:.0f} s, held-out accuracy {warm_acc:.3f}", flush=True)
    base = with_(base, model=dict(path=str(path)), loop=dict(seconds=args.seconds, steps=10**6, eval_every=0))
    arms = {
        '(a) single process, no Ray': lambda: asyncio.run(
            single_process(with_(base, train=dict(threads=2), rollout=dict(threads=1)), args.seconds)
        ),
        '(b) molt-nb sync': lambda: on_ray(
            dataclasses.replace(
                with_(base, loop=dict(mode='sync'), train=dict(threads=2), rollout=dict(threads=1)),
                run_dir=str(run_root / 'sync'),
            )
        ),
        '(c) molt-nb async': lambda: on_ray(
            dataclasses.replace(
                with_(base, loop=dict(mode='async'), train=dict(threads=1), rollout=dict(threads=1)),
                run_dir=str(run_root / 'async'),
            )
        ),
    }
    arms = {k: v for k, v in arms.items() if k[1] in args.arms.split(',')}
    runs = {name: [] for name in arms}
    for rep in range(args.reps):
        for name, fn in arms.items():
            gc.collect()
            runs[name].append(r := fn())
            r['gain_per_min'] = (r['end'] - r['start']) / (r['seconds'] / 60)
            causes = ', '.join(f"{k} {r[f'idle_{k}']:.1%}" for k in CAUSES if f"idle_{k}" in r)
            print(
                f"{name} (rep {rep}): {r['samples_per_s']:.0f} rollouts/s, engine idle {r['engine_idle']:.0%}"
                f"{f' ({causes})' if causes else ''}, accuracy {r['start']:.3f} -> {r['end']:.3f} in "
                f"{r['seconds']:.0f} s ({r['steps']} steps)",
                flush=True,
            )
    # each figure's median over the repetitions
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    rate = lambda arm: results[arm]['samples_per_s'] if arm in results else float('nan')
    floor, sync, asy = (rate(k) for k in ('(a) single process, no Ray', '(b) molt-nb sync', '(c) molt-nb async'))
    lines = [
        f"## async: the arith recipe as a single process, molt-nb sync and molt-nb async ({datetime.date.today()})",
        "",
        f"Command: `.venv/bin/python bench/async.py --seconds {args.seconds:g} --seed {args.seed} --reps {args.reps} "
        f"--arms {args.arms}`. Figures are medians over {args.reps} repetition(s), arms alternating. Machine: "
        f"{os.cpu_count()} CPU cores "
        f"({platform.machine()}), no GPU, torch {torch.__version__}. One shared warm start (450 demos, 600 steps; "
        "held-out accuracy "
        f"{warm_acc:.3f}), then each arm runs GRPO (16 prompts x 8 samples per step, lr 1e-4) for {args.seconds:g} s "
        "of wall time. "
        "Rollouts/s counts trained rollouts over the RL wall time without evaluations; engine idle is the fraction of "
        "that time the "
        "engine thread was not computing, split on Ray by cause: starved (groups were running, nothing was draining, "
        "yet the engine had no request), "
        "backpressure (the pool held back: every place in flight held a finished group, or sync mode waited for the "
        "trainer), sync (paused for the weights). Threads: (a) and (b) trainer 2, engine 1 (they take turns); (c) "
        "trainer 1, engine 1.",
        "",
        "| arm | steps | rollouts/s | engine idle | starved | backpressure | sync | held-out accuracy start -> end "
        "| gain per minute |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        causes = ' | '.join(f"{r[f'idle_{k}']:.0%}" if f"idle_{k}" in r else '-' for k in CAUSES)
        lines.append(
            f"| {name} | {r['steps']:.0f} | {r['samples_per_s']:.0f} | {r['engine_idle']:.0%} | {causes} | "
            f"{r['start']:.3f} -> {r['end']:.3f} | {r['gain_per_min']:+.3f} |"
        )
    asy_r = results.get('(c) molt-nb async')
    lines += [
        "",
        (
            f"Ratios: async / sync = **{asy / sync:.2f}x** (goal >= 1.3x); async / single process = "
            f"**{asy / floor:.2f}x** (goal >= 0.8x)."
            if len(results) == 3
            else ''
        )
        + (
            f" Async engine idle **{asy_r['engine_idle']:.0%}**; starved engine idle **{asy_r['idle_starved']:.1%}** "
            f"of the RL time (goal: under 10%, median of {args.reps}); async max staleness "
            f"{asy_r['staleness_max']:.0f}."
            if asy_r
            else ''
        ),
        "",
    ]
    print("\n".join(lines))
    if args.append:
        with open(args.append, 'a') as f:
            f.write("\n" + "\n".join(lines))


if __name__ == '__main__':
    main()
