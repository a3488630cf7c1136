"""The main job's claim, per seed: RL on unlabelled prompts adds what more supervision on the same labels does not.

For each seed, `molt-nb train recipes/<recipe> loop.seed=S` in full: a warm start on the recipe's labelled demos, RL on
Ray for the recipe's loop.seconds, and a control that continues supervised training on the same demos for as long as
RL ran.
The acceptance bars (held-out accuracy, mean of the last 3 evaluations, on every seed):
- arith: RL gains >= 40 points while the control gains <= 10;
- shapes (images): RL ends >= 3 points above the control.
Run it alone on the machine: RL's progress per second depends on the CPU it gets.

    .venv/bin/python bench/learn.py [--recipe arith|shapes] [--seeds 0 1 2] [--append bench/RESULTS.md]
"""

import argparse, datetime, os, platform, subprocess, sys, tempfile, time
from pathlib import Path
import pandas as pd
import torch
from molt_nb.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = dict(  # what each recipe's run is, its bar as words and as a test of one seed's row
    arith=(
        "Warm start: 450 labelled sums, 600 supervised steps. RL: GRPO, 16 prompts x 8 samples per step, lr 1e-4, "
        "async with max_staleness 2 on a local Ray, {seconds}. Control: supervised training on the same 450 demos"
        " from the same warm start for as long as RL ran. Accuracy: greedy exact match on the 500 held-out sums, mean"
        " of the last 3 evaluations. Bar: RL gain >= +0.40 and control gain <= +0.10 on every seed.",
        lambda r: r['rl_gain'] >= 0.40 and r['control_gain'] <= 0.10,
    ),
    shapes=(
        "A tiny Qwen3-VL (text 128 wide, 2 layers; vision tower 32 wide, 2 blocks; 64x64 images as 16 tokens). Warm "
        "start: 600 labelled images, 600 supervised steps. RL: GRPO, 16 images x 8 samples per step, lr 1e-4, async "
        "with max_staleness 2 on a local Ray, {seconds}. Control: supervised training on the same 600 demos from "
        "the same warm start for as long as RL ran. Accuracy: greedy exact match on the 300 held-out images, mean of "
        "the last 3 evaluations. Bar: RL ends >= +0.03 above the control on every seed.",
        lambda r: r['rl'] - r['control'] >= 0.03,
    ),
)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--recipe', default='arith', choices=sorted(RECIPES))
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--append', default=None)
    args = p.parse_args()
    # read once, and given to every run: the header states what the runs did even if the recipe is edited meanwhile
    seconds = load_config(ROOT / 'recipes' / args.recipe).loop.seconds
    rows = []
    for seed in args.seeds:
        run_dir = Path(tempfile.mkdtemp(prefix=f'molt-learn-{seed}-'))
        start = time.perf_counter()
        subprocess.run(
            [
                str(Path(sys.executable).parent / 'molt-nb'),
                'train',
                str(ROOT / 'recipes' / args.recipe),
                f'loop.seed={seed}',
                *([f'loop.seconds={seconds!r}'] if seconds is not None else []),
                f'run_dir="{run_dir}"',
            ],
            check=True,
        )
        wall = time.perf_counter() - start
        s = pd.read_csv(run_dir / 'summary.csv').set_index('stage')
        m = pd.read_parquet(run_dir / 'metrics.parquet')
        steps = m[m.step > 0]
        rows.append(
            dict(
                seed=seed,
                warm=s.accuracy.iloc[0],
                rl=s.loc['after RL', 'accuracy'],
                control=s.loc['control: more supervision', 'accuracy'],
                rl_gain=s.loc['after RL', 'gain'],
                control_gain=s.loc['control: more supervision', 'gain'],
                steps=int(steps.step.max()),
                rollouts_per_s=float(steps.rollouts.sum() / m.time.max()),
                wall=wall,
            )
        )
        print(rows[-1], flush=True)
    what, bar = RECIPES[args.recipe]
    what = what.format(seconds=f'{seconds:g} s' if seconds is not None else 'no time limit')
    ok = all(map(bar, rows))
    lines = [
        f"## learn: {args.recipe}, the main job per seed, RL against a supervised control ({datetime.date.today()})",
        "",
        f"Command: `.venv/bin/python bench/learn.py --recipe {args.recipe} --seeds {' '.join(map(str, args.seeds))}` "
        f"(each seed is `molt-nb train recipes/{args.recipe} loop.seed=S`, run alone). Machine: {os.cpu_count()} CPU "
        f"cores ({platform.machine()}), no GPU, torch {torch.__version__}. {what}",
        "",
        "| seed | warm start | after RL | control | RL gain | control gain | RL - control | RL steps | rollouts/s | "
        "wall (whole command) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['warm']:.3f} | {r['rl']:.3f} | {r['control']:.3f} | **{r['rl_gain']:+.3f}** | "
            f"{r['control_gain']:+.3f} | **{r['rl'] - r['control']:+.3f}** | "
            f"{r['steps']} | {r['rollouts_per_s']:.0f} | {r['wall']:.0f} s |"
        )
    lines += ["", f"Bar met on every seed: **{'yes' if ok else 'no'}**.", ""]
    print("\n".join(lines))
    if args.append:
        with open(args.append, 'a') as f:
            f.write("\n" + "\n".join(lines))


if __name__ == '__main__':
    main()
