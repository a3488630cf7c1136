"""The main job in the cluster's shape on this machine: `molt-nb train recipes/arith` with 2 engine actors and a
2-rank FSDP2 trainer group (weights broadcast over gloo) beside the default 1 engine and 1 trainer, in one run.

Both arms run with `loop.debug=true` (every trained token checked against the engine's record) and without the
supervised control. On 2 cores the 2 x 2 arm runs 6+ processes on 2 cores: its throughput says what the extra
processes cost here, not what they buy on a cluster (where each has its own GPU).

    .venv/bin/python bench/cluster.py [--seed 0] [--append bench/RESULTS.md]
"""

import argparse, datetime, os, platform, subprocess, sys, tempfile, time
from pathlib import Path
import pandas as pd
import torch
from molt_nb.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    '1 engine, 1 trainer': [],
    '2 engines, 2 trainer ranks': ['cluster.engines=2', 'cluster.trainer_ranks=2'],
}


def arm(name: str, overrides: list, seed: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix='molt-cluster-'))
    start = time.perf_counter()
    cmd = [str(Path(sys.executable).parent / 'molt-nb'), 'train', str(ROOT / 'recipes' / 'arith'), '--no-control']
    subprocess.run([*cmd, f'loop.seed={seed}', 'loop.debug=true', f'run_dir="{run_dir}"', *overrides], check=True)
    wall = time.perf_counter() - start
    s = pd.read_csv(run_dir / 'summary.csv').set_index('stage')
    m = RunStore(run_dir).metrics()
    steps = m[m.step > 0]
    return dict(
        arm=name,
        warm=s.accuracy.iloc[0],
        rl=s.loc['after RL', 'accuracy'],
        rl_gain=s.loc['after RL', 'gain'],
        steps=int(steps.step.max()),
        rollouts_per_s=float(steps.rollouts.sum() / m.time.max()),
        identity_every_step=bool((steps.identity_checked > 0).all()),
        versions_exact=bool((steps.version == steps.step).all()),
        time_sync_ms=float(steps.time_sync.median() * 1000),
        wall=wall,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--append', default=None)
    args = p.parse_args()
    rows = []
    for name, overrides in ARMS.items():
        rows.append(arm(name, overrides, args.seed))
        print(rows[-1], flush=True)
    lines = [
        f"## cluster: the main job with engine actors and a trainer group ({datetime.date.today()})",
        "",
        f"Command: `.venv/bin/python bench/cluster.py --seed {args.seed}` (each arm is `molt-nb train recipes/arith "
        "--no-control loop.debug=true` plus its overrides). Machine: "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU, torch {torch.__version__}. RL: GRPO, 16 prompts "
        "x 8 samples per step, async, 160 s; accuracy: greedy exact match on the 500 held-out sums, mean of the last 3 "
        "evaluations.",
        "",
        "| arm | warm start | after RL | RL gain | RL steps | rollouts/s | sync (median) | identity every step | "
        "versions exact | wall |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
        *[
            f"| {r['arm']} | {r['warm']:.3f} | {r['rl']:.3f} | **{r['rl_gain']:+.3f}** | {r['steps']} | "
            f"{r['rollouts_per_s']:.0f} | {r['time_sync_ms']:.0f} ms | {r['identity_every_step']} | "
            f"{r['versions_exact']} | {r['wall']:.0f} s |"
            for r in rows
        ],
        "",
    ]
    print('\n'.join(lines))
    if args.append:
        with open(args.append, 'a') as f:
            f.write('\n'.join(lines) + '\n')
    if not all(r['identity_every_step'] and r['versions_exact'] for r in rows):
        sys.exit('token identity or exact versions failed in an arm')


if __name__ == '__main__':
    main()
