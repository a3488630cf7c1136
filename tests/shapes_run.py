"The shapes recipe through the real command at toy scale, as a user starts it: shared by the torch and vLLM tests"

import os, subprocess, sys
from pathlib import Path

import pandas as pd
from molt_nb.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
TOY = ['warm_start.demos=64', 'warm_start.steps=20', 'loop.eval_tasks=16', 'rollout.groups_per_step=4']


def train_shapes(run_dir: Path, *overrides: str) -> pd.DataFrame:
    """`molt-nb train recipes/shapes` at toy scale plus `overrides`, without RAY_* variables; checks its three stages,
    that the warm start and the control are kept with their processor, and that every stored sample holds its image's
    thumbnail; the run's metrics"""
    env = {k: v for k, v in os.environ.items() if not k.startswith('RAY_')}
    cli = Path(sys.executable).parent / 'molt-nb'
    p = subprocess.run(
        [str(cli), 'train', str(ROOT / 'recipes' / 'shapes'), f'run_dir="{run_dir}"', *TOY, *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=run_dir,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    summary = pd.read_csv(run_dir / 'summary.csv')
    assert list(summary.stage) == ['warm start (supervised)', 'after RL', 'control: more supervision']
    assert summary.accuracy.between(0, 1).all()
    for kept in ('warm_start', 'control'):
        assert {'model.safetensors', 'preprocessor_config.json'} <= {p.name for p in (run_dir / kept).iterdir()}
    samples = pd.concat(pd.read_parquet(f) for f in (run_dir / 'samples').glob('until_*.parquet'))
    assert len(samples) and all(len(x) == 1 and x[0].startswith('data:image/png;base64,') for x in samples.images)
    return RunStore(run_dir).metrics()
