"""Swap robustness at the step boundary, in one process and without Ray: a `RunOrchestrator` on the toy parity recipe with
a stub trainer (it records the swaps it is given) for the boundary's bookkeeping, and the real `RunTrainer` where the
trainer's own behaviour is what is tested."""

import asyncio, threading, time
from dataclasses import replace
from pathlib import Path
import cloudpickle, pytest, torch
from molt_nb.config import load_config
from molt_nb.controller import (
    RunOrchestrator,
    RunTrainer,
    Swap,
    _limited,
    _CheckTimeout,
    launch,
    make_swap,
    updated_config,
)
from molt_nb.estimators import rloo
from molt_nb.golden import _trajectories
from molt_nb.loop import RecipeError
from molt_nb.losses import POLICY_LOSSES, ppo_loss

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / 'recipes' / 'parity'
LIMIT_S = 120  # generous: a loaded 2-core machine is slow, and a hang must still end


def toy(tmp_path, *overrides):
    return load_config(PARITY, ['loop.eval_tasks=8', f'run_dir="{tmp_path}"', *overrides])


class StubTrainer:
    "Takes the swaps of each train step and reports `fail` (a list of failures) once"

    def __init__(self, fail=None):
        self.calls, self.backs, self.fail = [], [], fail

    def train_step(self, batch, swaps=()):
        self.calls.append([(s.kind, s.name) for s in swaps])
        fail, self.fail = self.fail, None
        return dict(failed=fail) if fail else dict(metrics={})

    def go_back(self, kind, key, back):
        self.backs.append((kind, key, back))


def queue(orch, s: Swap) -> Swap:
    "Queue `s` as an accepted swap, without its golden-batch check (which a function failing only in a run passes)"
    orch._take(s)
    orch.queued.append(s)
    return s


def config_swap(orch, fields: dict) -> Swap:
    new = updated_config(orch.cfg, fields)
    return Swap('config', ', '.join(fields), '', cloudpickle.dumps((new.algo, new.optim, fields)))


def broken(t, text):
    raise ValueError('no reward for this one')


async def until(orch, done, what: str):
    deadline = time.monotonic() + LIMIT_S
    while not done():
        assert orch.state != 'failed', f"the run failed while waiting for {what}: {orch.reason}"
        assert time.monotonic() < deadline, f"waited {LIMIT_S} s for {what}; the run is {orch.state}: {orch.reason}"
        await asyncio.sleep(0.02)


async def boundary_after_failure(orch, work: dict) -> dict:
    "Train the step at the boundary: it fails and pauses; then resume it. What the trainer returned, and the paused status"
    task = asyncio.ensure_future(orch._train_at_boundary(work))
    await until(orch, lambda: orch.state == 'paused' or task.done(), 'the failure to pause the run')
    assert orch.state == 'paused', 'the step trained without the failure it should have had'
    paused = await orch.status()
    await orch.unpause()
    await until(orch, task.done, 'the resumed step to train')
    return task.result(), paused


def running(cfg, trainer=None) -> RunOrchestrator:
    "An in-process orchestrator of `cfg` in the 'running' state, its trainer a `StubTrainer`"
    orch = RunOrchestrator(cfg, trainer or StubTrainer())
    orch.state = 'running'
    return orch


def next_boundary(orch: RunOrchestrator) -> asyncio.Future:
    "The orchestrator's next step boundary (swaps, rescoring, the trainer call) on the golden rollouts, as a task"
    return asyncio.ensure_future(orch._train_at_boundary(dict(trajectories=_trajectories(), batch=None)))


