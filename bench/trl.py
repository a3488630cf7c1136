"""The arith recipe under TRL's GRPOTrainer, molt-nb sync and molt-nb async, from one shared warm start.

One supervised warm start (molt_nb.train.warm_start: 450 demos, 600 steps), saved with `save_policy`; then each arm
runs GRPO from that checkpoint for the same wall time, arms alternated:

(a) TRL 1.16.0 `GRPOTrainer` in its own virtualenv (.venv-trl, built here if missing; never the main .venv), used as
    its documentation shows: a text-prompt `Dataset`, a Python reward function, `GRPOConfig` with its fastest settings
    for one CPU and a tiny model (printed and written with the results);
(b) `molt-nb train recipes/arith model.path=<warm> warm_start.demos=0 loop.mode=sync --no-control`;
(c) the same with the recipe's default `loop.mode=async`.

The same reward (exact match: the sum then the end token), group size 8, 16 prompts per step, lr 1e-4 constant,
temperature 1, at most 4 new tokens. Held-out accuracy is greedy exact match on the recipe's eval tasks (the first
loop.eval_tasks of tasks('eval'): all 500). TRL's is measured by a `TrainerCallback` every K steps; the time it takes
is left out of TRL's clock (the clock stops while it evaluates), as molt-nb's `time_eval` is left out of its own.

    .venv/bin/python bench/trl.py [--seconds 90] [--reps 1] [--append bench/RESULTS.md]

With --reps N the arms alternate N times; the table shows each figure's median and lists every repetition's ratio.

Writes bench/out/trl.json and bench/out/trl.png. Not part of `make test`.
"""

import argparse, datetime, json, os, platform, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / '.venv-trl'
VPY = VENV / 'bin' / 'python'
OUT = ROOT / 'bench' / 'out'
TRL_EVAL_EVERY = 20  # TRL optimizer steps between held-out evaluations
MOLT_EVAL_EVERY = 50  # molt-nb steps between held-out evaluations (its steps are shorter)


