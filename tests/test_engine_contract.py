"""The Engine contract over every engine CI can run: `TorchEngine`, and `VLLMEngine` on the stand-in for vLLM.

Also: every `vllm.SamplingParams` field is sent, the vLLM refusals say what to do, and no module imports vLLM or
NeMo AutoModel unless asked to (real vLLM runs the same contract in `make test-vllm`).
"""

import asyncio, importlib, pkgutil, subprocess, sys
from pathlib import Path

import pytest

import engine_contract as contract
import fake_vllm
import molt_nb
from molt_nb.core import SamplingParams
from molt_nb.engine import TorchEngine
from molt_nb.models import save_policy

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def dense(tmp_path_factory):
    return contract.policy(root=tmp_path_factory.mktemp('dense'))


@pytest.fixture(scope='module')
def moe(tmp_path_factory):
    return contract.policy(moe=True, root=tmp_path_factory.mktemp('moe'), dense_layers=(1,), num_layers=3)


@pytest.fixture
def stub(monkeypatch):
    for name, module in fake_vllm.modules().items():
        monkeypatch.setitem(sys.modules, name, module)


def start(kind: str, p: contract.Policy, **kw):
    "An engine of `kind` serving `p` (call inside the loop that will use it)"
    if kind == 'torch':
        model, _ = contract.load_policy(p.path)
        return TorchEngine(model, max_batch=64)
    from molt_nb.vllm_engine import engine_args

    return fake_vllm.start(engine_args(str(p.path), dtype='float32', seed=0, routes=p.moe), **kw)


def run(kind: str, p: contract.Policy, check, *args):
    async def go():
        engine = start(kind, p)
        try:
            return await check(engine, p, *args)
        finally:
            engine.close()

    return asyncio.run(go())


KINDS = ['torch', 'vllm-fake']
CHECKS = [
    contract.logprobs_match_a_recompute,
    contract.stops_at_a_stop_id,
    contract.keep_holds_requests_until_resume,
    contract.abort_ends_running_requests,
    contract.bad_prompts_fail_with_a_fix,
]


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('check', CHECKS, ids=lambda c: c.__name__)
def test_contract(kind, check, dense, stub):
    run(kind, dense, check)


@pytest.mark.parametrize('kind', KINDS)
def test_contract_versions_across_a_drain_sync(kind, dense, stub):
    run(kind, dense, contract.drain_then_load_keeps_versions_exact, contract.perturbed(dense))


@pytest.mark.parametrize('kind', KINDS)
def test_contract_routes(kind, moe, stub):
    out = run(kind, moe, contract.routes_cover_every_token)
    assert out['rows'] > 6


def test_vllm_broadcast_sync_equals_a_fresh_engine(dense, stub, tmp_path):
    new = contract.perturbed(dense)
    fresh_policy = contract.saved(dense, new, tmp_path / 'fresh')

    async def go():
        engine, fresh = start('vllm-fake', dense), start('vllm-fake', fresh_policy)
        try:
            out = await contract.broadcast_sync_equals_a_fresh_engine(engine, fresh, dense, new)
            await contract.logprobs_match_a_recompute(engine, fresh_policy)  # the new weights are the ones that sample
            return out
        finally:
            engine.close()
            fresh.close()

    out = asyncio.run(go())
    assert out['buckets'] > 1


def test_vllm_refuses_a_load_with_requests_in_flight(dense, stub):
    async def go():
        engine = start('vllm-fake', dense)
        try:
            running = asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_tokens=200)))
            await asyncio.sleep(0.02)
            with pytest.raises(RuntimeError, match=r'pause\(drain=True\) first'):
                await engine.load_weights(contract.perturbed(dense), 1)
            await running
        finally:
            engine.close()

    asyncio.run(go())


