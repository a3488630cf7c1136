"""The Engine contract: what every rollout engine must do, as async checks over a started engine.

`tests/test_engine_contract.py` runs them over `TorchEngine` and over `VLLMEngine` on the CI's stand-in for vLLM
(`fake_vllm`); `tests/vllm_cpu/test_real.py` runs them over real vLLM (`make test-vllm`). Each check takes an engine and
a `Policy` (the checkpoint it serves, and the same model in fp32 to recompute logprobs), and returns its figures.
"""

import asyncio, dataclasses, tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from molt_nb.core import SamplingParams
from molt_nb.models import build_tokenizer, load_policy, save_policy, tiny_dense, tiny_moe
from molt_nb.weight_sync import WeightSender, free_port, join_transport_group, named_weights


@dataclasses.dataclass
class Policy:
    "A saved checkpoint and the model in it"

    path: Path
    model: torch.nn.Module  # fp32, for recomputing logprobs
    moe: bool


def policy(moe: bool = False, root: Path | None = None, **shape) -> Policy:
    "A tiny policy saved as a checkpoint (head_dim 64: vLLM's CPU attention rejects 16)"
    tok = build_tokenizer()
    shape = dict(hidden_size=128, head_dim=64, num_heads=2, num_kv_heads=1, seed=0) | shape
    model = (tiny_moe(tok, **shape) if moe else tiny_dense(tok, **shape)).eval()
    path = Path(root or tempfile.mkdtemp()) / ('moe' if moe else 'dense')
    save_policy(model, tok, path)
    return Policy(path, model, moe)


def perturbed(p: Policy, scale: float = 0.05, seed: int = 1) -> dict:
    "New weights for `p`: each tensor moved by seeded noise"
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in named_weights(p.model)}


def saved(p: Policy, weights: dict, root: Path) -> Policy:
    "`p` with `weights`, saved as a checkpoint of its own"
    model, tok = load_policy(p.path)
    model.load_state_dict(weights, strict=False)
    save_policy(model, tok, root)
    return Policy(root, model, p.moe)


PROMPTS = [[1 + (7 * i + j) % 200 for j in range(3 + i % 5)] for i in range(8)]


@torch.no_grad()
def recompute(model, prompt: list, tokens: list, temperature: float) -> torch.Tensor:
    "Logprobs of `tokens` after `prompt` under `model`, at `temperature` (what the trainer computes)"
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return F.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


async def logprobs_match_a_recompute(engine, p: Policy, temperature: float = 0.8, tol: float = 1e-3) -> dict:
    "Sampled tokens are in the vocabulary, stamped with the engine's version, their logprobs the trainer's"
    sp = SamplingParams(temperature=temperature, max_tokens=12)
    gens = await asyncio.gather(*[engine.generate(q, sp) for q in PROMPTS])
    diffs = []
    for q, g in zip(PROMPTS, gens):
        assert g.finish_reason == 'length' and len(g) == 12 and g.prompt_len == len(q), g
        assert g.token_ids.dtype == torch.long and 0 <= int(g.token_ids.min()) and int(g.token_ids.max()) < 265
        assert g.logprobs.dtype == torch.float32 and g.versions.tolist() == [engine.version] * 12
        diffs.append((g.logprobs - recompute(p.model, q, g.token_ids.tolist(), temperature)).abs())
    d = torch.cat(diffs)
    assert d.max() < tol, f"max |dlogp| {d.max():.2e} against a recompute, above {tol}"
    return dict(max_dlogp=float(d.max()), mean_dlogp=float(d.mean()), tokens=len(d))


async def stops_at_a_stop_id(engine, p: Policy) -> dict:
    """Greedy is reproducible; a stop id ends the turn with finish 'stop', the stop token kept: with half the
    vocabulary as stop ids, every turn ends at its first token from that half"""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    a, b = [await engine.generate(PROMPTS[0], greedy) for _ in range(2)]
    assert a.token_ids.tolist() == b.token_ids.tolist(), (a.token_ids, b.token_ids)
    stops = tuple(range(0, 265, 2))
    sp = SamplingParams(temperature=1.0, max_tokens=64, stop_token_ids=stops)
    gens = await asyncio.gather(*[engine.generate(q, sp) for q in PROMPTS])
    for g in gens:
        ids = g.token_ids.tolist()
        assert all(t % 2 for t in ids[:-1]), ids  # no stop id before the last token
        assert (g.finish_reason, ids[-1] % 2) in (('stop', 0), ('length', 1)), (g.finish_reason, ids)
    assert sum(g.finish_reason == 'stop' for g in gens) >= 6
    return dict(lengths=[len(g) for g in gens])


