"""The run in the cluster's shape on a private local Ray: engines as actors behind the router, a 2-rank FSDP2 trainer
group, weights broadcast over gloo, and an engine killed in the middle of a run."""

import tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parity(*overrides):
    from molt_nb.config import load_config

    return load_config(
        ROOT / 'recipes' / 'parity',
        [
            'loop.eval_tasks=16',
            'loop.mode="async"',
            'loop.debug=true',
            f'run_dir="{tempfile.mkdtemp(prefix="molt-cluster-")}"',
            *overrides,
        ],
    )


FROZEN = lambda actor: __import__('gc').get_freeze_count()  # noqa: E731 (a lambda travels by value)


def finished(run, timeout: float = 300):
    "The run's metrics once it finished (its actors are killed whatever happens)"
    try:
        st = run.wait(timeout=timeout)
        assert st['state'] == 'finished', st
        return run.metrics().iloc[1:]  # row 0 is the first evaluation
    finally:
        run.kill()


def test_engines_and_trainer_ranks(ray_local):
    "2 engine actors and 2 trainer ranks: every trained token is the engine's, every step's weights reach the engines"
    from molt_nb.controller import launch

    cfg = parity('loop.steps=3', 'cluster.engines=2', 'cluster.trainer_ranks=2')
    assert cfg.cluster.weight_transport == 'broadcast'
    m = finished(launch(cfg, name='cluster-2x2', check=False))
    assert list(m.step) == [1, 2, 3]
    assert list(m.version) == [1, 2, 3]  # the engines sample with the weights of the step just trained
    assert (m.identity_checked > 0).all()  # loop.debug: trained tokens checked against the engines' record
    assert (m['engine/alive'] == 2).all()
    assert (m[['engine/0/requests', 'engine/1/requests']].sum() > 0).all()  # both engines served


def test_engine_killed_mid_run(ray_local):
    "A dead engine costs only the requests it was serving (their rollouts run again), and comes back at the next sync"
    import ray
    from molt_nb.controller import launch
    from molt_nb.steering import NAMESPACE

    # async: the pool keeps rollouts in flight on both engines all the time, so the kill catches some
    cfg = parity('loop.steps=8', 'cluster.engines=2', 'rollout.max_tokens=24')
    run = launch(cfg, name='cluster-kill', check=False)
    try:
        run.wait(until_step=2, timeout=300)
        engine = ray.get_actor('cluster-kill/engine/0.0', namespace=NAMESPACE)
        # kill it while it decodes (its step count moved between two looks), not while a sync has drained it: a kill
        # between steps would catch no request
        seen, deadline = ray.get(engine.stats.remote())['steps'], time.monotonic() + 60
        while ray.get(engine.stats.remote())['steps'] == seen and time.monotonic() < deadline:
            time.sleep(0.005)
        ray.kill(engine)
    except BaseException:
        run.kill()
        raise
    m = finished(run)
    assert len(m) == 8 and list(m.version) == list(range(1, 9))
    last = m.iloc[-1]
    assert last['engine/deaths'] == 1 and last['engine/restarts'] == 1 and last['engine/alive'] == 2
    # the requests it was serving failed, and their rollouts ran again on the other engine: no rollout failed
    assert last['engine/failed_requests'] >= 1 and last.get('pool/restarted', 0) >= last['engine/failed_requests']
    assert m['failure_rate'].max() == 0
    back = m[m['engine/restarts'] == 1].iloc[1:]  # the steps after the one whose sync replaced it
    assert back['engine/0/requests'].sum() > 0  # the new engine in slot 0 serves


def test_each_side_runs_in_its_own_python(ray_local, tmp_path):
    """cluster.rollout_python and cluster.trainer_python start the engines and the trainer ranks from their own
    environments (a GPU image has two: vLLM and NeMo AutoModel cannot share one); the run's own actor stays in Ray's"""
    import sys
    import ray
    from molt_nb.controller import launch
    from molt_nb.steering import NAMESPACE

    pythons = {}
    for role in ('rollout', 'trainer'):
        pythons[role] = tmp_path / f"{role}-python"
        pythons[role].write_text(f'#!/bin/sh\nexport MOLT_SIDE={role}\nexec {sys.executable} "$@"\n')
        pythons[role].chmod(0o755)
    overrides = [f'cluster.{role}_python="{path}"' for role, path in pythons.items()]
    cfg = parity('loop.steps=1000', 'cluster.engines=2', 'cluster.trainer_ranks=2', *overrides)
    run = launch(cfg, name='cluster-sides', check=False)
    try:
        run.wait(until_step=1, timeout=300)
        names = ['cluster-sides', 'cluster-sides/engine/0.0', 'cluster-sides/engine/1.0', 'cluster-sides/trainer/0']
        names.append('cluster-sides/trainer/1')
        side = lambda self: __import__('os').environ.get('MOLT_SIDE')  # noqa: E731 (a lambda travels by value)
        got = [ray.get(ray.get_actor(n, namespace=NAMESPACE).__ray_call__.remote(side), timeout=60) for n in names]
        frozen = [ray.get(ray.get_actor(n, namespace=NAMESPACE).__ray_call__.remote(FROZEN), timeout=60) for n in names]
    finally:
        run.kill()
    assert got == [None, 'rollout', 'rollout', 'trainer', 'trainer'], got
    # each process of the run moved what it had built out of the garbage collector's full passes (`settle_heap`):
    # the run's loop, the engines and the trainer ranks
    assert all(n > 10_000 for n in frozen), dict(zip(names, frozen))


def test_a_lone_trainer_settles_its_heap(ray_local):
    "A trainer actor without a group (cluster.trainer_ranks=1) freezes what it built too"
    import ray
    from molt_nb.loop import Trainer

    trainer = ray.remote(Trainer).options(num_cpus=0).remote(parity())
    try:
        assert ray.get(trainer.__ray_call__.remote(FROZEN), timeout=300) > 10_000
    finally:
        ray.kill(trainer)
