"""The RL loop on a real local Ray: token identity, staleness, partial rollouts, failing agents, kill and resume."""

import json, math, subprocess, sys, time
from pathlib import Path
import pytest, torch
from molt_nb.config import load_config
from molt_nb.controller import launch
from molt_nb.store import RunStore
from molt_nb.actor import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / 'recipes' / 'parity'


def config(tmp_path, *overrides, recipe=PARITY):
    return load_config(recipe, ['loop.eval_tasks=16', 'loop.debug=true', f'run_dir="{tmp_path / "run"}"', *overrides])


def finish(cfg, **kw) -> tuple:
    "Launch `cfg` under a name of its own and wait for it to end; (its last metrics row, its store)"
    import ray
    from molt_nb.steering import NAMESPACE

    run = launch(cfg, name=f"loop-{time.monotonic_ns()}", **kw)
    try:
        run.wait(timeout=600)
        named = {a['name'] for a in ray.util.list_named_actors(all_namespaces=True) if a['namespace'] == NAMESPACE}
        assert f"{run.name}/trainer" not in named, 'the trainer outlived its run'  # (it held the model, optimizer)
        return run.metrics().iloc[-1].dropna().to_dict(), RunStore(cfg.run_dir)
    finally:
        run.kill()


def trained_ages(store: RunStore) -> list:
    "For every trained token, how many versions older than the trainer it was (step s trains at version s-1)"
    s = store.samples()
    return [step - 1 - v for step, vs in zip(s.step, s.versions) for v in vs]


def test_token_identity_sync(ray_local, tmp_path):
    row, store = finish(config(tmp_path, 'loop.steps=4', 'loop.mode="sync"'))
    m = store.metrics().iloc[1:]
    assert row['version'] == 4 and list(m.step) == [1, 2, 3, 4]
    assert (m.identity_checked == m['train/tokens']).all()  # every trained token was checked against the engine
    assert set(trained_ages(store)) == {0}  # strictly on-policy


def test_async_staleness_bound(ray_local, tmp_path):
    _, store = finish(
        config(tmp_path, 'loop.steps=8', 'loop.mode="async"', 'loop.max_staleness=1', 'rollout.groups_in_flight=16')
    )
    ages = trained_ages(store)
    assert ages and max(ages) <= 1 and min(ages) >= 0
    m = store.metrics().iloc[1:]
    assert (m.identity_checked == m['train/tokens']).all()


def test_partial_rollout_two_versions(ray_local, tmp_path):
    row, store = finish(
        config(
            tmp_path,
            'loop.steps=6',
            'loop.mode="partial"',
            'loop.max_staleness=8',
            'rollout.max_tokens=48',
            'rollout.groups_in_flight=16',
            # the engine is the bottleneck (4 rows at a time): requests are running at every sync, whatever the
            # machine's speed, and the next batch is collected while the trainer trains
            'rollout.max_batch=4',
        )
    )
    s = store.samples()
    mixed = s[s.versions.map(lambda v: len(set(v)) > 1)]
    assert len(mixed) > 0, "no sequence straddled a weight sync"
    assert all(list(v) == sorted(v) for v in s.versions)  # a sequence's later tokens come from newer weights
    m = store.metrics().iloc[1:]
    assert (m.identity_checked == m['train/tokens']).all()  # each token's version is the one the engine stamped
    assert all(math.isfinite(x) for x in m['train/loss']) and all(math.isfinite(x) for x in m['train/ratio_p50'])
    assert row['version'] == 6


FAULTY = '''
import asyncio
from molt_nb.agents import Env, StepEnvRunner
from molt_nb.core import Result
_fired = {None}  # the first rollout that meets each fault raises or hangs; every other one behaves

def tasks(split):
    if split != 'train':
        return [dict(prompt='x:', fault=None)]
    return [dict(prompt=f"{n}:", fault=('raise', 'hang')[n % 2]) for n in range(200)]

class Faulty(Env):
    async def reset(self, task):
        self.fault = task['fault'] if task['fault'] not in _fired else None
        _fired.add(self.fault)
        return task['prompt']
    async def step(self, turn):
        if self.fault == 'raise': raise RuntimeError('verifier crashed')
        if self.fault == 'hang': await asyncio.sleep(3600)
        return Result(reward=float(int(turn.token_ids[0]) % 2 == 0))

def AgentRunner(tokenizer):
    return StepEnvRunner(Faulty, tokenizer, max_context=32, template=False)
'''