async def drain_then_load_keeps_versions_exact(engine, p: Policy, new: dict) -> dict:
    """Requests running at a drain finish under the old version; one sent during the pause waits and runs under the
    new one; so does every later request"""
    v = engine.version
    sp = SamplingParams(temperature=1.0, max_tokens=24)
    running = [asyncio.ensure_future(engine.generate(q, sp)) for q in PROMPTS]
    await asyncio.sleep(0.05)
    await engine.pause(drain=True)
    assert all(t.done() for t in running), 'a drain returned with requests still running'
    late = asyncio.ensure_future(engine.generate(PROMPTS[1], sp))  # arrives while paused
    await asyncio.sleep(0.1)
    assert not late.done(), 'a request ran on a paused engine'
    await engine.load_weights(new, v + 1)
    await engine.resume()
    after = await engine.generate(PROMPTS[2], sp)
    olds = [t.result() for t in running]
    assert all(g.finish_reason == 'length' and set(g.versions.tolist()) == {v} for g in olds)
    assert set((await late).versions.tolist()) == {v + 1} and set(after.versions.tolist()) == {v + 1}
    return dict(version=v + 1)


async def paused_while_running(engine, keep: bool, max_tokens: int = 200) -> list:
    "Four requests of `max_tokens` started, then the engine paused 50 ms in (keep or abort); their tasks"
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    running = [asyncio.ensure_future(engine.generate(q, sp)) for q in PROMPTS[:4]]
    await asyncio.sleep(0.05)
    await engine.pause(keep=keep)
    return running


async def keep_holds_requests_until_resume(engine, p: Policy) -> dict:
    "pause(keep=True) holds running requests; after resume they finish in full"
    running = await paused_while_running(engine, keep=True)
    await asyncio.sleep(0.3)
    held = sum(not t.done() for t in running)
    assert held, 'pause(keep=True) held no request: all four had finished 200 tokens in 50 ms, or keep does nothing'
    await engine.resume()
    gens = await asyncio.gather(*running)
    assert all(g.finish_reason == 'length' and len(g) == 200 for g in gens)
    return dict(held=held)


async def abort_ends_running_requests(engine, p: Policy) -> dict:
    "pause(keep=False) ends running requests with finish 'abort'; the engine serves again after resume"
    running = await paused_while_running(engine, keep=False)
    gens = await asyncio.wait_for(asyncio.gather(*running), 30)
    await engine.resume()
    assert all(g.finish_reason in ('abort', 'length') for g in gens) and any(g.finish_reason == 'abort' for g in gens)
    assert all(len(g.logprobs) == len(g.token_ids) == len(g.versions) for g in gens)
    g = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=4))
    assert len(g) == 4
    return dict(aborted=sum(g.finish_reason == 'abort' for g in gens))


async def bad_prompts_fail_with_a_fix(engine, p: Policy) -> dict:
    "An empty or out-of-vocabulary prompt fails with the same message on every engine"
    for prompt, says in (([], 'token_ids is empty'), ([1, 10**6], 'must lie in [0, ')):
        try:
            await engine.generate(prompt, SamplingParams(max_tokens=2))
        except ValueError as e:
            assert says in str(e), e
        else:
            raise AssertionError(f'{prompt} was accepted')
    return {}


async def routes_cover_every_token(engine, p: Policy) -> dict:
    "MoE: routes are (P+N, layers, top_k), -1 on the last sampled token and on dense layers, experts elsewhere"
    g = await engine.generate(PROMPTS[3], SamplingParams(max_tokens=6))
    cfg = p.model.config
    assert g.routes is not None and tuple(g.routes.shape) == (
        g.prompt_len + 6,
        cfg.num_hidden_layers,
        cfg.num_experts_per_tok,
    ), g.routes
    dense = set(cfg.mlp_only_layers or ())
    for layer in range(cfg.num_hidden_layers):
        col = g.routes[:-1, layer]
        assert (col == -1).all() if layer in dense else ((0 <= col) & (col < cfg.num_experts)).all(), (layer, col)
    assert (g.routes[-1] == -1).all()
    return dict(rows=g.routes.shape[0])


async def broadcast_sync_equals_a_fresh_engine(engine, fresh, p: Policy, new: dict, backend: str = 'gloo') -> dict:
    """Weights broadcast over a transport group (the trainer's rank 0 here), each bucket loaded as it arrives into the
    paused engine, make the engine's greedy turns those of an engine started on the same weights"""
    v = engine.version + 1
    port, sender = free_port(), None
    joined = asyncio.ensure_future(engine.join('127.0.0.1', port, 1, 2, backend, 60))
    group = await asyncio.to_thread(join_transport_group, '127.0.0.1', port, 0, 2, backend, 60)
    await joined
    sender = WeightSender('broadcast', group, bucket_mb=0.25)  # several buckets
    items = list(new.items())
    manifest = sender.manifest(items, v)
    await engine.pause(drain=True)
    await asyncio.gather(engine.take(manifest, 'broadcast'), asyncio.to_thread(sender.send, items, v))
    await engine.resume()
    group.close()
    greedy = SamplingParams(temperature=0, max_tokens=10)
    mine = [await engine.generate(q, greedy) for q in PROMPTS]
    theirs = [await fresh.generate(q, greedy) for q in PROMPTS]
    assert [g.token_ids.tolist() for g in mine] == [g.token_ids.tolist() for g in theirs]
    gap = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(mine, theirs))
    assert gap < 1e-5, f"the synced engine's greedy logprobs are {gap:.2e} from a fresh engine's on the same weights"
    return dict(buckets=len(manifest.buckets), version=v, greedy_logprob_gap=gap)
