"""Probe 8: enable_return_routed_experts on CPU with a tiny Qwen3-MoE."""
import asyncio, time, traceback
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
import dataclasses
print("field exists:", "enable_return_routed_experts" in {f.name for f in dataclasses.fields(AsyncEngineArgs)})
async def main(flag):
    t = time.perf_counter()
    try:
        e = AsyncLLM.from_engine_args(AsyncEngineArgs(model="/tmp/vllm-probe/moe", dtype="float32", max_model_len=256, enforce_eager=True, enable_return_routed_experts=flag))
    except Exception as ex:
        print(f"flag={flag}: start failed after {time.perf_counter()-t:.1f}s:", type(ex).__name__, str(ex)[:400]); return
    print(f"flag={flag}: started {time.perf_counter()-t:.1f}s")
    async for o in e.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, temperature=0, logprobs=0), request_id="m"): pass
    c = o.outputs[0]; print("moe tokens", c.token_ids, "routed_experts", None if c.routed_experts is None else c.routed_experts.shape)
    e.shutdown()
if __name__ == "__main__":
    asyncio.run(main(True)); asyncio.run(main(False))