# ------------------------------------------------------------------------------------------ the TRL arm (child)
def trl_child(spec_path: str):
    "Run GRPOTrainer as `spec` says; write its evaluation history and settings to spec['out']"
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec['threads'])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import trl

    tok = AutoTokenizer.from_pretrained(spec['model'], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(spec['model'], dtype=torch.float32, local_files_only=True)
    eos = tok.eos_token_id
    model.generation_config.eos_token_id = eos  # generation stops at the end token, as the molt-nb engine's does
    model.generation_config.pad_token_id = tok.pad_token_id
    target = lambda answer: tok.encode(answer, add_special_tokens=False) + [eos]  # noqa: E731

    def exact_match(completion_ids, answer, **kwargs):
        "The recipe's reward: 1 for exactly the sum followed by the end token"
        return [float(list(ids) == target(a)) for ids, a in zip(completion_ids, answer)]

    held = spec['eval']
    enc = tok([t['prompt'] for t in held], return_tensors='pt', add_special_tokens=False, padding=True)
    want = [target(t['answer']) for t in held]

    @torch.no_grad()
    def accuracy(m) -> float:
        "Greedy exact match on the held-out tasks"
        was = m.training
        m.eval()
        out = m.generate(**enc, max_new_tokens=spec['max_tokens'], do_sample=False, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id)[:, enc['input_ids'].shape[1]:].tolist()  # fmt: skip
        m.train(was)
        hits = 0
        for ids, w in zip(out, want):
            ids = ids[: ids.index(eos) + 1] if eos in ids else ids
            hits += ids == w
        return hits / len(want)

    class Clock(TrainerCallback):
        "Evaluate every K steps with the clock stopped; stop training after `seconds` of clock"

        def __init__(self):
            self.history, self.paused, self.t0 = [], 0.0, None

        def clock(self):
            return time.perf_counter() - self.t0 - self.paused

        def evaluate(self, step, model):
            t = time.perf_counter()
            self.history.append(dict(step=step, time=self.clock(), eval=accuracy(model)))
            self.paused += time.perf_counter() - t
            print(f"TRL step {step}: {self.history[-1]['time']:.1f} s, accuracy {self.history[-1]['eval']:.3f}",
                  flush=True)  # fmt: skip

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.t0 = time.perf_counter()
            self.evaluate(0, model)

        def on_step_end(self, args, state, control, model=None, **kw):
            done = self.clock() >= spec['seconds']
            if done:
                self.end, control.should_training_stop = self.clock(), True
            if done or state.global_step % spec['eval_every'] == 0:
                self.evaluate(state.global_step, model)

    settings = dict(
        use_cpu=True,  # no GPU here; no vLLM (use_vllm=False, the default): generation is transformers' generate
        bf16=False,
        beta=0.0,  # no KL term, so no reference model is loaded or run
        num_generations=spec['n_samples'],
        per_device_train_batch_size=spec['n_samples'] * spec['groups'],  # 16 prompts x 8 completions per step
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,  # one optimizer step per batch: on-policy, no old log-prob pass
        max_completion_length=spec['max_tokens'],
        temperature=spec['temperature'],
        learning_rate=spec['lr'],
        lr_scheduler_type='constant',  # molt-nb's optim.schedule default (TRL's default decays linearly)
        warmup_steps=0,
        adam_beta2=0.99,  # molt-nb's AdamW betas (0.9, 0.99); weight decay 0 and grad clip 1.0 are both defaults
        max_steps=10**6,  # the callback stops training on the clock
        logging_steps=10**6,
        report_to='none',
        save_strategy='no',
        disable_tqdm=True,
        seed=spec['seed'],
        output_dir=spec['workdir'],
    )
    data = Dataset.from_dict(
        dict(prompt=[t['prompt'] for t in spec['train']], answer=[t['answer'] for t in spec['train']])
    )
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=GRPOConfig(**settings), train_dataset=data,
                          processing_class=tok, callbacks=[clock])  # fmt: skip
    trainer.train()
    steps = trainer.state.global_step
    Path(spec['out']).write_text(
        json.dumps(
            dict(
                steps=steps,
                rollouts=steps * settings['per_device_train_batch_size'],
                seconds=clock.end,
                history=clock.history,
                settings=settings
                | dict(
                    trl=trl.__version__,
                    torch=torch.__version__,
                    threads=spec['threads'],
                    loss_type=trainer.args.loss_type,  # TRL's defaults, recorded
                    scale_rewards=trainer.args.scale_rewards,
                ),
                eval_seconds=clock.paused,
            )
        )
    )


# ------------------------------------------------------------------------------------------ the parent
def ensure_venv():
    "Build .venv-trl if it is missing: CPU torch first (pinned), then trl 1.16.0, both under constraints.txt"
    if VPY.exists() and subprocess.run([str(VPY), '-c', 'import trl, torch'], capture_output=True).returncode == 0:
        return
    print("building .venv-trl (CPU torch 2.13.0, trl 1.16.0; about 2 minutes)", flush=True)
    pip = [str(VPY), '-m', 'pip', 'install', '-q', '-c', str(ROOT / 'constraints.txt')]
    subprocess.run([sys.executable, '-m', 'venv', str(VENV)], check=True)
    subprocess.run([*pip, 'torch==2.13.0'], check=True)
    subprocess.run([*pip, 'trl==1.16.0'], check=True)


def run_trl(cfg, parts, warm: Path, seconds: float, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    spec = dict(
        model=str(warm),
        train=[dict(prompt=t['prompt'], answer=t['answer']) for t in parts.train_tasks],
        eval=[dict(prompt=t['prompt'], answer=t['answer']) for t in parts.eval_tasks],
        seconds=seconds,
        eval_every=TRL_EVAL_EVERY,
        threads=os.cpu_count(),
        n_samples=cfg.rollout.n_samples,
        groups=cfg.rollout.groups_per_step,
        max_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        lr=cfg.optim.lr,
        seed=cfg.loop.seed,
        workdir=str(work / 'trainer'),
        out=str(work / 'result.json'),
    )
    (work / 'spec.json').write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE='1', TOKENIZERS_PARALLELISM='false', PYTHONWARNINGS='ignore')
    # -P: this file's folder is not put on sys.path (this file is named trl.py)
    subprocess.run([str(VPY), '-P', __file__, '--trl-child', str(work / 'spec.json')], check=True, env=env)
    r = json.loads((work / 'result.json').read_text())
    return r | dict(final=r['history'][-1]['eval'], samples_per_s=r['rollouts'] / r['seconds'])