def test_failed_reward_swap_goes_back_to_env_reward_and_keeps_the_steps_other_swaps(tmp_path):
    """A reward swap failing in the step it arrives with, along with a config and an estimator swap: the run goes back
    to the environment's reward (not to the config swap, whose key is None like the reward's `replaces`), and the step
    is trained with the config and estimator swaps (which used to be dropped from the retry)"""

    async def main():
        orch = running(toy(tmp_path, 'loop.steps=1'))
        lr = queue(orch, config_swap(orch, {'optim.lr': 5e-4}))
        est = queue(orch, Swap('estimator', 'rloo', '', cloudpickle.dumps((rloo, False))))
        bad = queue(orch, make_swap('reward', broken))
        trs = _trajectories()
        out, paused = await boundary_after_failure(orch, dict(trajectories=trs, batch=None))
        assert out == dict(metrics={})
        assert "went back to the environment's reward" in paused['reason'], paused['reason']
        assert (orch.reward, orch.reward_fn) == (None, None)
        assert (bad.failed or '').startswith('step 1: ValueError: no reward'), bad.failed
        assert lr.failed is None and est.failed is None
        assert orch.trainer.calls == [[('config', 'optim.lr'), ('estimator', 'rloo')]]
        assert orch.failed_swap is None and orch.state == 'running'
        assert [t.reward for t in trs] == [t.reward for t in _trajectories()]  # the environment's rewards

    asyncio.run(main())


def test_every_install_failure_goes_back(tmp_path):
    """Two estimator swaps the trainer cannot install in one step: the real `RunTrainer` reports both, and the run goes
    back from each (the first failure used to be the only one reported)"""
    cfg = toy(tmp_path, 'loop.steps=1')
    a, b = (Swap('estimator', n, '', b'not a pickle', key=f"swap/{n}") for n in ('a', 'b'))
    out = RunTrainer(cfg).train_step(None, [a, b])  # installs fail before the batch is read
    assert [(f['kind'], f['key']) for f in out['failed']] == [('estimator', 'swap/a'), ('estimator', 'swap/b')], out

    async def main():
        orch = running(cfg, StubTrainer(fail=out['failed']))
        for s in (Swap('estimator', n, '', cloudpickle.dumps((rloo, False))) for n in ('a', 'b')):
            queue(orch, s)
        _, paused = await boundary_after_failure(orch, dict(batch=None))
        assert paused['failed_swap'] == "estimator 'a', estimator 'b'", paused
        assert [s.failed is not None for s in orch.swaps] == [True, True]
        assert orch.cfg.algo.estimator == 'grpo'
        # b replaced a, which failed too: both go back to grpo
        assert orch.trainer.backs == [('estimator', 'swap/a', 'grpo'), ('estimator', 'swap/b', 'grpo')]

    asyncio.run(main())


def test_swap_refused_when_the_run_ended_during_its_check(tmp_path):
    "A swap whose check was running when the run ended is refused, not queued into a run that will never take it"

    async def main():
        orch = running(toy(tmp_path, 'loop.steps=1'))

        def slow(x):
            time.sleep(0.2)
            return rloo(x)

        check = asyncio.ensure_future(orch.swap(make_swap('estimator', slow), timeout=60))
        await asyncio.sleep(0.1)
        orch.state = 'finished'  # the run ends while the check runs
        out = await check
        assert not out['accepted'] and 'is finished' in out['error'] and not orch.queued, out

    asyncio.run(main())


def slow_reward(t, text):
    time.sleep(0.5)
    return 1.0


def test_hanging_reward_fails_within_the_time_limit_and_leaves_the_loop_free(tmp_path):
    """A swapped reward that takes too long on the batch fails like one that raises (the run goes back to the
    environment's reward), after rollout.timeout_s, and the event loop answers status() meanwhile"""

    async def main():
        orch = running(toy(tmp_path, 'loop.steps=1', 'rollout.timeout_s=1'))
        slow = queue(orch, make_swap('reward', slow_reward))
        task = next_boundary(orch)
        ticks, start = 0, time.monotonic()
        while orch.state != 'paused' and time.monotonic() - start < LIMIT_S:
            await orch.status()
            ticks += 1
            await asyncio.sleep(0.05)
        assert orch.state == 'paused' and 'ran past 1 s' in slow.failed, (orch.state, slow.failed)
        assert ticks >= 10, f"status() answered {ticks} times while the reward ran: the loop was blocked"
        await orch.stop()
        await until(orch, task.done, 'the stopped step to train')

    asyncio.run(main())


