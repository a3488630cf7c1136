"""Deliberately broken recipes through the real `molt-nb train`: each mistake ends in seconds with a message that
names it.

Each case copies the parity recipe into a temporary directory and breaks one thing. One case runs the real
`molt-nb` command in a subprocess; the others call `cli.main` in a thread of this process (no second import of
torch; the cases that need a run share the session's Ray). A hang fails the test (a deadline on every call)
instead of hanging the suite.
"""

import json, os, re, subprocess, sys, threading, time
from pathlib import Path
import pytest
from molt_nb import cli
from molt_nb.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / 'recipes' / 'parity'
MOLT = Path(sys.executable).parent / 'molt-nb'
LIMIT_S = 30  # the bound on every broken-recipe case; for a run, counted from its start (below)
HANG_S = 90  # past this a call counts as hung (and is killed)
TINY = [
    'loop.steps=2',
    'loop.eval_tasks=2',
    'rollout.groups_per_step=2',
    'rollout.n_samples=2',
    'train.micro_batch_rows=4',
]


def recipe(root: Path, name: str, old: str = '', new: str = '') -> Path:
    "The parity recipe copied to root/name, `old` replaced by `new` in its agent module"
    d = root / name
    d.mkdir()
    (d / 'recipe.toml').write_text((PARITY / 'recipe.toml').read_text())
    src = (PARITY / 'agent.py').read_text()
    assert old in src
    (d / 'agent.py').write_text(
        src.replace(old, new) + ("\n_calls = __import__('itertools').count()\n" if '_calls' in new else '')
    )
    return d


# the mistakes caught before Ray: (recipe edit, extra arguments, what the message must name)
BEFORE_RAY = dict(
    reset_dict=(
        ("return task['prompt']", "return {'text': task['prompt']}"),
        [],
        ["Parity.reset returned a dict ({'text'", "needs the prompt as a string"],
    ),
    step_float=(("return Result(reward=", "return ("), [], ["Parity.step returned a float", "expected a Result"]),
    no_tasks=(("def tasks(split: str)", "def train_tasks(split: str)"), [], ["does not export tasks(split)"]),
    typos=(
        None,
        ['rollouts.n_samples=2', 'loop.stepz=3'],
        [
            "2 mistakes",
            "unknown section rollouts: did you mean rollout?",
            "unknown field loop.stepz: did you mean loop.steps?",
        ],
    ),
    bad_type=(None, ['warm_start.lr=1e-3x'], ["warm_start.lr is '1e-3x', expected a number"]),
)


def run_cli(argv: list, capsys) -> tuple:
    "`molt-nb` in-process (sharing the session's Ray) under a deadline: (exit message or None, stdout, stderr, seconds)"
    result, start = {}, time.monotonic()

    def target():
        try:
            cli.main(argv)
            result['exit'] = None
        except SystemExit as e:
            result['exit'] = str(e.code)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_S)
    captured = capsys.readouterr()
    assert not t.is_alive(), f"molt-nb {' '.join(map(str, argv))} hung for {HANG_S} s:\n{captured.err[-3000:]}"
    return result['exit'], captured.out, captured.err, time.monotonic() - start


def test_reset_dict_named_by_the_real_command(tmp_path):
    """The real `molt-nb train` on an Env.reset returning a dict: the check names it in seconds (it used to hang at 0/2
    steps)"""
    d = recipe(tmp_path, 'reset_dict', *BEFORE_RAY['reset_dict'][0])
    start = time.monotonic()
    try:
        p = subprocess.run(
            [str(MOLT), 'train', str(d), '--no-control', f'run_dir="{tmp_path}/run"'],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            env={**os.environ, 'HF_HUB_OFFLINE': '1'},
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"molt-nb train hung for {HANG_S} s:\n{e.stdout}\n{e.stderr}")
    seconds = time.monotonic() - start
    assert p.returncode != 0 and seconds < LIMIT_S, (seconds, p.stdout, p.stderr)
    for expected in BEFORE_RAY['reset_dict'][2]:
        assert expected in p.stderr, p.stderr
    assert 'Traceback' not in p.stderr and 'RL:' not in p.stdout, (
        p.stdout,
        p.stderr,
    )  # a message, not a raw traceback; nothing trained


@pytest.mark.parametrize('name', BEFORE_RAY)
def test_mistake_named_before_ray(tmp_path, capsys, name):
    "Each mistake through `cli.main`, in this process: named, with no run started"
    edit, args, expected = BEFORE_RAY[name]
    d = recipe(tmp_path, name, *(edit or ()))
    code, out, err, seconds = run_cli(['train', str(d), '--no-control', *args, f'run_dir="{tmp_path}/run"'], capsys)
    assert code and seconds < LIMIT_S, (code, seconds)
    for e in expected:
        assert e in code, code
    assert 'Traceback' not in code and 'RL:' not in out  # a message, not a raw traceback; nothing trained


