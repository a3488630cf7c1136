"""TorchEngine under load: the invariants hold while rows join, leave, queue and change weights."""

import asyncio, copy, math, random

import pytest
import torch

from molt_nb.core import SamplingParams, Segment, Trajectory, collate, token_logprobs
from molt_nb.decode import SlotCache
from molt_nb.engine import EngineDead, TorchEngine
from molt_nb.models import moe_gates, tiny_dense, tiny_moe

MODELS = {"dense": lambda: tiny_dense(), "moe": lambda: tiny_moe(dense_layers=(0,))}


def random_requests(n, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    sps = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.6, 1.0, 1.5]),
            top_k=rng.choice([-1, 3, 50]),
            top_p=rng.choice([1.0, 0.9, 0.5]),
            max_tokens=rng.randint(1, 48),
        )
        for _ in range(n)
    ]
    return prompts, sps


async def run_staggered(engine, prompts, sps, seed):
    "Submit with random gaps so rows join, leave and queue while others decode."
    rng, tasks = random.Random(seed), []
    for p, sp in zip(prompts, sps):
        tasks.append(asyncio.create_task(engine.generate(p, sp)))
        if rng.random() < 0.5:
            await asyncio.sleep(rng.random() * 0.01)
    return await asyncio.gather(*tasks)


async def sampled(engine, n, timeout_s=60):
    "Wait until the engine has sampled `n` tokens; a stalled engine fails the test after `timeout_s`, never hangs it."

    async def poll():
        while engine.stats["tokens"] < n:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


def full_forward(model, prompt, gen):
    "Logits and top-k routes of one full forward over prompt + sampled tokens."
    routes = {}
    hooks = [
        g.register_forward_hook(lambda m, i, o, l=l: routes.__setitem__(l, o[2])) for l, g in moe_gates(model).items()
    ]
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt), gen.token_ids])[None]).logits[0]
    for h in hooks:
        h.remove()
    return logits, routes


@pytest.mark.parametrize("kind", MODELS)
def test_logprobs_and_routes_match_a_full_forward(kind):
    model = MODELS[kind]()
    engine = TorchEngine(copy.deepcopy(model), max_batch=8, seed=1)  # a small batch forces queueing
    prompts, sps = random_requests(40, seed=2)
    gens = asyncio.run(run_staggered(engine, prompts, sps, seed=3))
    engine.close()
    assert engine.stats["prefills"] > 5
    for p, g, sp in zip(prompts, gens, sps):
        assert g.finish_reason == "length" and len(g) == sp.max_tokens
        logits, routes = full_forward(model, p, g)
        want = token_logprobs(logits[len(p) - 1 : -1], g.token_ids, sp.temperature, sp.top_k, sp.top_p)
        torch.testing.assert_close(g.logprobs, want, atol=1e-5, rtol=0)
        if sp.temperature == 0:
            assert (g.token_ids == logits[len(p) - 1 : -1].argmax(-1)).all()
        if kind == "moe":
            assert g.routes.shape == (len(p) + len(g), 2, 2)
            assert (g.routes[:, 0] == -1).all() and (g.routes[-1] == -1).all()  # dense layer 0; last token never fed
            assert torch.equal(g.routes[:-1, 1], routes[1][:-1].to(torch.int16))
        else:
            assert g.routes is None


def test_collated_batch_scores_the_sampled_tokens():
    "Engine output through the contract: batch.logprobs[t] is the logprob of input_ids[t+1]."
    model = tiny_dense()
    engine = TorchEngine(copy.deepcopy(model), seed=0)
    prompts, _ = random_requests(6, seed=5)
    sp = SamplingParams(max_tokens=10)
    gens = asyncio.run(run_staggered(engine, prompts, [sp] * 6, seed=6))
    engine.close()
    segs = [Segment.prompt(p).extend(g.token_ids, g.logprobs, g.versions) for p, g in zip(prompts, gens)]
    batch = collate([Trajectory(f"r{i}", "g", i, [s]) for i, s in enumerate(segs)], vocab_size=model.config.vocab_size)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask.long()).logits[:, :-1]
    recomputed = token_logprobs(logits, batch.input_ids[:, 1:])
    assert batch.action_mask.sum() == 60
    torch.testing.assert_close(recomputed[batch.action_mask], batch.logprobs[batch.action_mask], atol=1e-5, rtol=0)


