"""The main job's claim, per seed: RL on unlabelled prompts adds what more supervision on the same labels does not.

For each seed, `molt-nb train recipes/<recipe> loop.seed=S` in full: a warm start on the recipe's labelled demos, RL on
Ray for the recipe's loop.seconds, and a control that continues supervised training on the same demos for as long as
RL ran.
Then RL's final policy and the control's answer every held-out task of the recipe (greedy, the same tasks): the
difference of their accuracies, with its standard error over the tasks (paired: each task counts once for both).

The acceptance bars, on every seed:
- arith: RL gains >= 40 points while the control gains <= 10 (held-out accuracy, mean of the run's last 3
  evaluations);
- shapes (images): RL's final policy beats the control's by more than 2 standard errors on the 2000 held-out images;
- chain (multi-turn): RL's final policy beats the control's by more than 3 standard errors on the 500 held-out chains.
Run it alone on the machine: RL's progress per second depends on the CPU it gets.

    .venv/bin/python bench/learn.py [--recipe arith|shapes] [--seeds 0 1 2] [--append bench/RESULTS.md]
"""

import argparse, dataclasses, datetime, math, os, platform, subprocess, sys, tempfile, time
from pathlib import Path
import pandas as pd
import torch
from safetensors.torch import load_model
from molt_nb.actor import latest_checkpoint
from molt_nb.config import load_config
from molt_nb.models import load_policy
from molt_nb.train import held_out_scores
from molt_nb.store import RunStore

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
        "start: 600 labelled images, 600 supervised steps. RL: GRPO on unlabelled images, {triangles:.0%} of them "
        "asking `triangles?` (held-out and demos: half), 16 images x 8 samples per step, lr 1e-4, async with "
        "max_staleness 2 on a local Ray, {seconds}. Control: supervised training on the same 600 demos from the same "
        "warm start for as long as RL ran. Accuracy: greedy exact match on the first 300 held-out images, mean of the"
        " last 3 evaluations; the final policies on all 2000. Bar: RL's final policy beats the control's by more than"
        " 2 standard errors (paired, 2000 images) on every seed.",
        lambda r: r['diff'] > 2 * r['se'],
    ),
    chain=(
        "A running total over three turns (multi-turn, completion style: `07+45=52<|im_end|>+13=65<|im_end|>...`; a "
        "wrong answer ends the chain). Warm start: 900 turns of 300 chains played by a scripted policy "
        "(`scripted_demos`), 2400 supervised steps. RL: GRPO on unlabelled chains with a shaped "
        "reward (the fraction of turns right), 16 chains x 8 samples per step, lr 1e-4, async with max_staleness 2 on"
        " a local Ray, {seconds}. Control: supervised training on the same 900 turns from the same warm start for as "
        "long as RL ran. Accuracy: the held-out score (1 for a whole chain right), greedy, on the 500 held-out "
        "chains, mean of the last 3 evaluations; the final policies on all 500. Bar: RL's final policy beats the "
        "control's by more than 3 standard errors (paired, 500 chains) on every seed.",
        lambda r: r['diff'] > 3 * r['se'],
    ),
)


def finals(recipe: str, seed: int, run_dir: Path) -> dict:
    """RL's final policy (the run's last checkpoint) and the control's, greedy on every held-out task of the recipe:
    their accuracies, the difference and its standard error over the tasks"""
    cfg = load_config(ROOT / 'recipes' / recipe, [f'loop.seed={seed}', f'run_dir="{run_dir}"'])
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(run_dir / 'warm_start')),
        loop=dataclasses.replace(cfg.loop, eval_tasks=None),
    )
    policy, tok = load_policy(run_dir / 'warm_start')
    missing, unexpected = load_model(
        policy, str(latest_checkpoint(run_dir / 'checkpoints') / 'model.safetensors'), strict=False
    )
    assert not missing and not unexpected, (missing, unexpected)
    rl = torch.tensor(held_out_scores(policy, cfg, tok))
    control = torch.tensor(held_out_scores(load_policy(run_dir / 'control')[0], cfg, tok))
    d = rl - control
    return dict(
        tasks=len(d),
        rl_final=rl.mean().item(),
        control_final=control.mean().item(),
        diff=d.mean().item(),
        se=(d.std() / math.sqrt(len(d))).item(),
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--recipe', default='arith', choices=sorted(RECIPES))
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--append', default=None)
    args = p.parse_args()
    # read once, and given to every run: the header states what the runs did even if the recipe is edited meanwhile
    recipe = load_config(ROOT / 'recipes' / args.recipe)
    seconds = recipe.loop.seconds
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
        m = RunStore(run_dir).metrics()
        steps = m[m.step > 0]
        rows.append(
            dict(
                seed=seed,
                warm=s.accuracy.iloc[0],
                rl=s.loc['after RL', 'accuracy'],
                control=s.loc['control: more supervision', 'accuracy'],
                rl_gain=s.loc['after RL', 'gain'],
                control_gain=s.loc['control: more supervision', 'gain'],
                control_steps=int(s.loc['control: more supervision', 'steps']),
                steps=int(steps.step.max()),
                rollouts_per_s=float(steps.rollouts.sum() / m.time.max()),
                wall=wall,
            )
        )
        rows[-1] |= finals(args.recipe, seed, run_dir)
        print(rows[-1], flush=True)
    what, bar = RECIPES[args.recipe]
    what = what.format(
        seconds=f'{seconds:g} s' if seconds is not None else 'no time limit',
        triangles=recipe.task_options.get('triangles', 0.5),
    )
    ok = all(map(bar, rows))
    lines = [
        f"## learn: {args.recipe}, the main job per seed, RL against a supervised control ({datetime.date.today()})",
        "",
        f"Command: `.venv/bin/python bench/learn.py --recipe {args.recipe} --seeds {' '.join(map(str, args.seeds))}` "
        f"(each seed is `molt-nb train recipes/{args.recipe} loop.seed=S`, run alone). Machine: {os.cpu_count()} CPU "
        f"cores ({platform.machine()}), no GPU, torch {torch.__version__}. {what}",
        "",
        "| seed | warm start | after RL | control | RL gain | control gain | RL - control | final RL | final control "
        "| final RL - control (SE) | RL steps | control steps | rollouts/s | wall (whole command) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['warm']:.3f} | {r['rl']:.3f} | {r['control']:.3f} | **{r['rl_gain']:+.3f}** | "
            f"{r['control_gain']:+.3f} | **{r['rl'] - r['control']:+.3f}** | {r['rl_final']:.3f} | "
            f"{r['control_final']:.3f} | **{r['diff']:+.3f}** ({r['se']:.3f}) | {r['steps']} | {r['control_steps']} | "
            f"{r['rollouts_per_s']:.0f} | {r['wall']:.0f} s |"
        )
    lines += [
        "",
        f"Final: each policy greedy on all {rows[0]['tasks']} held-out tasks; the difference of accuracies and its "
        "standard error over the tasks, paired (std of the per-task differences / sqrt(tasks)). The whole command's "
        "wall is `molt-nb train`'s; the finals' evaluation runs after it.",
        "",
        f"Bar met on every seed: **{'yes' if ok else 'no'}**.",
        "",
    ]
    print("\n".join(lines))
    if args.append:
        with open(args.append, 'a') as f:
            f.write("\n" + "\n".join(lines))


if __name__ == '__main__':
    main()