def run_seconds(run_dir: Path) -> float:
    "Seconds from the run's start (its config is written once both actors are up) to now"
    # Ray's actor start-up is left out: it took up to 28 s alone on a loaded 2-core machine (about 5 s unloaded)
    return time.time() - (Path(run_dir) / 'config.json').stat().st_mtime


def test_raising_reward_is_shown_counted_and_run_goes_on(ray_local, tmp_path, capsys):
    """A reward that raises on some inputs: those rollouts fail (dropped from training, 0 in evaluation), counted, first
    traceback shown"""
    d = recipe(
        tmp_path,
        'raise7',
        "    async def step(self, turn):\n        return Result(",
        "    async def step(self, turn):\n        if int(turn.task['prompt'][:-1]) % 7 == 0: raise ValueError('cannot "
        "score ' + turn.text)\n        return Result(",
    )
    run_dir = tmp_path / 'run'
    code, out, err, seconds = run_cli(
        ['train', str(d), '--no-control', *TINY, 'loop.eval_tasks=16', 'loop.steps=3', f'run_dir="{run_dir}"'], capsys
    )
    assert code is None and run_seconds(run_dir) < LIMIT_S, (code, seconds, err[-3000:])
    assert 'train error:ValueError: a rollout failed' in err and 'eval error:ValueError: a rollout failed' in err, err
    assert "raise ValueError('cannot score ' + turn.text)" in err  # the agent's own line
    m = RunStore(run_dir).metrics()
    assert m['pool/rollouts/error:ValueError'].max() > 0 and m.eval_failed.sum() > 0
    failures = json.loads((run_dir / 'failures.json').read_text())
    assert failures['train error:ValueError']['count'] == m['pool/rollouts/error:ValueError'].max()
    assert 'held-out accuracy' in out


def test_rollouts_that_keep_failing_stop_the_run(ray_local, tmp_path, capsys):
    "Every rollout after the recipe check raises: the run stops with the first traceback instead of waiting forever"
    d = recipe(
        tmp_path,
        'down',
        "    async def reset(self, task):\n        return task['prompt']",
        "    async def reset(self, task):\n        if next(_calls) >= 2: raise ConnectionError('scorer service is "
        "down')\n        return task['prompt']",
    )
    code, out, err, seconds = run_cli(
        ['train', str(d), *TINY, 'rollout.failure_window=8', f'run_dir="{tmp_path}/run"'], capsys
    )
    assert run_seconds(tmp_path / 'run') < LIMIT_S, (seconds, err[-3000:])
    assert code and code.startswith(
        'molt-nb train: the run stopped: 8 of the latest 8 rollouts failed, more than rollout.max_failure_rate=0.5'
    ), code
    assert "ConnectionError: scorer service is down" in code and 'raise rollout.max_failure_rate' in code


def test_time_limit_holds_when_no_step_completes(ray_local, tmp_path, capsys):
    "Every rollout after the recipe check hangs (and its timeout is long): loop.seconds still ends the run, saying why"
    d = recipe(
        tmp_path,
        'hang',
        "    async def reset(self, task):\n        return task['prompt']",
        "    async def reset(self, task):\n        if next(_calls) >= 2: await __import__('asyncio').sleep(3600)\n    "
        "    return task['prompt']",
    )
    code, out, err, seconds = run_cli(
        ['train', str(d), *TINY, 'loop.seconds=3', 'rollout.timeout_s=600', f'run_dir="{tmp_path}/run"'], capsys
    )
    assert run_seconds(tmp_path / 'run') < 3 + 20, (
        seconds,
        err[-3000:],
    )  # the limit, and a margin for the first evaluation and the stop (15 s seen on a slow 2-core machine; a hung run
    # would wait for rollout.timeout_s=600)
    assert code and 'the run stopped: no training step finished within loop.seconds=3' in code, code
    assert re.search(r"\d+ were still running", code), code


def test_held_out_gives_up_on_a_hanging_eval_rollout(tmp_path):
    """held_out (the warm start's and the control's evaluation) fails an Env that never returns after rollout.timeout_s,
    instead of hanging"""
    from molt_nb.config import build_policy, load_config
    from molt_nb.train import held_out

    d = recipe(
        tmp_path,
        'hang_eval',
        "    async def reset(self, task):\n        return task['prompt']",
        "    async def reset(self, task):\n        if task['prompt'] == '1001:': await "
        "__import__('asyncio').sleep(3600)\n        return task['prompt']",
    )
    cfg = load_config(d, ['loop.eval_tasks=2', 'rollout.timeout_s=2', f'run_dir="{tmp_path}/run"'])
    model, tok = build_policy(cfg)
    result, start = {}, time.monotonic()
    t = threading.Thread(target=lambda: result.setdefault('accuracy', held_out(model, cfg, tok)), daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), f"held_out hung for {HANG_S} s on an eval task whose Env never returns"
    assert time.monotonic() - start < LIMIT_S and result['accuracy'] <= 0.5, result  # the hanging task scores 0
