"""The trainer's forward and backward with each shared prompt computed once (`train.shared_prefix`, the default) vs
every row whole, on the same tiny Qwen3, batch and weights, side by side in one run.

Each batch is `groups` prompts x `n` sampled completions (GRPO's layout), every completion token an action. One
timed repetition is one policy step's scoring: `PolicyActor._forward_logprobs` on the whole batch, then the backward
of the summed action logprobs. Repetitions alternate the two arms; the ratio of medians is reported.

    .venv/bin/python bench/shared_prefix.py [--reps 9] [--append bench/RESULTS.md]
"""

import argparse, datetime, os, platform, statistics, time

import torch

from molt_nb.actor import PolicyActor, prefix_plan
from molt_nb.core import Batch
from molt_nb.models import tiny_dense

# (groups, samples per group, prompt tokens, completion tokens); the first is the arith recipe's shape at 128 rows
SHAPES = [(16, 8, 6, 4), (8, 8, 48, 8), (16, 8, 48, 8), (4, 16, 112, 16)]


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
    batch, actor = grpo_batch(*shape), PolicyActor(tiny_dense(hidden_size=128, intermediate_size=512, head_dim=32))
    if prefix_plan(batch) is None:
        raise SystemExit(f"shape {shape}: the default plan scores these rows whole; nothing to compare")
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
    rows = []
    for shape in SHAPES:
        batch = grpo_batch(*shape)
        if prefix_plan(batch) is None:
            rows.append(dict(shape=shape, whole_ms=None))
            continue
        rows.append(bench(shape, args.reps))
    lines = [
        "| groups x samples | prompt + completion tokens | whole rows, ms | shared prompts, ms | speed-up |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        (g, n, p, c) = r['shape']
        if r['whole_ms'] is None:
            lines.append(f"| {g} x {n} | {p} + {c} | scored whole (the plan saves too little) | | |")
        else:
            lines.append(
                f"| {g} x {n} | {p} + {c} | {r['whole_ms']:.1f} | {r['shared_ms']:.1f} | **{r['ratio']:.2f}x** |"
            )
    table = "\n".join(lines)
    print(table)
    if args.append:
        with open(args.append, "a") as f:
            f.write(
                f"\n## trainer: shared prompts vs whole rows ({datetime.date.today()})\n\n"
                f"Command: `.venv/bin/python bench/shared_prefix.py --reps {args.reps}`. Machine: {os.cpu_count()} CPU "
                f"cores ({platform.machine()}), no GPU, torch {torch.__version__}, 1 torch thread. A tiny Qwen3 (2 "
                "layers, hidden 128, MLP 512, 4 query heads of 32, 2 KV heads); random prompts and completions in "
                "GRPO's layout. One repetition: `PolicyActor._forward_logprobs` on the batch and the backward of the "
                f"summed action logprobs; {args.reps} alternating repetitions after 2 warm-ups, medians.\n\n"
                + table
                + "\n"
            )


if __name__ == "__main__":
    main()
