"""TorchEngine vs transformers' `generate` on the same tiny model and batch, side by side in one run.

Both sample 64 prompts x 64 new tokens at temperature 1 and return per-token logprobs; for the MoE
model both also capture every layer's expert ids per token (generate through gate hooks on the MoE
routers). Repetitions alternate between the two, and the ratio of medians is reported.

    .venv/bin/python bench/engine.py [--reps 9] [--append bench/RESULTS.md]
"""

import argparse, asyncio, copy, datetime, gc, os, platform, statistics, time

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
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            max_new_tokens=N,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        new = out.sequences[:, P:]
        logprobs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]
    for h in hooks:
        h.remove()
    assert new.shape == (B, N) and logprobs.shape == (B, N)
    return new, logprobs, routes


def engine_generate(engine, prompts, loop):
    "All prompts submitted at once on `loop`, a long-lived event loop as in a server or a Ray actor."
    sp = SamplingParams(temperature=1.0, max_tokens=N)

    async def go():
        return await asyncio.gather(*[engine.generate(p, sp) for p in prompts])

    gens = loop.run_until_complete(go())
    assert all(len(g) == N for g in gens)
    return gens


def timed(fn) -> float:
    """Seconds `fn` takes with the garbage collector held off (as timeit does): a full collection of this process's
    objects costs ~0.2 s and would land at random in either side."""
    gc.collect()
    gc.disable()
    try:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    finally:
        gc.enable()


def bench(name, model, reps, threads, engine_threads):
    "Alternate generate and the engine `reps` times; ratios are taken per adjacent pair (the machine drifts)."
    torch.set_num_threads(threads)
    prompts = torch.randint(0, 256, (B, P), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)
    engine = TorchEngine(copy.deepcopy(model), seed=0, threads=engine_threads)
    loop = asyncio.new_event_loop()
    for _ in range(2):
        hf_generate(ref, prompts)
        engine_generate(engine, prompts, loop)  # warm up
    t_hf, t_eng = [], []
    for _ in range(reps):
        t_hf.append(timed(lambda: hf_generate(ref, prompts)))
        t_eng.append(timed(lambda: engine_generate(engine, prompts, loop)))
    gens = engine_generate(engine, prompts, loop)
    if moe_gates(model):
        assert gens[0].routes.shape == (P + N, model.config.num_hidden_layers, 2)
    engine.close()
    loop.close()
    ratios = sorted(h / e for h, e in zip(t_hf, t_eng))
    return dict(
        model=name,
        threads=threads,
        engine_threads=engine_threads,
        generate_tok_s=B * N / statistics.median(t_hf),
        engine_tok_s=B * N / statistics.median(t_eng),
        ratio=statistics.median(ratios),
        low=ratios[0],
        high=ratios[-1],
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--append", help="append a results section to this markdown file")
    args = ap.parse_args()
    models = [("tiny dense (Qwen3)", tiny_dense()), ("tiny MoE (Qwen3-MoE, 4 experts, top-2)", tiny_moe())]
    # (generate's threads, the engine's): equal threads first; then generate with the caller's default 2.
    rows = [bench(name, model, args.reps, t, 1) for t in (1, 2) for name, model in models]
    lines = [
        "| model | threads (generate / engine) | generate tok/s | TorchEngine tok/s | speed-up, median [min, max] |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {r['threads']} / {r['engine_threads']} | {r['generate_tok_s']:,.0f} | "
        f"{r['engine_tok_s']:,.0f} "
        f"| **{r['ratio']:.2f}x** [{r['low']:.2f}, {r['high']:.2f}] |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    if args.append:
        with open(args.append, "a") as f:
            f.write(
                f"\n## engine: TorchEngine vs transformers generate ({datetime.date.today()})\n\n"
                f"Command: `.venv/bin/python bench/engine.py --reps {args.reps}`. Machine: {os.cpu_count()} CPU cores "
                f"({platform.machine()}), no GPU, torch {torch.__version__}. Batch {B} prompts x {P} tokens, {N} new "
                "tokens each, temperature 1, per-token logprobs returned by both; for the MoE model both also return "
                "every layer's expert ids per token (engine: in each Generation; generate: gate hooks). "
                "The engine is driven from one long-lived event loop; the garbage collector is held off inside timed "
                "regions. "
                f"{args.reps} alternating repetitions after 2 warm-ups; speed-up = generate time / engine time per "
                "adjacent "
                "pair, median and range. Goal: >= 1.5x.\n\n" + table + "\n"
            )


if __name__ == "__main__":
    main()