def test_every_sampling_field_is_sent(stub):
    "The stand-in's SamplingParams takes exactly the recorded fields and the engine sends every one of them"
    from molt_nb.vllm_engine import sampling_kwargs

    fields = set(fake_vllm.SAMPLING_FIELDS)
    assert len(fields) == 38 and 'watermarking' in fields and 'routed_experts_prompt_start' in fields
    sent = sampling_kwargs(SamplingParams(top_k=5, stop_token_ids=(3,)))
    assert set(sent) == fields, (fields - set(sent), set(sent) - fields)
    assert sent['ignore_eos'] and sent['logprobs'] == 0 and not sent['detokenize'] and sent['top_k'] == 5
    assert sampling_kwargs(SamplingParams(top_k=0))['top_k'] == -1


def test_engine_args_pin_what_exactness_needs():
    from molt_nb.vllm_engine import PINNED_ARGS, engine_args

    args = engine_args('/m', routes=True, tensor_parallel_size=2)
    assert {k: args[k] for k in PINNED_ARGS} == PINNED_ARGS and args['enable_return_routed_experts']
    # vLLM 0.33 refuses routed experts without the prefix cache (gpu-review D3); inside a placement group a TP engine
    # without 'mp' gets vLLM's Ray executor, which waits for GPUs the run holds (D4)
    assert args['enable_prefix_caching'] and args['distributed_executor_backend'] == 'mp'
    clashes = (dict(enable_prefix_caching=False), dict(logprobs_mode='raw_logprobs'))
    for clash in (*clashes, dict(distributed_executor_backend='ray')):
        with pytest.raises(ValueError, match='remove them'):
            engine_args('/m', tensor_parallel_size=2, extra=clash)
    with pytest.raises(ValueError, match='tensor_parallel_size from cluster.engine_gpus'):
        engine_args('/m', extra=dict(tensor_parallel_size=4))  # the router would lay the weight group out for 1


def test_without_vllm_the_engine_says_how_to_install_it():
    from molt_nb.vllm_engine import VLLMEngine, engine_args, import_vllm

    with pytest.raises(ImportError, match=r"constraints-gpu-vllm.txt -e '\.\[vllm\]'"):
        fake_vllm.absent(import_vllm)
    with pytest.raises(ImportError, match='make venv-vllm'):
        fake_vllm.absent(lambda: VLLMEngine.start(engine_args('/nonexistent')))


def test_every_module_imports_without_vllm_or_automodel():
    "A fresh interpreter where vLLM and NeMo AutoModel cannot be imported imports every molt_nb module"
    names = [m.name for m in pkgutil.iter_modules(molt_nb.__path__, 'molt_nb.')]
    code = (
        "import sys, importlib\n"
        "for m in ('vllm', 'nemo_automodel'): sys.modules[m] = None\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "assert 'vllm' not in [m for m in sys.modules if sys.modules[m] is not None and m.startswith('vllm')]\n"
        "print(len(" + repr(names) + "))\n"
    )
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip()) == len(names) > 20
    importlib.import_module('molt_nb.vllm_engine')  # and here, where the test process has none either


def test_vllm_takes_weights_bucket_by_bucket_then_drops_what_the_old_weights_computed(dense, stub):
    """One in-place reload across the buckets, each handed over as it is fetched (never the whole model at once); after
    it the prefix cache (and with it vLLM's stored routes), the multimodal and the encoder caches are reset, then the
    version label set (gpu-review D3, D13: none was reset after a load, so KV and routes computed by the old weights
    could be reused)"""
    from molt_nb.weight_sync import WeightSender

    async def go():
        engine = start('vllm-fake', dense)
        try:
            manifest = WeightSender('inprocess', bucket_mb=0.25).send(list(contract.perturbed(dense).items()), 1)
            await engine.pause(drain=True)
            engine.llm.calls.clear()
            await engine.take(manifest, 'inprocess')
            await engine.resume()
            rpcs = [c[1] for c in engine.llm.calls if c[0] == 'rpc']
            assert len(manifest.buckets) > 2
            assert rpcs == ['molt_begin', *['molt_bucket'] * len(manifest.buckets), 'molt_end'], rpcs
            after = [c for c in engine.llm.calls if c[0] not in ('rpc', 'resume')]
            assert after == [('reset_prefix_cache', True), ('reset_mm_cache',), ('reset_encoder_cache',)], after
            assert engine.llm.label == '1' and engine.version == 1
        finally:
            engine.close()

    asyncio.run(go())