def test_stop_during_a_failure_pause_says_stopping(tmp_path):
    "stop() while a failed swap holds the run paused: the status no longer says it is paused nor names the failed swap"

    async def main():
        orch = running(toy(tmp_path, 'loop.steps=1'))
        queue(orch, make_swap('reward', broken))
        task = next_boundary(orch)
        await until(orch, lambda: orch.state == 'paused', 'the failure to pause the run')
        st = await orch.stop()
        assert st['failed_swap'] is None and 'paused' not in st['reason'] and 'stop()' in st['reason'], st
        await until(orch, task.done, 'the stopped step to train')

    asyncio.run(main())


def nan_gradient(logp, old, adv, mask, cfg):
    return (logp - logp.detach()).clamp(min=0).sqrt()  # 0, its gradient infinite


class Broken(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError('no backward here')


def bad_backward(logp, old, adv, mask, cfg):
    return Broken.apply(ppo_loss(logp, old, adv, mask, cfg))


def test_nonfinite_gradient_costs_the_update_not_the_run(tmp_path):
    """A built-in loss with a non-finite gradient: the step skips its update, counts it in train/nonfinite_steps, and the
    run goes on to finish. A swapped loss doing the same (or whose backward pass raises) is suspected: the run goes back
    to the loss it replaced and pauses, as for a swap that raises"""
    POLICY_LOSSES['test/nan_gradient'] = nan_gradient
    try:
        cfg = toy(tmp_path / 'builtin', 'loop.steps=2')
        cfg = replace(cfg, algo=replace(cfg.algo, loss=replace(cfg.algo.loss, policy_loss='test/nan_gradient')))

        async def builtin():
            orch = RunOrchestrator(cfg, RunTrainer(cfg))
            before = [p.detach().clone() for p in orch.trainer.actor.model.parameters()]
            await orch.start()
            await until(orch, orch.task.done, 'the run to end')
            assert orch.state == 'finished', orch.reason
            m = await orch.metrics()
            assert m.loc[m.step > 0, 'train/nonfinite_steps'].tolist() == [1.0, 1.0]
            assert all(torch.equal(b, p) for b, p in zip(before, orch.trainer.actor.model.parameters()))

        asyncio.run(builtin())
    finally:
        POLICY_LOSSES.pop('test/nan_gradient')
    cfg = toy(tmp_path / 'swapped', 'loop.steps=1')

    async def swapped():
        orch = RunOrchestrator(cfg, RunTrainer(cfg))
        await orch.pause(after=0)
        await orch.start()
        await until(orch, lambda: orch.state == 'paused', 'the run to pause before step 1')
        for fn, says in (
            (nan_gradient, 'suspected of it, as the swapped loss in use: FloatingPointError'),
            (bad_backward, "suspected of it, as the swapped loss in use: BackwardError"),
        ):
            queue(orch, make_swap('loss', fn))
            await orch.unpause()
            await until(orch, lambda: orch.failed_swap == f"loss {fn.__name__!r}", f"{fn.__name__} to fail")
            assert says in orch.reason and "back to 'ppo'" in orch.reason, orch.reason
            assert orch.trainer.actor.algo.loss.policy_loss == 'ppo' and orch.trainer.actor.version == 0
        await orch.unpause()
        await until(orch, orch.task.done, 'the run to end')
        assert orch.state == 'finished', orch.reason

    asyncio.run(swapped())


def test_launch_names_a_broken_recipe_before_ray(tmp_path):
    "launch() of a recipe whose Env.reset returns a list raises the recipe check's error before Ray is touched"
    ray = pytest.importorskip('ray')
    d = tmp_path / 'reset_list'
    d.mkdir()
    (d / 'recipe.toml').write_text((PARITY / 'recipe.toml').read_text())
    src = (PARITY / 'agent.py').read_text()
    assert "return task['prompt']" in src
    (d / 'agent.py').write_text(src.replace("return task['prompt']", "return [task['prompt']]"))
    cfg = load_config(d, [f'run_dir="{tmp_path / "run"}"'])
    start, connected = time.monotonic(), ray.is_initialized()  # an earlier test of the session may have connected
    with pytest.raises(RecipeError, match='reset returned a list'):
        launch(cfg, name='broken-recipe')
    assert ray.is_initialized() == connected, 'launch connected to Ray before checking the recipe'
    if connected:
        assert 'broken-recipe' not in [a['name'] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert time.monotonic() - start < 30