def test_raising_and_hanging_agent_cost_one_rollout_each(ray_local, tmp_path):
    recipe = tmp_path / 'faulty'
    recipe.mkdir()
    (recipe / 'agent.py').write_text(FAULTY)
    (recipe / 'recipe.toml').write_text((PARITY / 'recipe.toml').read_text())
    # the recipe check would meet a fault (it is meant to): the run is what is tested
    row, store = finish(
        config(tmp_path, 'loop.steps=3', 'loop.mode="sync"', 'rollout.timeout_s=2', recipe=recipe), check=False
    )
    assert row['step'] == 3
    assert row['pool/rollouts/error:RuntimeError'] == 1
    assert row['pool/rollouts/timeout'] == 1
    assert 'pool/groups/failed' not in row  # the other rollouts of both groups trained
    sizes = store.samples().groupby('group_id').size().tolist()
    assert sorted(sizes) == [3, 3] + [4] * (len(sizes) - 2)  # two groups trained on 3 of their 4 samples


def gone(run, timeout: float = 60):
    "Wait until a killed run's orchestrator and trainer actors are dead"
    import ray
    from molt_nb.steering import NAMESPACE

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            ray.get_actor(f"{run.name}/trainer", namespace=NAMESPACE)
            trainer_alive = True
        except ValueError:
            trainer_alive = False
        try:
            ray.get(run.actor.__ray_ready__.remote(), timeout=1)
            alive = True
        except Exception:  # RayActorError / ActorDiedError once it is dead
            alive = False
        if not (alive or trainer_alive):
            return
        time.sleep(0.2)
    raise AssertionError(f"run {run.name!r} still alive {timeout} s after kill")


def test_kill_then_resume_continues(ray_local, tmp_path):
    cfg = config(tmp_path, 'loop.steps=1000', 'loop.mode="async"', 'train.checkpoint_every=2', 'loop.debug=false')
    run = launch(cfg, name='killed')
    ckpts = Path(cfg.run_dir) / 'checkpoints'
    deadline = time.time() + 120
    while (
        latest_checkpoint(ckpts) is None
        or json.loads((latest_checkpoint(ckpts) / 'state.json').read_text())['step'] < 4
    ):
        assert time.time() < deadline, "no checkpoint within 2 minutes"
        time.sleep(0.2)
    import ray

    ray.kill(run.actor)  # the run's actor alone dies (an OOM, a kill from the dashboard): its trainer ends with it
    gone(run)  # ray.kill only asks: a checkpoint may still land until both actors are dead
    ckpt = latest_checkpoint(ckpts)
    state = json.loads((ckpt / 'state.json').read_text())
    step, pool = state['step'], state['extra']['pool']
    saved = torch.load(ckpt / 'trainer.pt', weights_only=False)['optimizer']

    # resume with nothing left to train: the trainer's restored optimizer state is the checkpoint's
    import dataclasses
    from molt_nb.steering import NAMESPACE

    # (held before its first step: the trainer of a run that ended has ended with it)
    cfg_at = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, steps=step + 1))
    probe = launch(cfg_at, name='killed', from_checkpoint=True, start=False)  # the name is free again
    probe.pause(after=step)
    probe.start()
    deadline = time.time() + 300
    while (st := probe.status())['state'] != 'paused':
        assert time.time() < deadline and st['state'] == 'running', st
        time.sleep(0.2)
    trainer = ray.get_actor('killed/trainer', namespace=NAMESPACE)
    restored = ray.get(trainer.optimizer_state.remote())
    assert restored['state'].keys() == saved['state'].keys()
    for k in saved['state']:
        assert torch.equal(restored['state'][k]['exp_avg'], saved['state'][k]['exp_avg'])
    assert ray.get(trainer.state.remote())['step'] == step
    probe.kill()

    # resume for two more steps: step count and data position continue
    more = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, steps=step + 2))
    row, store = finish(more, from_checkpoint=True)
    m = store.metrics()
    assert row['step'] == step + 2 and row['version'] == step + 2
    assert list(m.step) == sorted(set(m.step)) and m.step.max() == step + 2  # no step counted twice
    after = store.samples()
    after = after[after.step > step]
    allowed = set(pool['pending']) | set(range(pool['position'], pool['position'] + 100))
    assert (
        set(after.prompt_index) <= allowed
    )  # nothing before the saved position is repeated, except the groups in flight
    assert set(pool['pending']) & set(
        after.prompt_index
    )  # the groups in flight at the checkpoint are trained after resume