def run_molt(warm: Path, seconds: float, mode: str, seed: int, work: Path) -> dict:
    "`molt-nb train` from the warm start; figures from its metrics.parquet with evaluation time left out"
    from molt_nb.store import RunStore  # (this file also runs in TRL's environment, which has no molt_nb)

    threads = ['train.threads=2', 'rollout.threads=1'] if mode == 'sync' else ['train.threads=1', 'rollout.threads=1']
    cmd = [
        str(Path(sys.executable).parent / 'molt-nb'), 'train', str(ROOT / 'recipes' / 'arith'), f'model.path="{warm}"',
        'warm_start.demos=0', f'loop.seconds={seconds:g}', 'loop.steps=1000000', f'loop.mode={mode}',
        f'loop.eval_every={MOLT_EVAL_EVERY}', f'loop.seed={seed}', *threads, f'run_dir="{work}"', '--no-control',
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env=dict(os.environ, TOKENIZERS_PARALLELISM='false'))
    m = RunStore(work).metrics().sort_values('step')
    # a row's time is taken before its own evaluation: leave out the evaluations of the rows before it
    before = m.time_eval.fillna(0).cumsum().shift(1).fillna(0) if 'time_eval' in m else 0.0
    m = m.assign(clock=m.time - before)
    evals = m[m['eval'].notna()]
    steps = m[m.step > 0]
    wall = float(m.clock.max())
    return dict(
        steps=int(steps.step.max()),
        rollouts=int(steps.rollouts.sum()),
        seconds=wall,
        samples_per_s=float(steps.rollouts.sum()) / wall,
        history=[dict(step=int(r.step), time=float(r.clock), eval=float(r.eval)) for r in evals.itertuples()],
        final=float(evals['eval'].iloc[-1]),
        eval_seconds=float(m.time_eval.fillna(0).sum()) if 'time_eval' in m else 0.0,
        command=' '.join(cmd[1:]),
    )


def time_to(history: list, acc: float):
    "Clock seconds of the first evaluation at or above `acc` (None: never)"
    return next((h['time'] for h in history if h['eval'] >= acc - 1e-9), None)


def as_time(t) -> str:
    "A time to an accuracy as the table shows it: None or infinity (never reached) is 'never'"
    return 'never' if t is None or t == float('inf') else f"{t:.0f} s"


