"""The router's bookkeeping of who holds which weights, in one process (engines are plain objects here)."""

import asyncio

from molt_nb.router import Router
from molt_nb.weight_sync import Manifest


class Stub:
    "An engine that stages what it receives; slot 1's receive waits for `slow`"

    def __init__(self, slot: int, incarnation: int, slow: asyncio.Event):
        self.slot, self.incarnation, self.slow, self.staged = slot, incarnation, slow, set()

    async def generate(self, *a, **kw):
        raise AssertionError('not used')

    async def receive(self, manifest, kind):
        if self.slot == 1:
            await self.slow.wait()
        self.staged.add(manifest.version)

    async def stats(self):
        return dict(busy_s=0.0)


def test_an_engine_revived_during_a_fetch_still_needs_the_weights():
    """Engine 0 receives, dies and is replaced while engine 1 is still receiving: the replacement has nothing staged,
    so the router must count it missing (it counted the slot as served, and the next load failed: 'no staged
    weights of version 3')"""

    async def go():
        slow = asyncio.Event()
        router = Router(lambda slot, inc: Stub(slot, inc, slow), 2, vocab_size=8, version=0)

        async def trainer(name, *args):
            assert name == 'send_weights'
            return Manifest(version=3, buckets=())

        fetch = asyncio.ensure_future(router.fetch(trainer, 'inprocess', 3))
        await asyncio.sleep(0.01)  # engine 0 has staged version 3; engine 1 is still receiving
        assert router.engines[0].staged == {3} and not fetch.done()
        router._dead(0, 0)  # engine 0's process dies (the pool's next call finds it) ...
        await router.revive()  # ... and the loop's next sync replaces it before the fetch has returned
        assert router.incarnation[0] == 1 and router.engines[0].staged == set()
        slow.set()
        await fetch
        assert router.missing(3) == [0]  # the replacement must fetch version 3 before the load

    asyncio.run(go())