def test_many_requests_in_flight_across_a_weight_load():
    "Every in-flight request completes; its versions switch once, at the step the load landed."
    model = tiny_dense()
    engine = TorchEngine(copy.deepcopy(model), max_batch=6, seed=0)
    V = model.config.vocab_size
    flat = {k: v.clone() for k, v in model.state_dict().items()}
    flat["model.norm.weight"].zero_()  # every logit 0: logprob exactly -log V afterwards

    async def go():
        tasks = [asyncio.create_task(engine.generate([1, 2, 3 + i], SamplingParams(max_tokens=60))) for i in range(10)]
        await sampled(engine, 30)
        await engine.pause()
        await engine.load_weights(flat, version=7)
        await engine.resume()
        return await asyncio.gather(*tasks)

    gens = asyncio.run(go())
    engine.close()
    assert any((g.versions == 0).any() and (g.versions == 7).any() for g in gens)  # some straddle the load
    assert any((g.versions == 7).all() for g in gens)  # queued ones start after it
    for g in gens:
        assert len(g) == 60
        switch = int((g.versions == 0).sum())
        assert torch.equal(g.versions[switch:], torch.full((60 - switch,), 7, dtype=torch.int32))
        torch.testing.assert_close(g.logprobs[switch:], torch.full((60 - switch,), -math.log(V)), atol=1e-5, rtol=0)


def test_bf16_engine_disagrees_measurably_with_fp32():
    "A bf16 rollout engine against an fp32 trainer: the mismatch is real and small."
    model = tiny_dense()
    engine = TorchEngine(copy.deepcopy(model), dtype=torch.bfloat16, seed=0)
    prompts, _ = random_requests(8, seed=9)
    gens = asyncio.run(run_staggered(engine, prompts, [SamplingParams(max_tokens=16)] * 8, seed=1))
    engine.close()
    gap = torch.cat(
        [
            (token_logprobs(full_forward(model, p, g)[0][len(p) - 1 : -1], g.token_ids) - g.logprobs).abs()
            for p, g in zip(prompts, gens)
        ]
    )
    assert 1e-5 < gap.max() < 0.5


def test_close_finishes_queued_requests_as_aborted():
    engine = TorchEngine(tiny_dense(), seed=0)

    async def go():
        await engine.pause()
        task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_tokens=5)))
        await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, engine.close)
        return await task

    gen = asyncio.run(go())
    assert gen.finish_reason == "abort" and len(gen) == 0


def test_a_failing_admit_fails_only_its_request():
    "A prefill that raises for one prompt fails that request only; running rows and its batch-mates finish."
    engine = TorchEngine(tiny_dense(), seed=0)
    bad, real, prefills = [7, 7, 7, 7, 7], engine._forward, []

    def forward(ids, pos, mask, cache, *vision):  # an OOM, say, in any prefill (a fresh cache) holding the bad prompt
        if cache.length == 0:
            prefills.append(len(ids))
        if cache.length == 0 and any(row[-5:].tolist() == bad for row in ids):
            raise MemoryError("simulated OOM")
        return real(ids, pos, mask, cache, *vision)

    engine._forward = forward

    async def go():
        long, short = SamplingParams(max_tokens=200), SamplingParams(max_tokens=10)
        running = [asyncio.create_task(engine.generate([1, 2, 3 + i], long)) for i in range(3)]
        await sampled(engine, 6)
        await engine.pause()  # queue three requests while paused, so they are admitted as one batch
        assert len(engine._reqs) == 3, "the running rows ended before the pause: the test would check nothing"
        late = [asyncio.create_task(engine.generate(p, short)) for p in ([4, 5], bad, [6])]
        await asyncio.sleep(0.02)
        await engine.resume()
        out = await asyncio.gather(*running, *late, return_exceptions=True)
        return out, late[1].exception()  # None had the error come back as a result, not raised

    out, raised = asyncio.run(go())
    engine.close()
    assert isinstance(raised, MemoryError) and out[4] is raised, (raised, out[4])
    assert [len(g) for i, g in enumerate(out) if i != 4] == [200, 200, 200, 10, 10]
    assert prefills[-4:] == [3, 1, 1, 1]  # the late batch, then its requests one by one


