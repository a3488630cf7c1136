"""Probe 1: construct AsyncLLM in-process, generate with token ids, inspect outputs, output_kind, timings."""
import asyncio, os, time, json, multiprocessing, threading
T0 = time.perf_counter()
from vllm import SamplingParams, TokensPrompt
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.sampling_params import RequestOutputKind
print("import s", round(time.perf_counter() - T0, 1))
MODEL = "/tmp/vllm-probe/dense"

async def collect(engine, prompt, sp, rid):
    outs = []
    async for o in engine.generate(prompt, sp, request_id=rid):
        outs.append(o)
    return outs

async def main():
    args = AsyncEngineArgs(model=MODEL, dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=64,
                           logprobs_mode="processed_logprobs", seed=0)
    t = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args)
    print("engine start s", round(time.perf_counter() - t, 1))
    vc = engine.vllm_config
    print("executor backend:", vc.parallel_config.distributed_executor_backend, "| engine_core client:", type(engine.engine_core).__name__)
    print("enable_prefix_caching:", vc.cache_config.enable_prefix_caching, "| model_runner/device:", vc.device_config.device)
    print("child processes:", [(p.name, p.pid) for p in multiprocessing.active_children()])
    import psutil
    me = psutil.Process()
    print("psutil children:", [(c.pid, c.name(), " ".join(c.cmdline())[:80]) for c in me.children(recursive=True)])
    print("generation_config:", vc.model_config.generation_config, "| default sampling from model:", vc.model_config.get_diff_sampling_param())
    print("logprobs_mode:", vc.model_config.logprobs_mode)
    ids = [1, 2, 3, 4, 5]
    # first generate (warm-up)
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    t = time.perf_counter()
    outs = await collect(engine, {"prompt_token_ids": ids}, sp, "r0")
    print("first generate s", round(time.perf_counter() - t, 2))
    print("default output_kind:", sp.output_kind, "| number of yields:", len(outs))
    o = outs[-1]
    print("RequestOutput type:", type(o).__module__, type(o).__name__)
    print("RequestOutput fields:", sorted(k for k in vars(o)))
    print("request_id", o.request_id, "prompt", repr(o.prompt), "prompt_token_ids", o.prompt_token_ids, "finished", o.finished, "prompt_logprobs", o.prompt_logprobs)
    c = o.outputs[0]
    print("CompletionOutput type:", type(c).__module__, type(c).__name__, "fields:", sorted(vars(c)))
    print("token_ids type", type(c.token_ids), c.token_ids, "| text", repr(c.text), "| finish_reason", c.finish_reason, "| stop_reason", c.stop_reason, "| cumulative_logprob", c.cumulative_logprob)
    print("logprobs type", type(c.logprobs), "len", len(c.logprobs))
    print("logprobs[0]:", c.logprobs[0])
    lp0 = c.logprobs[0]; k = next(iter(lp0))
    print("logprobs[0] key type", type(k), "value type", type(lp0[k]), "keys==sampled?", [list(d) for d in c.logprobs] , c.token_ids)
    # logprobs=0 vs 1 vs 2
    for n in (1, 2):
        o2 = (await collect(engine, TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=3, temperature=1.0, seed=1, logprobs=n), f"lp{n}"))[-1]
        print(f"logprobs={n}:", o2.outputs[0].token_ids, o2.outputs[0].logprobs)
    # finish reasons: stop via stop_token_ids, length, eos
    o3 = (await collect(engine, {"prompt_token_ids": ids}, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[c.token_ids[2]], logprobs=0), "stop"))[-1]
    print("stop_token_ids:", o3.outputs[0].token_ids, o3.outputs[0].finish_reason, "stop_reason", o3.outputs[0].stop_reason, "n logprobs", len(o3.outputs[0].logprobs))
    o3b = (await collect(engine, {"prompt_token_ids": ids}, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[c.token_ids[2]], include_stop_str_in_output=False, logprobs=0, skip_special_tokens=True), "stop2"))[-1]
    print("length:", c.finish_reason, c.stop_reason)
    # eos: force 258 (eos) as a stop token by setting eos as only candidate? use min_tokens/ignore_eos false and look
    # output kinds
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        outs = await collect(engine, {"prompt_token_ids": ids}, SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True, output_kind=kind), f"k{kind.name}")
        print(kind, "yields:", [(list(x.outputs[0].token_ids), len(x.outputs[0].logprobs), x.finished, x.outputs[0].finish_reason) for x in outs])
    # abort
    sp_long = SamplingParams(max_tokens=200, temperature=1.0, logprobs=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async def aborter():
        await asyncio.sleep(0.05); await engine.abort("ab")
    task = asyncio.create_task(aborter())
    outs = await collect(engine, {"prompt_token_ids": ids}, sp_long, "ab")
    await task
    print("abort():", len(outs), "yields; last:", outs[-1].finished, outs[-1].outputs[0].finish_reason, sum(len(x.outputs[0].token_ids) for x in outs), "tokens")
    # cancel the consumer task (client disconnect)
    # reset_prefix_cache
    print("reset_prefix_cache:", await engine.reset_prefix_cache())
    import inspect
    print("reset_prefix_cache sig:", inspect.signature(engine.reset_prefix_cache))
    print("generate sig:", inspect.signature(engine.generate))
    print("pause sig:", inspect.signature(engine.pause_generation), "| resume", inspect.signature(engine.resume_generation), "| is_paused", inspect.signature(engine.is_paused))
    print("collective_rpc sig:", inspect.signature(engine.collective_rpc))
    print("shutdown sig:", inspect.signature(engine.shutdown))
    # 64 x 32
    sp = SamplingParams(max_tokens=32, temperature=1.0, logprobs=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for rep in range(2):
        t = time.perf_counter()
        res = await asyncio.gather(*[collect(engine, {"prompt_token_ids": [1 + (i % 200), 2, 3, 4]}, sp, f"b{rep}-{i}") for i in range(64)])
        dt = time.perf_counter() - t
        ntok = sum(len(r[-1].outputs[0].token_ids) for r in res)
        print(f"64x32 run {rep}: {dt:.2f}s {ntok} tokens {ntok/dt:.0f} tok/s")
    t = time.perf_counter()
    engine.shutdown()
    print("shutdown s", round(time.perf_counter() - t, 2), "children after:", [c.pid for c in psutil.Process().children(recursive=True)])

if __name__ == "__main__":
    asyncio.run(main())
    print("total s", round(time.perf_counter() - T0, 1))
