"""Probe 3: in-place weight update correctness vs transformers (tied lm_head on CPU), RPC arg types."""
import asyncio, os, time, torch, numpy as np
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.sampling_params import RequestOutputKind as K
from transformers import AutoModelForCausalLM
DENSE, PERT = "/tmp/vllm-probe/dense_gc", "/tmp/vllm-probe/dense_pert"
PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [100, 7, 9, 44, 45, 46, 47], [200, 201]]

async def run(engine, ids, sp, rid):
    outs = []
    async for o in engine.generate({"prompt_token_ids": ids}, sp, request_id=rid): outs.append(o)
    return outs[-1].outputs[0]

async def vs_hf(engine, hf, tag):
    "greedy 12 tokens; max |vLLM logprob - HF log_softmax| over them, and greedy token agreement with HF argmax"
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True, output_kind=K.FINAL_ONLY)
    cs = await asyncio.gather(*[run(engine, p, sp, f"{tag}-{i}") for i, p in enumerate(PROMPTS)])
    md, agree = 0.0, True
    for p, c in zip(PROMPTS, cs):
        toks = list(c.token_ids)
        with torch.no_grad(): logits = hf(torch.tensor([p + toks])).logits[0, len(p) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        got = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, toks)])
        md = max(md, (ref - got).abs().max().item()); agree &= logits.argmax(-1).tolist() == toks
    return f"max|dlogprob| {md:.2e}, greedy == HF argmax: {agree}"

async def main():
    hf0 = AutoModelForCausalLM.from_pretrained(DENSE, dtype=torch.float32).eval()
    hf1 = AutoModelForCausalLM.from_pretrained(PERT, dtype=torch.float32).eval()
    e = AsyncLLM.from_engine_args(AsyncEngineArgs(model=DENSE, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
                                  logprobs_mode="processed_logprobs", worker_extension_cls="probe_ext.ProbeExt"))
    print("original engine vs HF original:", await vs_hf(e, hf0, "a"))
    print("lm_head check before:", await e.collective_rpc("lm_head_check"))
    t = time.perf_counter(); r = await e.collective_rpc("load_from_file", args=(f"{PERT}/model.safetensors",))
    print(f"layerwise reload of perturbed file {time.perf_counter()-t:.2f}s, loaded {len(r[0]['names'])} names")
    await e.reset_prefix_cache()
    print("lm_head check after reload:", await e.collective_rpc("lm_head_check"))
    print("after reload vs HF perturbed:", await vs_hf(e, hf1, "b"))
    print("lm_head check after refresh:", await e.collective_rpc("lm_head_check", args=(True,)))
    await e.reset_prefix_cache()
    print("after lm_head refresh vs HF perturbed:", await vs_hf(e, hf1, "c"))
    # reload back to the original, refresh, compare
    await e.collective_rpc("load_from_file", args=(f"{DENSE}/model.safetensors",)); await e.collective_rpc("lm_head_check", args=(True,)); await e.reset_prefix_cache()
    print("back to original (reload+refresh) vs HF original:", await vs_hf(e, hf0, "d"))
    print("VLLM_ALLOW_INSECURE_SERIALIZATION =", os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION"))
    for label, arg in [("torch.Tensor", torch.ones(4)), ("np.ndarray", np.ones(4, np.float32)), ("bytes", np.ones(4, np.float32).tobytes()),
                       ("list[float]", [1.0] * 4), ("tuple(str, list)", ("w", [4], 4))]:
        try: print(f"collective_rpc arg {label}:", (await e.collective_rpc("probe_args2", args=(arg,)))[0])
        except Exception as ex: print(f"collective_rpc arg {label}: ->", type(ex).__name__, str(ex)[:160])
    t = time.perf_counter(); e.shutdown(); print(f"shutdown {time.perf_counter()-t:.1f}s")

if __name__ == "__main__":
    asyncio.run(main())
