"""The router's bookkeeping of which engines have the run's weights, in one process (engines are plain objects)."""

import asyncio

import pytest

from molt_nb.router import Router
from molt_nb.weight_sync import Manifest


class Stub:
    "An engine that takes the weights it is sent; a broadcast needs a group, and engines in `dying` fail it"

    def __init__(self, slot: int, incarnation: int, dying: set):
        self.slot, self.incarnation, self.dying, self.version, self.group = slot, incarnation, dying, 0, None

    async def generate(self, *a, **kw):
        return self.slot, self.version

    async def take(self, manifest, kind):
        if kind == 'broadcast' and self.group is None:
            raise ValueError("'broadcast' takes a receiver rank of a group: this engine joined none")
        if (self.slot, self.incarnation) in self.dying:
            raise ConnectionResetError('the peer went away mid-broadcast')
        self.version = manifest.version

    async def join(self, host, port, rank, world_size, backend):
        self.group = (rank, world_size)

    async def stats(self):
        return dict(busy_s=0.0)

    def close(self):
        pass


async def trainer(name, *args):
    assert name == 'send_weights'
    return Manifest(version=args[1], buckets=())


def test_an_engine_revived_before_a_sync_loads_in_it_and_takes_requests_after():
    """A replacement has the run's initial weights: it takes no request until the next sync has loaded the run's into
    it (the loop revives right before it syncs)"""

    async def go():
        router = Router(lambda slot, inc: Stub(slot, inc, set()), 2, vocab_size=8, version=0)
        await router.sync_weights(trainer, 'inprocess', 3)
        router._dead(0, 0)
        await router.revive()
        assert router.ready == [False, True]
        assert [await router.generate([1]) for _ in range(3)] == [(1, 3)] * 3  # all to the engine with the weights
        await router.sync_weights(trainer, 'inprocess', 4)
        assert router.ready == [True, True] and [e.version for e in router.engines] == [4, 4]
        with pytest.raises(ValueError, match='versions only grow'):
            await router.sync_weights(trainer, 'inprocess', 4)

    asyncio.run(go())


def test_requests_wait_while_the_only_engine_is_a_replacement():
    "With one engine, a request sent while its replacement has no weights waits for them (it failed the rollout)"

    async def go():
        router = Router(lambda slot, inc: Stub(slot, inc, set()), 1, vocab_size=8, version=0)
        await router.sync_weights(trainer, 'inprocess', 3)
        router._dead(0, 0)
        await router.revive()
        request = asyncio.ensure_future(router.generate([1]))
        await asyncio.sleep(0.05)
        assert not request.done()
        await router.sync_weights(trainer, 'inprocess', 4)
        assert await asyncio.wait_for(request, 5) == (0, 4)

    asyncio.run(go())


def test_a_broadcast_an_engine_dies_in_runs_again_without_it_on_a_new_group():
    """Engine 0 dies during a broadcast: the others' waits fail, the group is broken (each side aborted its own), so the
    router builds one without the dead engine and broadcasts once more; the survivors load, the dead slot is revived by
    the loop's next sync"""

    async def go():
        dying = {(0, 0)}
        router = Router(lambda slot, inc: Stub(slot, inc, dying), 3, vocab_size=8, version=0)
        joins = []

        async def bcast_trainer(name, *args):
            if name == 'transport_address':
                return '127.0.0.1', 0
            if name == 'join_transport':
                joins.append(args[2])  # the world size of each group built
            if name == 'weight_manifest':
                return Manifest(version=args[0], buckets=())
            return None  # send_weights

        real_answers = router.answers

        async def answers(name, *args, members=None):
            try:
                return await real_answers(name, *args, members=members)
            except RuntimeError:
                router._dead(0, 0)  # as the next `stats` finds a dead actor
                raise

        router.answers = answers
        report = await router.broadcast(bcast_trainer, 3)
        assert joins == [4, 3]  # the trainer and 3 engines, then the trainer and the 2 that live
        assert router.group == ((1, 0), (2, 0))
        assert [e.version for e in router.engines] == [0, 3, 3] and report[0].version == 3

    asyncio.run(go())


