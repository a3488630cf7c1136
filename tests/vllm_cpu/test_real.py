"""The Engine contract through real vLLM (the `vllm-cpu` build on CPU), run by `make test-vllm` in its own virtualenv.

The same checks as `tests/test_engine_contract.py` runs in CI on the stand-in, here on one `AsyncLLM` (it takes
tens of seconds to start on CPU): token identity and logprobs against a trainer recompute, stop ids, the three pause
modes with requests in flight, versions across a drained sync, and a weight update through the worker extension
(`collective_rpc`, a gloo broadcast from a trainer rank) after which greedy turns equal those of an engine started
on the same weights. The figures go to `bench/out/vllm_cpu.json` and, by hand, to `bench/RESULTS.md`.
"""

import asyncio, json, time
from pathlib import Path

import pytest

pytest.importorskip('vllm.v1.engine.async_llm')  # not 'vllm': a directory of that name may be on sys.path
import vllm  # noqa: E402

import engine_contract as contract  # noqa: E402
from molt_nb.vllm_engine import VLLMEngine, engine_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def start(p: contract.Policy) -> VLLMEngine:
    return VLLMEngine.start(
        engine_args(
            str(p.path), dtype='float32', seed=0, max_batch=64, max_model_len=512, extra=dict(enforce_eager=True)
        )
    )


def test_contract_on_real_vllm(tmp_path):
    p = contract.policy(root=tmp_path)
    first, second = contract.perturbed(p, seed=1), contract.perturbed(p, seed=2)
    fresh_policy = contract.saved(p, second, tmp_path / 'fresh')

    async def go():
        figures, t = {}, time.perf_counter()
        engine = start(p)
        figures['start_s'] = round(time.perf_counter() - t, 1)
        fresh = None
        try:
            for check in (
                contract.logprobs_match_a_recompute,
                contract.stops_at_a_stop_id,
                contract.keep_holds_requests_until_resume,
                contract.abort_ends_running_requests,
                contract.bad_prompts_fail_with_a_fix,
            ):
                figures[check.__name__] = await check(engine, p)
            figures['drain'] = await contract.drain_then_load_keeps_versions_exact(engine, p, first)
            # the loaded weights are the ones that sample: the logprobs are a recompute's on them
            loaded = contract.Policy(p.path, contract.saved(p, first, tmp_path / 'first').model, False)
            figures['after_load'] = await contract.logprobs_match_a_recompute(engine, loaded)
            fresh = start(fresh_policy)
            figures['broadcast'] = await contract.broadcast_sync_equals_a_fresh_engine(engine, fresh, p, second)
            figures['after_broadcast'] = await contract.logprobs_match_a_recompute(engine, fresh_policy)
        finally:
            engine.close()
            if fresh is not None:
                fresh.close()
        return figures

    figures = asyncio.run(go())
    figures['vllm'] = vllm.__version__
    out = ROOT / 'bench/out'
    out.mkdir(parents=True, exist_ok=True)
    (out / 'vllm_cpu.json').write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
