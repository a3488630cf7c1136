"""The trainer's forward and backward with each shared prompt computed once (`train.shared_prefix`, the default) vs
every row whole, on the same tiny Qwen3, batch and weights, side by side in one run.

Each batch is `groups` prompts x `n` sampled completions (GRPO's layout), every completion token an action. One
timed repetition is one policy step's scoring: `PolicyActor._forward_logprobs` on the whole batch, then the backward
of the summed action logprobs. Repetitions alternate the two arms; the ratio of medians is reported. A second table
sweeps the arith recipe's shape (6-token prompts, 4 new tokens, 8 samples) over the rows a step trains, with the
plan's minimum saving set to 0, to show where the second forward's own cost is paid back (what `min_saved` is from).

    .venv/bin/python bench/shared_prefix.py [--reps 9] [--append bench/RESULTS.md]
"""

import argparse, datetime, os, platform, statistics, time

import torch

import molt_nb.actor
from molt_nb.actor import PolicyActor
from molt_nb.core import Batch
from molt_nb.models import tiny_dense

# (groups, samples per group, prompt tokens, completion tokens); the first is the arith recipe's shape at 128 rows
SHAPES = [(16, 8, 6, 4), (8, 8, 48, 8), (16, 8, 48, 8), (4, 16, 112, 16)]
SWEEP = [(g, 8, 6, 4) for g in (1, 2, 3, 4, 6, 8)]  # arith: 8 to 64 trained rows


def grpo_batch(groups: int, n: int, prompt: int, completion: int, seed: int = 0) -> Batch:
    "`groups` random prompts, each with `n` random completions; every completion token is an action"
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat(
        [
            torch.randint(1, 250, (groups, 1, prompt), generator=g).expand(groups, n, prompt),
            torch.randint(1, 250, (groups, n, completion), generator=g),
        ],
        -1,
    ).reshape(groups * n, prompt + completion)
    B, T = ids.shape
    action = torch.zeros(B, T - 1, dtype=torch.bool)
    action[:, prompt - 1 :] = True
    zeros, rows = torch.zeros(B), [str(i) for i in range(B)]
    return Batch(
        input_ids=ids,
        attention_mask=torch.ones(B, T, dtype=torch.bool),
        action_mask=action,
        logprobs=torch.zeros(B, T - 1),
        versions=torch.zeros(B, T - 1, dtype=torch.int32),
        rewards=zeros,
        scores=zeros,
        prompt_index=torch.arange(B) // n,
        segment_index=torch.zeros(B, dtype=torch.long),
        truncated=torch.zeros(B, dtype=torch.bool),
        rollout_ids=rows,
        group_ids=[str(i // n) for i in range(B)],
    )


def timed(actor: PolicyActor, batch: Batch) -> float:
    "Seconds of one forward (logprobs of every row) and the backward of the summed action logprobs"
    actor.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    lp = actor._forward_logprobs(actor.model, batch)
    lp[batch.action_mask].sum().backward()
    return time.perf_counter() - start


def bench(shape: tuple, reps: int) -> dict:
    "Whole rows vs shared prompts on one shape (the arith recipe's model: 2 layers, hidden 128, 4 + 4 heads of 32)"
    model = tiny_dense(hidden_size=128, intermediate_size=512, head_dim=32, num_kv_heads=4)
    batch, actor = grpo_batch(*shape), PolicyActor(model)
    if molt_nb.actor.prefix_plan(batch) is None:
        raise SystemExit(f"shape {shape}: the plan scores these rows whole; nothing to compare")
    times = {True: [], False: []}
    for i in range(reps + 2):  # two warm-ups, then alternating arms
        for shared in (True, False) if i % 2 else (False, True):
            actor.shared_prefix = shared
            t = timed(actor, batch)
            if i >= 2:
                times[shared].append(t)
    whole, shared = statistics.median(times[False]), statistics.median(times[True])
    return dict(shape=shape, whole_ms=1000 * whole, shared_ms=1000 * shared, ratio=whole / shared)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--append", help="append a results section to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = [
        "| groups x samples | prompt + completion tokens | whole rows, ms | shared prompts, ms | speed-up |",
        "|---|---|---:|---:|---:|",
    ]
    line = lambda r: "| {} x {} | {} + {} | {:.1f} | {:.1f} | **{:.2f}x** |".format(
        *r['shape'], r['whole_ms'], r['shared_ms'], r['ratio']
    )
    table = "\n".join(head + [line(bench(shape, args.reps)) for shape in SHAPES])
    plan = molt_nb.actor.prefix_plan
    molt_nb.actor.prefix_plan = lambda mb, at_most=0.75, min_saved=128: plan(mb, at_most, 0)  # share every shape
    try:
        sweep = "\n".join(head + [line(bench(shape, args.reps)) for shape in SWEEP])
    finally:
        molt_nb.actor.prefix_plan = plan
    print(table, sweep, sep="\n\n")
    if args.append:
        with open(args.append, "a") as f:
            f.write(
                f"\n## trainer: shared prompts vs whole rows ({datetime.date.today()})\n\n"
                f"Command: `.venv/bin/python bench/shared_prefix.py --reps {args.reps}`. Machine: {os.cpu_count()} CPU "
                f"cores ({platform.machine()}), no GPU, torch {torch.__version__}, 1 torch thread. A tiny Qwen3 (the "
                "arith recipe's shape: 2 layers, hidden 128, MLP 512, 4 query and 4 KV heads of 32); random prompts "
                "and completions in GRPO's layout. One repetition: `PolicyActor._forward_logprobs` on the batch and "
                f"the backward of the summed action logprobs; {args.reps} alternating repetitions after 2 warm-ups, "
                "medians.\n\n" + table + "\n\nThe arith recipe's shape over the rows a step trains, the plan's "
                "minimum saving set to 0:\n\n" + sweep + "\n"
            )


if __name__ == "__main__":
    main()
