"""Swap robustness at the step boundary, in one process and without Ray: a `RunActor` on the toy parity recipe with
a stub trainer (it records the swaps it is given) for the steering's bookkeeping, and the real `Trainer` where the
trainer's own behaviour is what is tested."""

import asyncio, time
from dataclasses import replace
from pathlib import Path
import cloudpickle, pytest, torch
from molt_nb.config import load_config
from molt_nb.controller import launch
from molt_nb.estimators import rloo
from molt_nb.golden import golden_trajectories
from molt_nb.loop import Collected, StepOutput, Trainer
from molt_nb.losses import POLICY_LOSSES, ppo_loss
from molt_nb.recipe import RecipeError
from molt_nb.steering import RunActor
from molt_nb.swaps import Swap, make_swap, updated_config

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / 'recipes' / 'parity'
LIMIT_S = 120  # generous: a loaded 2-core machine is slow, and a hang must still end


def toy(tmp_path, *overrides):
    return load_config(PARITY, ['loop.eval_tasks=8', f'run_dir="{tmp_path}"', *overrides])


class StubTrainer:
    "Takes the swaps of each train step and reports `fail` (a list of `SwapFailed`) once"

    def __init__(self, fail=None):
        self.calls, self.backs, self.fail = [], [], fail

    def train_step(self, batch, swaps=()):
        self.calls.append([(s.kind, s.name) for s in swaps])
        fail, self.fail = self.fail, None
        return StepOutput(failed=fail) if fail else StepOutput()

    def go_back(self, kind, key, back):
        self.backs.append((kind, key, back))


def queue(run, s: Swap) -> Swap:
    "Queue `s` as an accepted swap, without its golden-batch check (which a function failing only in a run passes)"
    run.steering._take(s)
    run.steering.queued.append(s)
    return s


def config_swap(run, fields: dict) -> Swap:
    new = updated_config(run.orchestrator.cfg, fields)
    return Swap('config', ', '.join(fields), '', cloudpickle.dumps((new.algo, new.optim, fields)))


def broken(t, text):
    raise ValueError('no reward for this one')


async def until(run, done, what: str):
    deadline = time.monotonic() + LIMIT_S
    s = run.steering
    while not done():
        assert s.state != 'failed', f"the run failed while waiting for {what}: {s.reason}"
        assert time.monotonic() < deadline, f"waited {LIMIT_S} s for {what}; the run is {s.state}: {s.reason}"
        await asyncio.sleep(0.02)


def boundary(run, trajectories=None) -> asyncio.Future:
    "The run's next step boundary (swaps, rescoring, the trainer call) on `trajectories` (the golden ones), as a task"
    work = Collected(golden_trajectories() if trajectories is None else trajectories, None, 0, 0, 0.0)

    def train_step(batch, swaps):
        return run.orchestrator.call('train_step', batch, swaps)

    return asyncio.ensure_future(run.steering.train(1, work, train_step))


async def boundary_after_failure(run, trajectories=None) -> tuple:
    """Train the step at the boundary: it fails and pauses; then resume it. What the trainer returned, and the paused
    status"""
    task = boundary(run, trajectories)
    await until(run, lambda: run.steering.state == 'paused' or task.done(), 'the failure to pause the run')
    assert run.steering.state == 'paused', 'the step trained without the failure it should have had'
    paused = await run.status()
    await run.resume()
    await until(run, task.done, 'the resumed step to train')
    return task.result(), paused


def running(cfg, trainer=None) -> RunActor:
    "An in-process run of `cfg` in the 'running' state, its trainer a `StubTrainer`"
    run = RunActor(cfg, trainer=trainer or StubTrainer())
    run.steering.state = 'running'
    return run


