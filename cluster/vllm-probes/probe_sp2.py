import inspect, msgspec
from vllm import SamplingParams
print("inspect.signature(SamplingParams):", inspect.signature(SamplingParams))
print("struct config:", {k: getattr(SamplingParams.__struct_config__, k) for k in dir(SamplingParams.__struct_config__) if not k.startswith("_")})
for f, v in [("_eos_token_id", 5), ("_all_stop_token_ids", {1}), ("_watermarking_skipped", True), ("_bad_words_token_ids", [[1]])]:
    try: sp = SamplingParams(**{f: v}); print(f"SamplingParams({f}={v!r}) accepted ->", getattr(sp, f))
    except Exception as e: print(f"SamplingParams({f}=...) ->", type(e).__name__, e)
print("positional:", end=" ")
try: print(SamplingParams(2).n)
except Exception as e: print(type(e).__name__, e)
print("top_k=-1 ->", SamplingParams(top_k=-1).top_k, "| top_k=0 ->", SamplingParams(top_k=0).top_k)
print("temperature=0 ->", {k: getattr(SamplingParams(temperature=0.0), k) for k in ("temperature", "top_p", "top_k", "min_p")})
print("temperature=1e-6 ->", SamplingParams(temperature=1e-6).temperature)
try: SamplingParams(bogus=1)
except Exception as e: print("unknown kwarg ->", type(e).__name__, e)
print("sampling_type:", SamplingParams(temperature=0).sampling_type, SamplingParams(temperature=0.7).sampling_type, SamplingParams(temperature=0.7, seed=1).sampling_type)