def test_with_no_engine_live_the_waiting_requests_share_one_restore():
    """The lone engine died: requests do not fail ('all engines died') nor wait for a sync that needs a step; they wait
    while one restore (the loop's: revive, load the trainer's kept snapshot) brings a replacement, then run on it"""

    async def go():
        router = Router(lambda slot, inc: Stub(slot, inc, set()), 1, vocab_size=8, version=0)
        await router.sync_weights(trainer, 'inprocess', 3)
        restores = []

        async def restore():
            restores.append(await router.revive())
            await asyncio.sleep(0.05)  # an engine takes a while to start
            await router.sync_weights(trainer, 'inprocess', 3)  # the snapshot kept: the engines' version

        router.restore = restore
        router._dead(0, 0)
        got = await asyncio.wait_for(asyncio.gather(*[router.generate([1]) for _ in range(5)]), 5)
        assert got == [(0, 3)] * 5 and restores == [[0]] and router.counters['restarts'] == 1
        with pytest.raises(ValueError, match='versions only grow'):  # every live engine has it: nothing to load
            await router.sync_weights(trainer, 'inprocess', 3)

    asyncio.run(go())


def test_a_restore_that_fails_fails_every_waiting_request_and_is_not_retried():
    async def go():
        router = Router(lambda slot, inc: Stub(slot, inc, set()), 1, vocab_size=8, version=0)
        calls = []

        async def restore():
            calls.append(1)
            raise RuntimeError('no GPU left for a replacement')

        router.restore = restore
        router._dead(0, 0)
        got = await asyncio.gather(*[router.generate([1]) for _ in range(3)], return_exceptions=True)
        assert all('no GPU left' in str(e) for e in got), got
        with pytest.raises(RuntimeError, match='no GPU left'):
            await router.generate([1])
        assert calls == [1]

    asyncio.run(go())


def test_an_engine_whose_thread_died_is_replaced_and_named():
    """An engine in this process whose thread died raises `EngineDead`: the router takes it for a dead engine (the
    request is aborted to run again, the slot revived), and keeps why for the run's status"""
    from molt_nb.engine import EngineDead
    from molt_nb.router import EngineDied

    class Dying(Stub):
        async def generate(self, *a, **kw):
            if self.incarnation == 0:
                raise EngineDead('TorchEngine (nonce 0) died: its thread raised OutOfMemoryError: CUDA out of memory')
            return await super().generate(*a, **kw)

    async def go():
        router = Router(lambda slot, inc: Dying(slot, inc, set()), 1, vocab_size=8, version=0)
        await router.sync_weights(trainer, 'inprocess', 2)

        async def restore():
            await router.revive()
            await router.sync_weights(trainer, 'inprocess', 2)

        router.restore = restore
        with pytest.raises(EngineDied):
            await router.generate([1])
        assert router.alive == [False] and 'EngineDead: TorchEngine (nonce 0) died' in router.last_death
        assert await asyncio.wait_for(router.generate([1]), 5) == (0, 2)

    asyncio.run(go())


def test_a_restore_in_flight_is_counted_and_cancelled_when_the_router_closes():
    """`outages` is odd while a restore runs (a rollout that began then waited for the engines, not its agent) and
    even once it ended; closing the router cancels a restore in flight (it would start engines nothing ends)"""

    async def go():
        router = Router(lambda slot, inc: Stub(slot, inc, set()), 1, vocab_size=8, version=0)
        started = []

        async def restore():
            started.append(1)
            await asyncio.sleep(3600)  # an engine that takes long to start

        router.restore = restore
        router._dead(0, 0)
        waiting = asyncio.ensure_future(router.generate([1]))
        await asyncio.sleep(0.05)
        assert started == [1] and router.outages == 1 and not waiting.done()
        router.close()
        await asyncio.sleep(0.05)
        assert router.restoring.cancelled() and router.outages == 2
        waiting.cancel()

    asyncio.run(go())