def test_failed_reward_swap_goes_back_to_env_reward_and_keeps_the_steps_other_swaps(tmp_path):
    """A reward swap failing in the step it arrives with, along with a config and an estimator swap: the run goes back
    to the environment's reward (not to the config swap, whose key is None like the reward's `replaces`), and the step
    is trained with the config and estimator swaps (which used to be dropped from the retry)"""

    async def main():
        run = running(toy(tmp_path, 'loop.steps=1'))
        lr = queue(run, config_swap(run, {'optim.lr': 5e-4}))
        est = queue(run, Swap('estimator', 'rloo', '', cloudpickle.dumps((rloo, False))))
        bad = queue(run, make_swap('reward', broken))
        trs = golden_trajectories()
        out, paused = await boundary_after_failure(run, trs)
        assert out == StepOutput()
        assert "went back to the environment's reward" in paused['reason'], paused['reason']
        assert (run.steering.reward, run.steering.reward_fn) == (None, None)
        assert (bad.failed or '').startswith('step 1: ValueError: no reward'), bad.failed
        assert lr.failed is None and est.failed is None
        assert run.orchestrator.trainer.calls == [[('config', 'optim.lr'), ('estimator', 'rloo')]]
        assert run.steering.failed_swap is None and run.steering.state == 'running'
        assert [t.reward for t in trs] == [t.reward for t in golden_trajectories()]  # the environment's rewards

    asyncio.run(main())


def test_every_install_failure_goes_back(tmp_path):
    """Two estimator swaps the trainer cannot install in one step: the real `Trainer` reports both, and the run goes
    back from each (the first failure used to be the only one reported)"""
    cfg = toy(tmp_path, 'loop.steps=1')
    a, b = (Swap('estimator', n, '', b'not a pickle', key=f"swap/{n}") for n in ('a', 'b'))
    out = Trainer(cfg).train_step(None, [a, b])  # installs fail before the batch is read
    assert [(f.kind, f.key) for f in out.failed] == [('estimator', 'swap/a'), ('estimator', 'swap/b')], out

    async def main():
        run = running(cfg, StubTrainer(fail=out.failed))
        for s in (Swap('estimator', n, '', cloudpickle.dumps((rloo, False))) for n in ('a', 'b')):
            queue(run, s)
        _, paused = await boundary_after_failure(run)
        assert paused['failed_swap'] == "estimator 'a', estimator 'b'", paused
        assert [s.failed is not None for s in run.steering.swaps] == [True, True]
        assert run.orchestrator.cfg.algo.estimator == 'grpo'
        # b replaced a, which failed too: both go back to grpo
        assert run.orchestrator.trainer.backs == [('estimator', 'swap/a', 'grpo'), ('estimator', 'swap/b', 'grpo')]

    asyncio.run(main())


def test_swap_refused_when_the_run_ended_during_its_check(tmp_path):
    "A swap whose check was running when the run ended is refused, not queued into a run that will never take it"

    async def main():
        run = running(toy(tmp_path, 'loop.steps=1'))

        def slow(x):
            time.sleep(0.2)
            return rloo(x)

        check = asyncio.ensure_future(run.swap(make_swap('estimator', slow), timeout=60))
        await asyncio.sleep(0.1)
        run.steering.state = 'finished'  # the run ends while the check runs
        out = await check
        assert not out['accepted'] and 'is finished' in out['error'] and not run.steering.queued, out

    asyncio.run(main())


def slow_reward(t, text):
    time.sleep(0.5)
    return 1.0


def test_hanging_reward_fails_within_the_time_limit_and_leaves_the_loop_free(tmp_path):
    """A swapped reward that takes too long on the batch fails like one that raises (the run goes back to the
    environment's reward), after rollout.timeout_s, and the event loop answers status() meanwhile"""

    async def main():
        run = running(toy(tmp_path, 'loop.steps=1', 'rollout.timeout_s=1'))
        slow = queue(run, make_swap('reward', slow_reward))
        task = boundary(run)
        ticks, start = 0, time.monotonic()
        while run.steering.state != 'paused' and time.monotonic() - start < LIMIT_S:
            await run.status()
            ticks += 1
            await asyncio.sleep(0.05)
        assert run.steering.state == 'paused' and 'ran past 1 s' in slow.failed, (run.steering.state, slow.failed)
        assert ticks >= 10, f"status() answered {ticks} times while the reward ran: the loop was blocked"
        await run.stop()
        await until(run, task.done, 'the stopped step to train')

    asyncio.run(main())