def test_admission_joins_the_running_batch_once():
    "Newcomers in several prefill groups are merged with each other, then with the running rows once."
    engine = TorchEngine(tiny_dense(), seed=0)
    merges, real = [], SlotCache.merge

    def merge(a, b, headroom=0):
        merges.append(len(a))
        return real(a, b, headroom)

    async def go():
        long = SamplingParams(max_tokens=300)
        running = [asyncio.create_task(engine.generate([1, 2, 3 + i], long)) for i in range(8)]
        await sampled(engine, 16)
        await engine.pause()  # three newcomers, one per length bucket: three prefills
        late = [asyncio.create_task(engine.generate([5] * n, SamplingParams(max_tokens=4))) for n in (3, 100, 300)]
        await asyncio.sleep(0.02)
        SlotCache.merge = merge
        try:
            await engine.resume()
            return await asyncio.gather(*running, *late)
        finally:
            SlotCache.merge = real

    gens = asyncio.run(go())
    engine.close()
    assert [len(g) for g in gens] == [300] * 8 + [4] * 3
    assert sum(n >= 8 for n in merges) == 1, merges  # the running cache was copied once, not once per prefill


def test_weights_loaded_in_parts_refill_once_and_a_failing_refill_fails_only_its_rows():
    "Rows held across a load are re-prefilled once, before they next decode; a refill group that raises fails alone."
    model = tiny_dense()
    engine = TorchEngine(copy.deepcopy(model), seed=0)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    refills, real = [], engine._prefill

    def prefill(seqs, reqs):
        if engine.version == 1:  # the refill: the only prefill after the load
            refills.append([len(s) for s in seqs])
            if max(len(s) for s in seqs) > 150:
                raise MemoryError("simulated OOM in the refill of the long row")
        return real(seqs, reqs)

    engine._prefill = prefill

    async def go():
        sp = SamplingParams(max_tokens=60)
        tasks = [asyncio.create_task(engine.generate(p, sp)) for p in ([1, 2, 3], [4] * 200)]
        await sampled(engine, 10)
        await engine.pause()
        items = list(new.items())
        await engine.load_weights(items[: len(items) // 2], version=1)  # a sync in two parts ...
        await engine.load_weights(items[len(items) // 2 :], version=1)
        await engine.resume()  # ... refills once
        return await asyncio.gather(*tasks, return_exceptions=True)

    short, long = asyncio.run(go())
    engine.close()
    assert isinstance(long, MemoryError) and len(short) == 60, (short, long)
    assert len(refills) == 2 and sorted(len(r) for r in refills) == [1, 1], refills  # one refill: two length groups
    model.load_state_dict(new)
    logits = full_forward(model, [1, 2, 3], short)[0][2:-1]
    after = short.versions == 1
    want = token_logprobs(logits, short.token_ids)
    torch.testing.assert_close(short.logprobs[after], want[after], atol=1e-5, rtol=0)


def test_an_error_outside_the_guarded_sections_fails_the_engine_loudly(monkeypatch):
    """An OOM in the refill's tail (held rows re-prefilled after a load) fails the held and queued requests with the
    cause; every later call raises the engine's death at once (no wait on a thread that is gone); the thread ends."""
    engine = TorchEngine(tiny_dense(), seed=0)
    nonce = engine._nonce
    params = {k: v + 0.01 for k, v in engine.model.state_dict().items()}
    real, armed = SlotCache.reserve, []

    def reserve(cache, columns):  # the first reservation once armed: the refill's, after its prefills
        if armed:
            armed.clear()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(cache, columns)

    monkeypatch.setattr(SlotCache, "reserve", reserve)

    async def go():
        held = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_tokens=200)))
        await sampled(engine, 5)
        await asyncio.wait_for(engine.pause(keep=True), 5)
        queued = asyncio.create_task(engine.generate([4, 5], SamplingParams(max_tokens=5)))
        await asyncio.wait_for(engine.load_weights(params, 1), 5)
        armed.append(True)
        await asyncio.wait_for(engine.resume(), 5)
        out = await asyncio.wait_for(asyncio.gather(held, queued, return_exceptions=True), 2)
        later = [engine.pause(), engine.generate([6], SamplingParams(max_tokens=2)), engine.load_weights(params, 2)]
        later = [await asyncio.wait_for(asyncio.gather(c, return_exceptions=True), 0.5) for c in later]
        return out + [x for (x,) in later]

    out = asyncio.run(go())
    engine._thread.join(2)
    assert not engine._thread.is_alive() and not armed, "the thread is still running, or the fault never fired"
    assert all(isinstance(e, EngineDead) for e in out), out
    for e in out:  # the cause, by type and message, and which engine
        assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in str(e), str(e)
        assert f"TorchEngine (nonce {nonce}, version 1" in str(e), str(e)
    assert isinstance(out[0].__cause__, torch.OutOfMemoryError) and str(engine.error) == str(out[0])
    engine.close()  # closes at once, and gives its nonce back: the next engine built takes it
    again = TorchEngine(tiny_dense(), seed=0)
    taken = again._nonce
    again.close()
    assert taken == nonce, (taken, nonce)
