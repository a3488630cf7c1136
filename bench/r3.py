"""Rollout routing replay (R3) on the MoE recipe: replay off and on, side by side, from one shared warm start.

The engine samples in bf16 and the trainer holds fp32 weights (recipes/arith_moe), so routing really
differs between rollout and training. The replay arm also scores each step's trained rows
with live routing before the update (`routing.compare`), which measures what replay removed on the very
same tokens, free of the noise between two runs. Each arm runs the same RL (sync: every token on-policy, so the logprob
gap and the IS filter measure the forward mismatch alone) for the same wall time, from the same weights,
seed and data order. Per step: routing agreement (the routes the training forward used vs the rollout's, and
the trainer's own routers' choice), tokens with a flipped layer, the on-policy logprob gap, the token-level
IS filter fraction, and held-out accuracy at every evaluation.

    .venv/bin/python bench/r3.py [--seconds 120] [--seed 0] [--append bench/RESULTS.md]
"""

import argparse, dataclasses, datetime, platform, tempfile, time
from pathlib import Path

from molt_nb.config import load_config
from molt_nb.controller import launch
from molt_nb.train import warm_start

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = {
    'routing/agreement': 'agreement',
    'routing/natural_agreement': 'natural agreement',
    'routing/natural_flip_frac': 'tokens with a flip',
    'routing/logp_gap_mean': 'logp gap mean',
    'routing/logp_gap_p99': 'logp gap p99',
    'train/is_filtered': 'IS filtered',
}
PAIRED = {
    'routing/live_logp_gap_mean': 'logp gap mean',
    'routing/live_logp_gap_p99': 'logp gap p99',
    'routing/live_is_filtered': 'IS filtered',
}


def arm(cfg, replay: bool, run_dir: Path):
    c = dataclasses.replace(
        cfg, routing=dataclasses.replace(cfg.routing, replay=replay, compare=replay), run_dir=str(run_dir)
    )
    run = launch(c, name=f"r3-{run_dir.name}-{time.monotonic_ns()}")
    run.wait()
    m = run.metrics()
    run.kill()
    return m


def summary(m) -> dict:
    rl = m.iloc[1:]
    evals = m.dropna(subset=['eval'])
    paired = {f"live {name}": float(rl[col].mean()) for col, name in PAIRED.items() if col in rl}
    return dict(
        steps=int(rl.step.max()),
        **{name: float(rl[col].mean()) for col, name in COLUMNS.items()},
        **paired,
        acc_start=float(evals['eval'].iloc[0]),
        acc_end=float(evals['eval'].iloc[-3:].mean()),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--seconds', type=float, default=120)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--append', help='append the results to this markdown file')
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix='molt-r3-'))
    cfg = load_config(
        ROOT / 'recipes' / 'arith_moe',
        [f'loop.seed={a.seed}', f'loop.seconds={a.seconds}', f'run_dir="{root / "warm"}"'],
    )
    path, warm_acc = warm_start(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path)))
    metrics = {replay: arm(cfg, replay, root / ('on' if replay else 'off')) for replay in (False, True)}
    rows = {replay: summary(m) for replay, m in metrics.items()}
    lines = [
        f"\n## R3: routing replay off vs on ({datetime.date.today()}, {platform.machine()}, seed {a.seed}, "
        f"{a.seconds:.0f} s each)\n",
        f"`.venv/bin/python bench/r3.py --seconds {a.seconds:.0f} --seed {a.seed}`: recipes/arith_moe (16 experts, "
        "top-2, 4 layers; bf16 engine, fp32 trainer; sync GRPO, token IS mask [0.95, 1.05]) from one warm start "
        f"(fp32 held-out accuracy {warm_acc:.3f}). Means over the RL steps; accuracy is the bf16 engine's greedy "
        "held-out accuracy at the first evaluation and the mean of the last three.\n",
        '| replay | steps | ' + ' | '.join(COLUMNS.values()) + ' | held-out start | held-out end |',
        '|---' * (len(COLUMNS) + 4) + '|',
    ]
    for replay in (False, True):
        r = rows[replay]
        lines.append(
            f"| {'on' if replay else 'off'} | {r['steps']} | "
            + ' | '.join(f"{r[n]:.4f}" for n in COLUMNS.values())
            + f" | {r['acc_start']:.3f} | {r['acc_end']:.3f} |"
        )
    on = rows[True]
    lines += [
        '',
        'The same tokens, within the replay-on run (`routing.compare`: each step also scores its trained rows with '
        'live routing, before the update):',
        '',
        '| routing in the training forward | logp gap mean | logp gap p99 | IS filtered |',
        '|---|---|---|---|',
        f"| live (what the trainer's routers choose) | {on['live logp gap mean']:.4f} | {on['live logp gap p99']:.4f} "
        f"| {on['live IS filtered']:.4f} |",
        f"| replayed (the rollout's experts) | {on['logp gap mean']:.4f} | {on['logp gap p99']:.4f} | "
        f"{on['IS filtered']:.4f} |",
    ]
    lines += [
        '',
        'Per evaluation step (off / on):',
        '',
        '| step | agreement | natural agreement | logp gap p99 | IS filtered | held-out |',
        '|---|---|---|---|---|---|',
    ]
    by_step = [metrics[r].set_index('step') for r in (False, True)]
    for step in sorted(set.intersection(*(set(t.dropna(subset=['eval']).index) for t in by_step)))[1:]:
        cell = lambda col, f='.4f': ' / '.join(
            format(float(t.loc[step, col]), f) if col in t and t.loc[step, col] == t.loc[step, col] else '-'
            for t in by_step
        )
        lines.append(
            f"| {step} | {cell('routing/agreement')} | {cell('routing/natural_agreement')} | "
            f"{cell('routing/logp_gap_p99')} | {cell('train/is_filtered')} | {cell('eval', '.3f')} |"
        )
    text = '\n'.join(lines) + '\n'
    print(text)
    # the goal is judged on the same tokens (replayed vs live routing in one run); the two runs differ in their batches
    # too
    goal = on['agreement'] == 1.0 and all(
        on[n] < on[f"live {n}"] for n in ('logp gap mean', 'logp gap p99', 'IS filtered')
    )
    across = all(on[n] < rows[False][n] for n in ('logp gap mean', 'logp gap p99', 'IS filtered'))
    verdict = (
        "Goal (replay on: 100% agreement, and a lower logprob gap (mean and p99) and IS filter fraction than live "
        f"routing on the same tokens): {'met' if goal else 'NOT met'}. "
        f"Across the two runs (different batches) replay on is {'also' if across else 'not'} lower on all three."
    )
    print(verdict)
    if a.append:
        with open(a.append, 'a') as f:
            f.write(text + '\n' + verdict + '\n')


if __name__ == '__main__':
    main()
