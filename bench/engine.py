"""TorchEngine vs transformers' `generate` on the same tiny model and batch, side by side in one run.

Both sample 64 prompts x 64 new tokens at temperature 1 and return per-token logprobs; for the MoE
model both also capture every layer's expert ids per token (generate through gate hooks, the way
platform.md measured it). Repetitions alternate between the two, and the ratio of medians is reported.

    .venv/bin/python bench/engine.py [--reps 7] [--append bench/RESULTS.md]
"""
import argparse, asyncio, copy, datetime, os, platform, statistics, time

import torch

from molt_nb.core import SamplingParams
from molt_nb.engine import TorchEngine
from molt_nb.models import moe_gates, tiny_dense, tiny_moe

B, P, N = 64, 32, 64


def hf_generate(model, prompts):
    "transformers generate with logprobs (from the processed scores) and, for MoE, routes via gate hooks."
    routes = []
    hooks = [g.register_forward_hook(lambda m, i, o: routes.append(o[2])) for g in moe_gates(model).values()]
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=N,
                             top_k=0, top_p=1.0, temperature=1.0, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        new = out.sequences[:, P:]
        logprobs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]
    for h in hooks: h.remove()
    assert new.shape == (B, N) and logprobs.shape == (B, N)
    return new, logprobs, routes


def engine_generate(engine, prompts):
    sp = SamplingParams(temperature=1.0, max_tokens=N)
    async def go(): return await asyncio.gather(*[engine.generate(p, sp) for p in prompts])
    gens = asyncio.run(go())
    assert all(len(g) == N for g in gens)
    return gens


def bench(name, model, reps):
    prompts = torch.randint(0, 256, (B, P), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)
    engine = TorchEngine(copy.deepcopy(model), seed=0)
    for _ in range(2): hf_generate(ref, prompts); engine_generate(engine, prompts) # warm up
    t_hf, t_eng = [], []
    for _ in range(reps):
        t = time.perf_counter(); hf_generate(ref, prompts); t_hf.append(time.perf_counter() - t)
        t = time.perf_counter(); gens = engine_generate(engine, prompts); t_eng.append(time.perf_counter() - t)
    if moe_gates(model): assert gens[0].routes.shape == (P + N, model.config.num_hidden_layers, 2)
    engine.close()
    hf, eng = statistics.median(t_hf), statistics.median(t_eng)
    return dict(model=name, params=sum(p.numel() for p in model.parameters()), generate_s=hf, engine_s=eng,
                generate_tok_s=B * N / hf, engine_tok_s=B * N / eng, ratio=hf / eng)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--append", help="append a results section to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [bench("tiny dense (Qwen3)", tiny_dense(), args.reps), bench("tiny MoE (Qwen3-MoE, 4 experts, top-2)", tiny_moe(), args.reps)]
    lines = ["| model | params | generate tok/s | TorchEngine tok/s | speed-up |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['params']:,} | {r['generate_tok_s']:,.0f} | {r['engine_tok_s']:,.0f} | **{r['ratio']:.2f}x** |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.append:
        with open(args.append, "a") as f:
            f.write(f"\n## engine: TorchEngine vs transformers generate ({datetime.date.today()})\n\n"
                    f"Command: `.venv/bin/python bench/engine.py --reps {args.reps} --threads {args.threads}`. "
                    f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU, "
                    f"torch {torch.__version__}, {args.threads} threads. Batch {B} prompts x {P} tokens, {N} new tokens, "
                    "temperature 1, logprobs on for both; routes on for the MoE model (engine: returned per token; "
                    "generate: gate hooks). Median of alternating repetitions; speed-up = generate time / engine time. "
                    "Goal: >= 1.5x.\n\n" + table + "\n")


if __name__ == "__main__":
    main()