def medians(runs: dict) -> tuple:
    """Each arm's median figures over the repetitions, and the per-repetition lines. In each repetition an arm's time
    to TRL's final accuracy is measured against that repetition's TRL run; an arm that never reaches it counts as
    infinitely slow in the median"""
    trl = runs['(a) TRL GRPOTrainer']
    for k, rs in runs.items():
        for r, t in zip(rs, trl):
            r['time_to_trl_final'] = time_to(r['history'], t['final'])
    med = statistics.median_low  # an observed value: the table shows one run's figure per cell
    never = lambda t: float('inf') if t is None else t  # noqa: E731
    res = {
        k: dict(
            steps=med([r['steps'] for r in rs]),
            samples_per_s=med([r['samples_per_s'] for r in rs]),
            start=med([r['history'][0]['eval'] for r in rs]),
            final=med([r['final'] for r in rs]),
            seconds=med([r['seconds'] for r in rs]),
            time_to_trl_final=med([never(r['time_to_trl_final']) for r in rs]),
            settings=rs[0].get('settings'),
        )
        for k, rs in runs.items()
    }
    asy = runs['(c) molt-nb async']
    per_rep = [
        f"repetition {i}: TRL {t['samples_per_s']:.0f} rollouts/s, final {t['final']:.3f}; async "
        f"{a['samples_per_s']:.0f} rollouts/s ({a['samples_per_s'] / t['samples_per_s']:.2f}x), reaches it in "
        f"{as_time(a['time_to_trl_final'])}"
        for i, (t, a) in enumerate(zip(trl, asy))
    ]
    return res, per_rep


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--seconds', type=float, default=90, help='wall time of each arm, evaluations left out')
    p.add_argument('--reps', type=int, default=1, help='repetitions; the arms alternate within each')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--append', default=None)
    p.add_argument('--trl-child', default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        return trl_child(args.trl_child)
    ensure_venv()
    import torch
    from molt_nb.config import load_config
    from molt_nb.recipe import recipe_parts
    from molt_nb.train import warm_start

    OUT.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix='molt-trl-bench-'))
    cfg = load_config(ROOT / 'recipes' / 'arith', [f'loop.seed={args.seed}', f'run_dir="{root / "warm"}"'])
    t = time.perf_counter()
    warm, warm_acc = warm_start(cfg)
    print(f"warm start: {time.perf_counter() - t:.0f} s, held-out accuracy {warm_acc:.3f}, saved to {warm}", flush=True)
    from molt_nb.config import build_policy

    _, tok = build_policy(cfg)
    parts = recipe_parts(cfg, tok)
    arms = {
        '(a) TRL GRPOTrainer': lambda w: run_trl(cfg, parts, warm, args.seconds, w),
        '(b) molt-nb sync': lambda w: run_molt(warm, args.seconds, 'sync', args.seed, w),
        '(c) molt-nb async': lambda w: run_molt(warm, args.seconds, 'async', args.seed, w),
    }
    runs = {k: [] for k in arms}
    for rep in range(args.reps):
        for i, (name, fn) in enumerate(arms.items()):
            r = fn(root / f"rep{rep}-arm{i}")
            runs[name].append(r)
            print(f"{name} (rep {rep}): {r['samples_per_s']:.0f} rollouts/s, {r['steps']} steps, accuracy "
                  f"{r['history'][0]['eval']:.3f} -> {r['final']:.3f} in {r['seconds']:.0f} s", flush=True)  # fmt: skip
    res, per_rep = medians(runs)
    trl_final, trl_r, asy = res['(a) TRL GRPOTrainer']['final'], res['(a) TRL GRPOTrainer'], res['(c) molt-nb async']
    # each repetition's async/TRL ratio (the two ran minutes apart), their median
    pairs = zip(runs['(a) TRL GRPOTrainer'], runs['(c) molt-nb async'])
    ratio = statistics.median(a['samples_per_s'] / t['samples_per_s'] for t, a in pairs)
    goal_time = asy['time_to_trl_final'] is not None and asy['time_to_trl_final'] <= trl_r['seconds'] / 2
    goal_rate = ratio >= 2

    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rs in runs.items():  # the last repetition's curves
        h = rs[-1]['history']
        ax.plot([x['time'] for x in h], [x['eval'] for x in h], marker='o', ms=3, label=name)
    last_final = runs['(a) TRL GRPOTrainer'][-1]['final']
    ax.axhline(last_final, color='grey', ls=':', lw=1, label="TRL's final accuracy")
    ax.set(xlabel='wall time, evaluations left out (s)', ylabel='held-out accuracy (greedy exact match)',
           title=f'arith: GRPO from one warm start ({args.seconds:g} s per arm)')  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / 'trl.png', dpi=120)
    out = dict(
        date=str(datetime.date.today()),
        seconds=args.seconds,
        reps=args.reps,
        seed=args.seed,
        warm_start_accuracy=warm_acc,
        machine=f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU, torch {torch.__version__}",
        arms=runs,
        async_over_trl_rollouts=ratio,
        goals=dict(async_half_time=goal_time, async_2x_rollouts=goal_rate),
    )
    (OUT / 'trl.json').write_text(json.dumps(out, indent=1))
    s = trl_r['settings']
    lines = [
        f"## TRL GRPOTrainer vs molt-nb sync and async on arith ({datetime.date.today()})",
        "",
        f"Command: `.venv/bin/python bench/trl.py --seconds {args.seconds:g} --reps {args.reps} --seed {args.seed}`. "
        f"Machine: {out['machine']}. One supervised warm start (molt-nb's, 450 demos, 600 steps; held-out accuracy "
        f"{warm_acc:.3f}), saved with `save_policy`; each arm runs GRPO from it for {args.seconds:g} s of wall time, "
        f"evaluations left out, {args.reps} repetition(s), arms in the order of the table; each cell is the median "
        "over the repetitions (the lower middle value when their number is even), each repetition's time measured "
        "against its own TRL run's final accuracy. Same reward (exact match), "
        "16 prompts x 8 samples per step, lr 1e-4 constant, AdamW betas (0.9, 0.99), clip 1.0, temperature 1, at most "
        "4 new tokens; held-out accuracy is greedy exact match on the 500 eval tasks. "
        f"TRL {s['trl']} (in .venv-trl) settings: `use_cpu=True`, no vLLM, `beta=0.0`, "
        f"`per_device_train_batch_size={s['per_device_train_batch_size']}`, `num_generations={s['num_generations']}`, "
        "`steps_per_generation=1`, `num_iterations=1`, `max_completion_length=4`, `lr_scheduler_type='constant'`, "
        "`adam_beta2=0.99`, `report_to='none'`, `save_strategy='no'`, other defaults ("
        f"`loss_type='{s['loss_type']}'`, `scale_rewards='{s['scale_rewards']}'`), "
        f"{s['threads']} torch threads; its accuracy is taken by a `TrainerCallback` every {TRL_EVAL_EVERY} steps "
        f"with its clock stopped. molt-nb: `molt-nb train recipes/arith model.path=<warm> warm_start.demos=0 "
        f"loop.seconds={args.seconds:g} loop.mode=sync|async loop.eval_every={MOLT_EVAL_EVERY} --no-control` "
        "(threads: sync trainer 2 engine 1, async 1 and 1); its loop.seconds includes its evaluations, which are "
        "then left out of its clock, so its RL time is a little under the TRL arm's.",
        "",
        "| arm | optimizer steps | rollouts/s | held-out accuracy start -> end | RL seconds | time to TRL's final "
        "accuracy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in res.items():
        lines.append(
            f"| {name} | {r['steps']} | {r['samples_per_s']:.0f} | {r['start']:.3f} -> {r['final']:.3f} "
            f"| {r['seconds']:.0f} | {as_time(r['time_to_trl_final'])} |"
        )
    lines += [
        "",
        f"Goals: async reaches TRL's final accuracy (median {trl_final:.3f}; each repetition against its own) in at "
        "most half TRL's wall time "
        f"({trl_r['seconds'] / 2:.0f} s): **{'met' if goal_time else 'not met'}** "
        f"({as_time(asy['time_to_trl_final'])}); async rollouts/s at least 2x TRL's: "
        f"**{'met' if goal_rate else 'not met'}** ({ratio:.2f}x, the median of the repetitions' ratios). Plot (the "
        "last repetition): bench/out/trl.png; data: bench/out/trl.json.",
        "",
        *[f"- {x}" for x in per_rep],
        "",
        "Not equal between the arms: the policy loss (TRL's `loss_type` above vs molt-nb's recipe loss, algo.loss), "
        "the data order (TRL's own shuffled sampler), the threads (TRL one process with 2, molt-nb two processes), "
        "and the RL seconds (molt-nb's loop.seconds counts its evaluations). Evaluation points are sparser for "
        "molt-nb (every 50 steps vs TRL's 20), so its time to a given accuracy is coarser. "
        f"{args.reps} repetition(s), one seed: a few points of held-out accuracy are within run-to-run noise.",
        "",
    ]
    print("\n".join(lines))
    if args.append:
        with open(args.append, 'a') as f:
            f.write("\n" + "\n".join(lines))


if __name__ == '__main__':
    main()