def test_vllm_turns_a_request_refused_while_paused_into_an_abort(dense, stub):
    """vLLM 0.33 refuses a request that reaches it during an 'abort' or 'wait' pause with RetryableRequestError: the
    rollout must start again (the project's RolloutAborted), not count as a failed one (gpu-review D12)"""
    from molt_nb.agents import RolloutAborted

    async def go():
        engine = start('vllm-fake', dense)
        try:
            engine.llm.rejecting = True
            with pytest.raises(RolloutAborted, match='refused request .* while paused'):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=4))
            engine.llm.rejecting = False
            assert len(await engine.generate([1, 2, 3], SamplingParams(max_tokens=4))) == 4
        finally:
            engine.close()

    asyncio.run(go())


@pytest.mark.parametrize('mode', ['sync', 'async'])
def test_the_loop_runs_on_vllm_engines(mode, stub, tmp_path):
    """An in-process run with rollout.engine='vllm' (on the stand-in): every trained token is the engine's (debug
    identity), stamped with the version that sampled it, within the staleness bound"""
    from molt_nb.config import load_config
    from molt_nb.loop import Orchestrator, Trainer
    from molt_nb.store import RunStore

    cfg = load_config(
        ROOT / 'recipes' / 'parity',
        [
            'rollout.engine="vllm"',
            f'loop.mode="{mode}"',
            'loop.steps=3',
            'loop.seconds=120',  # a broken engine ends the run (RunStopped) instead of hanging the suite
            'loop.debug=true',
            'loop.max_staleness=1',
            'loop.eval_tasks=2',
            'rollout.groups_per_step=2',
            'rollout.n_samples=2',
            'rollout.groups_in_flight=4',
            'train.micro_batch_rows=4',
            f'run_dir="{tmp_path / "run"}"',
        ],
    )
    orch = Orchestrator(cfg, Trainer(cfg))
    assert type(orch.engine.engines[0].engine).__name__ == 'VLLMEngine'
    try:
        row = asyncio.run(orch.run())
    finally:
        orch.close()
    assert row['step'] == 3 and row['version'] == 3, row
    m = RunStore(cfg.run_dir).metrics().iloc[1:]
    assert (m.identity_checked == m['train/tokens']).all() and (m['train/tokens'] > 0).all()
    s = RunStore(cfg.run_dir).samples()
    ages = [step - 1 - v for step, vs in zip(s.step, s.versions) for v in vs]
    assert ages and min(ages) >= 0 and max(ages) <= (0 if mode == 'sync' else 1), sorted(set(ages))


def test_a_vision_checkpoint_gets_no_video_unless_asked_and_needs_its_processor(stub, tmp_path):
    "vLLM would reserve memory for videos the rollouts never send: video=0 is added to the recipe's own limits"
    from molt_nb.vision import image_processor, tiny_vl, vision_tokenizer
    from molt_nb.vllm_engine import engine_args

    tok = vision_tokenizer()
    save_policy(tiny_vl(tok, hidden=128, head_dim=64, heads=2, kv_heads=1, vision_hidden=64), tok, tmp_path)
    with pytest.raises(ValueError, match=r"without an image processor \(preprocessor_config.json\): save the"):
        fake_vllm.start(engine_args(str(tmp_path), dtype='float32'))
    image_processor().save_pretrained(tmp_path)

    def limits(**extra):
        engine = fake_vllm.start(engine_args(str(tmp_path), dtype='float32') | extra)
        try:
            return engine.llm.args['limit_mm_per_prompt']
        finally:
            engine.close()

    assert limits() == {'video': 0}
    assert limits(limit_mm_per_prompt={'image': 3}) == {'video': 0, 'image': 3}
    assert limits(limit_mm_per_prompt={'image': 1, 'video': 2}) == {'video': 2, 'image': 1}


def test_a_text_checkpoint_gets_no_multimodal_limits(dense, stub):
    from molt_nb.vllm_engine import engine_args

    engine = fake_vllm.start(engine_args(str(dense.path), dtype='float32'))
    try:
        assert 'limit_mm_per_prompt' not in engine.llm.args
    finally:
        engine.close()