def test_stop_during_a_failure_pause_says_stopping(tmp_path):
    "stop() while a failed swap holds the run paused: the status no longer says it is paused nor names the failed swap"

    async def main():
        run = running(toy(tmp_path, 'loop.steps=1'))
        queue(run, make_swap('reward', broken))
        task = boundary(run)
        await until(run, lambda: run.steering.state == 'paused', 'the failure to pause the run')
        st = await run.stop()
        assert st['failed_swap'] is None and 'paused' not in st['reason'] and 'stop()' in st['reason'], st
        await until(run, task.done, 'the stopped step to train')

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
    """A built-in loss with a non-finite gradient: the step skips its update, counts it in train/nonfinite_steps, and
    the run goes on to finish. A swapped loss doing the same (or whose backward pass raises) is suspected: the run
    goes back to the loss it replaced and pauses, as for a swap that raises"""
    POLICY_LOSSES['test/nan_gradient'] = nan_gradient
    try:
        cfg = toy(tmp_path / 'builtin', 'loop.steps=2')
        cfg = replace(cfg, algo=replace(cfg.algo, loss=replace(cfg.algo.loss, policy_loss='test/nan_gradient')))

        async def builtin():
            run = RunActor(cfg, trainer=Trainer(cfg))
            before = [p.detach().clone() for p in run.orchestrator.trainer.actor.model.parameters()]
            await run.start()
            await until(run, run.task.done, 'the run to end')
            assert run.steering.state == 'finished', run.steering.reason
            m = await run.metrics()
            assert m.loc[m.step > 0, 'train/nonfinite_steps'].tolist() == [1.0, 1.0]
            assert all(torch.equal(b, p) for b, p in zip(before, run.orchestrator.trainer.actor.model.parameters()))

        asyncio.run(builtin())
    finally:
        POLICY_LOSSES.pop('test/nan_gradient')
    cfg = toy(tmp_path / 'swapped', 'loop.steps=1')

    async def swapped():
        run = RunActor(cfg, trainer=Trainer(cfg))
        await run.pause(after=0)
        await run.start()
        await until(run, lambda: run.steering.state == 'paused', 'the run to pause before step 1')
        for fn, says in (
            (nan_gradient, 'suspected of it, as the swapped loss in use: FloatingPointError'),
            (bad_backward, "suspected of it, as the swapped loss in use: BackwardError"),
        ):
            queue(run, make_swap('loss', fn))
            await run.resume()
            await until(run, lambda: run.steering.failed_swap == f"loss {fn.__name__!r}", f"{fn.__name__} to fail")
            assert says in run.steering.reason and "back to 'ppo'" in run.steering.reason, run.steering.reason
            assert (
                run.orchestrator.trainer.actor.algo.loss.policy_loss == 'ppo'
                and run.orchestrator.trainer.actor.version == 0
            )
        await run.resume()
        await until(run, run.task.done, 'the run to end')
        assert run.steering.state == 'finished', run.steering.reason

    asyncio.run(swapped())


def test_launch_names_a_broken_recipe_before_ray(tmp_path):
    "launch() of a recipe whose Env.reset returns a dict raises the recipe check's error before Ray is touched"
    ray = pytest.importorskip('ray')
    d = tmp_path / 'reset_list'
    d.mkdir()
    (d / 'recipe.toml').write_text((PARITY / 'recipe.toml').read_text())
    src = (PARITY / 'agent.py').read_text()
    assert "return task['prompt']" in src
    (d / 'agent.py').write_text(src.replace("return task['prompt']", "return {'text': task['prompt']}"))
    cfg = load_config(d, [f'run_dir="{tmp_path / "run"}"'])
    start, connected = time.monotonic(), ray.is_initialized()  # an earlier test of the session may have connected
    with pytest.raises(RecipeError, match='reset returned a dict'):
        launch(cfg, name='broken-recipe')
    assert ray.is_initialized() == connected, 'launch connected to Ray before checking the recipe'
    if connected:
        assert 'broken-recipe' not in [a['name'] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert time.monotonic() - start < 30
