"""Rollout routing replay (R3) on the MoE recipe: replay off and on, side by side, from one shared warm start.

The engine samples in bf16 and the trainer holds fp32 weights (recipes/arith_moe), so routing really
differs between rollout and training. Each arm runs the same RL (sync: every token on-policy, so the logprob
gap and the IS filter measure the forward mismatch alone) for the same wall time, from the same weights,
seed and data order. Per step: routing agreement (the routes the training forward used vs the rollout's, and
the trainer's own routers' choice), tokens with a flipped layer, the on-policy logprob gap, the token-level
IS filter fraction, and held-out accuracy at every evaluation.

    .venv/bin/python bench/r3.py [--seconds 120] [--seed 0] [--append bench/RESULTS.md]
"""
import argparse, dataclasses, datetime, platform, tempfile
from pathlib import Path

from molt_nb.config import load_config
from molt_nb.loop import launch
from molt_nb.train import warm_start

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = {'routing/agreement': 'agreement', 'routing/natural_agreement': 'natural agreement', 'routing/natural_flip_frac': 'tokens with a flip',
           'routing/logp_gap_mean': 'logp gap mean', 'routing/logp_gap_p99': 'logp gap p99', 'train/is_filtered': 'IS filtered'}


def arm(cfg, replay:bool, run_dir:Path):
    c = dataclasses.replace(cfg, routing=dataclasses.replace(cfg.routing, replay=replay), run_dir=str(run_dir))
    run = launch(c)
    run.wait()
    return run.store.metrics()


def summary(m) -> dict:
    rl = m.iloc[1:]
    evals = m.dropna(subset=['eval'])
    return dict(steps=int(rl.step.max()), **{name: float(rl[col].mean()) for col, name in COLUMNS.items()},
                acc_start=float(evals['eval'].iloc[0]), acc_end=float(evals['eval'].iloc[-3:].mean()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--seconds', type=float, default=120)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--append', help='append the results to this markdown file')
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix='molt-r3-'))
    cfg = load_config(ROOT/'recipes'/'arith_moe', [f'loop.seed={a.seed}', f'loop.seconds={a.seconds}', f'run_dir="{root/"warm"}"'])
    path, warm_acc = warm_start(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path)))
    metrics = {replay: arm(cfg, replay, root/('on' if replay else 'off')) for replay in (False, True)}
    rows = {replay: summary(m) for replay, m in metrics.items()}
    lines = [f"\n## R3: routing replay off vs on ({datetime.date.today()}, {platform.machine()}, seed {a.seed}, {a.seconds:.0f} s each)\n",
             f"`.venv/bin/python bench/r3.py --seconds {a.seconds:.0f} --seed {a.seed}`: recipes/arith_moe (16 experts, top-2, 4 layers; bf16 engine, fp32 trainer; sync GRPO, token IS mask [0.95, 1.05]) from one warm start (fp32 held-out accuracy {warm_acc:.3f}). Means over the RL steps; accuracy is the bf16 engine's greedy held-out accuracy at the first evaluation and the mean of the last three.\n",
             '| replay | steps | ' + ' | '.join(COLUMNS.values()) + ' | held-out start | held-out end |',
             '|---' * (len(COLUMNS) + 4) + '|']
    for replay in (False, True):
        r = rows[replay]
        lines.append(f"| {'on' if replay else 'off'} | {r['steps']} | " + ' | '.join(f"{r[n]:.4f}" for n in COLUMNS.values()) + f" | {r['acc_start']:.3f} | {r['acc_end']:.3f} |")
    lines += ['', 'Per evaluation step (off / on):', '',
              '| step | agreement | natural agreement | logp gap p99 | IS filtered | held-out |', '|---|---|---|---|---|---|']
    off, on = (metrics[r].set_index('step') for r in (False, True))
    for step in sorted(set(off.dropna(subset=['eval']).index) & set(on.dropna(subset=['eval']).index))[1:]:
        cell = lambda col, f='.4f': ' / '.join(format(float(t.loc[step, col]), f) if col in t and t.loc[step, col] == t.loc[step, col] else '-' for t in (off, on))
        lines.append(f"| {step} | {cell('routing/agreement')} | {cell('routing/natural_agreement')} | {cell('routing/logp_gap_p99')} | {cell('train/is_filtered')} | {cell('eval', '.3f')} |")
    text = '\n'.join(lines) + '\n'
    print(text)
    goal = rows[True]['agreement'] == 1.0 and rows[True]['logp gap mean'] < rows[False]['logp gap mean'] and rows[True]['IS filtered'] < rows[False]['IS filtered']
    print('goal (replay on: 100% agreement, lower logprob gap and IS filter fraction than off):', 'met' if goal else 'NOT met')
    if a.append:
        with open(a.append, 'a') as f: f.write(text + f"\nGoal (replay on: 100% agreement, lower logprob gap and IS filter fraction than off): {'met' if goal else 'NOT met'}.\n")


if __name__ == '__main__':
    main()