def test_train_command_bad_config_fails_before_ray():
    out = subprocess.run(
        [str(Path(sys.executable).parent / 'molt-nb'), 'train', str(PARITY), 'rollout.n_samples=1'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and 'rollout.n_samples is 1' in out.stderr
    assert 'Ray' not in out.stderr and 'ray' not in out.stdout


# In one process (an `Orchestrator` and a `Trainer`, no Ray): the parity recipe with one thing broken in its Env.reset
from molt_nb.loop import Orchestrator, Trainer
from molt_nb.pool import RunStopped


def parity_with(tmp_path, reset: str) -> Path:
    "The parity recipe whose Env.reset runs `reset` first (`_evals`, `_trains`: counters of eval and train rollouts)"
    d = tmp_path / 'recipe'
    d.mkdir()
    (d / 'recipe.toml').write_text((PARITY / 'recipe.toml').read_text())
    src = (PARITY / 'agent.py').read_text()
    old = "    async def reset(self, task):\n        return task['prompt']"
    assert old in src
    head = "import asyncio, itertools\n_evals, _trains = itertools.count(), itertools.count()\n"
    (d / 'agent.py').write_text(
        head
        + src.replace(
            old,
            "    async def reset(self, task):\n        evaluating = int(task['prompt'][:-1]) >= 1000\n        "
            f"{reset}\n        return task['prompt']",
        )
    )
    return d


def run_here(cfg) -> tuple:
    "(the last row or the exception, the orchestrator, seconds from the start of `run`)"
    import asyncio

    orch = Orchestrator(cfg, Trainer(cfg))
    start = time.perf_counter()
    try:
        out = asyncio.run(orch.run())
    except Exception as e:
        out = e
    finally:
        orch.close()
    return out, orch, time.perf_counter() - start


TINY_HERE = [
    'loop.eval_tasks=2',
    'rollout.groups_per_step=2',
    'rollout.n_samples=2',
    'rollout.groups_in_flight=4',
    'train.micro_batch_rows=4',
]


@pytest.mark.parametrize('works', [0, 2])
def test_time_limit_holds_when_evaluation_hangs(tmp_path, works):
    """Every eval rollout after the first `works` hangs (timeout_s is long): the run still ends about loop.seconds, plus
    at most the final evaluation's grace"""
    from molt_nb.loop import EVAL_GRACE_S

    recipe = parity_with(tmp_path, f"if evaluating and next(_evals) >= {works}: await asyncio.sleep(3600)")
    out, orch, seconds = run_here(
        config(
            tmp_path,
            *TINY_HERE,
            'loop.steps=1000',
            'loop.seconds=4',
            'rollout.timeout_s=120',
            'loop.debug=false',
            recipe=recipe,
        )
    )
    assert seconds < 4 + EVAL_GRACE_S + 10, seconds  # before: the hanging evaluation waited rollout.timeout_s (120 s)
    if works == 0:  # the first evaluation hangs: it takes the run's time, and no step can finish
        assert isinstance(out, RunStopped) and 'no training step finished within loop.seconds=4' in str(out), out
        assert orch.store.failures()['eval timeout']['count'] == 2
    else:  # the steps train; the final evaluation hangs, is cut after its grace, scores 0 and is counted
        assert not isinstance(out, Exception), out
        assert out['step'] >= 1 and out['eval'] == 0.0 and out['eval_failed'] == 2.0, out
        assert json.loads((latest_checkpoint(orch.store.checkpoints) / 'state.json').read_text())['step'] == out['step']


@pytest.mark.parametrize('mode', ['sync', 'async'])
def test_failure_stop_logs_and_checkpoints_the_steps_trained(tmp_path, mode):
    """Train rollouts raise after three steps' worth: the run stops, and every step trained is in the metrics and the
    final checkpoint"""
    recipe = parity_with(
        tmp_path, "if not evaluating and next(_trains) >= 12: raise ConnectionError('scorer service is down')"
    )
    out, orch, seconds = run_here(
        config(
            tmp_path,
            *TINY_HERE,
            'loop.steps=1000',
            f'loop.mode="{mode}"',
            'rollout.failure_window=8',
            'loop.max_staleness=8',
            recipe=recipe,
        )
    )
    assert isinstance(out, RunStopped) and 'ConnectionError: scorer service is down' in str(out), out
    assert orch.step >= 1
    assert list(orch.store.metrics().step) == list(
        range(orch.step + 1)
    )  # before (async): the last step's row was never logged
    ckpt = latest_checkpoint(orch.store.checkpoints)
    assert (
        ckpt is not None and json.loads((ckpt / 'state.json').read_text())['step'] == orch.step
    )  # before: no checkpoint (checkpoint_every=0)
    # more than max_failure_rate (0.5) of the window of 8: the stop comes at the first full window past it
    assert orch.store.failures()['train error:ConnectionError']['count'] >= 5


SLOW_AGENT = '''
import asyncio
from molt_nb.agents import Env, StepEnvRunner
from molt_nb.core import Result

def tasks(split):
    return [dict(prompt=f"{n}:") for n in range(1000)]

class Slow(Env):
    async def reset(self, task):
        await asyncio.sleep(0.05)  # an agent that thinks before it asks the engine
        return task['prompt']
    async def step(self, turn):
        return Result(reward=float(int(turn.token_ids[0]) % 2 == 0))

def AgentRunner(tokenizer):
    return StepEnvRunner(Slow, tokenizer, max_context=32, template=False)
'''


def idle_causes(store: RunStore):
    "Each cause's share of the engine's idle time over the steps, and the largest gap between the causes' sum and it"
    m = store.metrics()
    m = m[m.step > 0]
    causes = [f"engine_idle/{k}" for k in ('starved', 'backpressure', 'sync')]
    gap = float((m[causes].sum(axis=1) - m.engine_idle).abs().max())
    return {c.split('/')[1]: float(m[c].sum() / m.engine_idle.sum()) for c in causes}, gap


def test_engine_idle_split_names_the_cause(ray_local, tmp_path):
    # a trainer slower than the engine (one row per micro-batch) and a pool that holds two steps at most: the engine
    # waits on the trainer, which is backpressure
    _, held = finish(
        config(
            tmp_path / 'held', 'loop.steps=8', 'loop.mode="async"', 'train.micro_batch_rows=1',
            'rollout.groups_in_flight=4', 'loop.debug=false',
        )
    )  # fmt: skip
    share, gap = idle_causes(held)
    assert gap < 1e-6  # the causes add up to the idle
    assert share["backpressure"] > 0.5, share
    # agents that sleep 50 ms before they ask, with room for 16 groups in the pool: the engine starves
    recipe = tmp_path / 'slow'
    recipe.mkdir()
    (recipe / 'agent.py').write_text(SLOW_AGENT)
    (recipe / 'recipe.toml').write_text((PARITY / 'recipe.toml').read_text())
    _, slow = finish(
        config(tmp_path / 'slow-run', 'loop.steps=8', 'loop.mode="async"', 'rollout.groups_in_flight=16',
               'loop.debug=false', recipe=recipe)
    )  # fmt: skip
    share, gap = idle_causes(slow)
    assert gap < 1e-6
    assert share["starved"] > 0.5, share


def test_a_lone_engine_killed_mid_run_is_restored_at_once(ray_local, tmp_path):
    """One engine actor (as every GPU run with engines = 1) killed after step 2 in async mode: the requests it served
    are aborted, the waiting ones share one restore (a new engine loaded with the trainer's kept snapshot), the run
    trains on without counting the outage as agent failures, and nothing relaunches groups in a tight loop"""
    import asyncio, ray
    from molt_nb.loop import Orchestrator, Trainer
    from molt_nb.router import EngineActor

    cfg = config(tmp_path, 'loop.mode="async"', 'loop.steps=6', 'rollout.max_tokens=24', 'loop.debug=false')
    actor, made = ray.remote(EngineActor).options(num_cpus=0), []

    def make_engine(slot: int, incarnation: int):
        made.append(actor.remote(cfg, slot + incarnation))
        return made[-1]

    orch = Orchestrator(cfg, Trainer(cfg), make_engine=make_engine)

    async def go():
        task = asyncio.ensure_future(orch.run())
        deadline = time.monotonic() + 300
        while orch.logged_step() < 2:
            assert time.monotonic() < deadline and not task.done(), 'step 2 was never logged'
            await asyncio.sleep(0.05)
        ray.kill(made[0])
        start = time.monotonic()
        await asyncio.wait_for(task, 300)
        return time.monotonic() - start

    seconds = asyncio.run(go())
    orch.close()
    c, pool = orch.engine.counters, orch.pool
    assert orch.store.rows[-1]['step'] == 6 and len(made) == 2 and c['deaths'] == 1 and c['restarts'] == 1, (c, made)
    assert 'engine 0 (incarnation 0)' in orch.engine.last_death
    assert orch.train_failures.rate <= cfg.rollout.max_failure_rate and not orch.train_failures.counts
    attempts = pool.counters['restarted'] + sum(pool.failures.counts.values()) + pool.counters['rollouts/ok']
    assert attempts / seconds < 500, (attempts, seconds)  # the busy loop made 23,000 attempts a second
