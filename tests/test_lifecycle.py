"""The run's lifecycle seen from the kernel: no `Run` call waits forever, and a launch decides how the recipe travels
before it connects."""

import time

import pytest

from molt_nb import controller
from molt_nb.config import load_config
from molt_nb.controller import Run, launch

from test_loop import PARITY


def test_a_call_that_gets_no_answer_times_out_and_is_cancelled(ray_local):
    class Stuck:  # (defined here: Ray pickles it by value, and its workers cannot import this test module)
        "A run's actor that never answers a checkpoint, as a paused run did before (and a stuck one still would)"

        async def checkpoint(self):
            import asyncio

            await asyncio.sleep(3600)

        async def status(self):
            return dict(state='running')

    actor = ray_local.remote(Stuck).options(num_cpus=0).remote()
    run = Run('stuck', actor)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer checkpoint\(\) within 1 s"):
        run.checkpoint(timeout=1)
    assert time.monotonic() - start < 5
    assert run.status() == dict(state='running')  # the actor still answers: the cancelled request left it alone
    ray_local.kill(actor)


def test_launch_decides_upload_before_it_connects(monkeypatch, tmp_path):
    """With RAY_ADDRESS=ray://... and no connect() yet, the recipe travels ('upload'): it is not checked on this
    machine, nor are its local paths sent to a cluster elsewhere"""
    import ray

    checked, shipped = [], []
    monkeypatch.setenv('RAY_ADDRESS', 'ray://head.example:10001')
    monkeypatch.setattr(ray, 'is_initialized', lambda: False)
    monkeypatch.setattr(controller, 'check_recipe', lambda cfg: checked.append(cfg))

    def connect():
        raise ConnectionRefusedError('(no cluster in this test)')

    monkeypatch.setattr(controller, 'connect', connect)
    monkeypatch.setattr(controller, 'ship', lambda cfg, name, code, *args: shipped.append(code))
    cfg = load_config(PARITY, [f'run_dir="{tmp_path / "run"}"'])
    with pytest.raises(ConnectionRefusedError):
        launch(cfg)
    assert not checked and controller.default_code() == 'upload'


def test_a_restore_that_fails_after_reviving_ends_the_run_and_every_waiting_request(tmp_path):
    """The lone engine died, and its replacement crashes while it starts: the slot is dead again (not 'alive, without
    weights', which no sync would ever serve), and every request waiting on the restore ends the run at once"""
    import asyncio
    from molt_nb.loop import Orchestrator, Trainer
    from molt_nb.pool import RunStopped
    from molt_nb.router import EngineActor

    class Crashing:  # a replacement that dies as it starts
        def generate(self, *args):
            raise AssertionError('never asked')

        def stats(self):
            raise RuntimeError('CUDA error: an illegal memory access was encountered')

        def close(self):
            pass

    cfg = load_config(PARITY, [f'run_dir="{tmp_path / "run"}"'])
    make = lambda slot, incarnation: EngineActor(cfg) if incarnation == 0 else Crashing()  # noqa: E731
    orch = Orchestrator(cfg, Trainer(cfg), make_engine=make)

    async def go():
        orch.engine._dead(0, 0)
        waiting = await asyncio.gather(*[orch.engine.generate([1, 2, 3]) for _ in range(3)], return_exceptions=True)
        later = await asyncio.wait_for(asyncio.gather(orch.engine.generate([1]), return_exceptions=True), 1)
        return waiting + later

    try:
        out = asyncio.run(go())
    finally:
        orch.close()
    assert all(isinstance(e, RunStopped) and 'illegal memory access' in str(e) for e in out), out
    assert orch.engine.alive == [False] and orch.engine.counters['restarts'] == 1
