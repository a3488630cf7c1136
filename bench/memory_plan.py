"""The memory plan of the GPU recipes in the design the plan describes, and as the code had it before (issue 46).

Two markdown tables per recipe (gsm8k, gsm8k_moe): each GPU role's peak and components in GB on an 80 GB GPU, alike
roles in one row (`molt_nb.memory.memory_plan`), then the same roles computed with the old design's assumptions
through the same component functions of `molt_nb.memory` (no copy of the math):

- the trainer keeps up to three fp32 snapshots of the whole model on rank 0's GPU (versions v-2 .. v: the newest is
  the one it gathers), and every other FSDP2 rank gathers the whole model in fp32 to export it;
- the weights travel in fp32: the trainer's two buckets are fp32 buckets, and every engine worker allocates every
  bucket of the model at once (the whole fp32 model staged on its GPU) on top of vLLM's budget;
- the trainer scores a whole micro-batch's full-vocabulary fp32 logits at once (rows x L positions, three copies);
- no activation checkpointing;
- the recipe's values before the plan: gsm8k_moe with 8 trainer ranks, 4 engines of 2 GPUs and vLLM at 0.9.

No GPU is used: nothing here is measured. Estimates are marked * as in `molt-nb plan`.

    .venv/bin/python bench/memory_plan.py [--append bench/RESULTS.md]
"""

import argparse, dataclasses, datetime, textwrap
from pathlib import Path

from molt_nb.config import load_config
from molt_nb.memory import (
    MemoryPlan,
    RolePlan,
    engine_worker,
    logits_bytes,
    memory_plan,
    micro_batch_rows,
    policy_shapes,
    row_tokens,
    snapshot_bytes,
    trainer_components,
    transfer_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
GPU = 80 * 10**9
OLD_VALUES = {  # each recipe as it was before the plan changed it
    'gsm8k': ['train.activation_checkpointing=false'],
    'gsm8k_moe': [
        'train.activation_checkpointing=false',
        'cluster.trainer_ranks=8',
        'cluster.engines=4',
        'rollout.vllm={gpu_memory_utilization=0.9}',
    ],
}


def in_fp32(cfg):
    "`cfg` with the weights on the wire in fp32, as the old export sent them"
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, dtype='float32'))


def old_trainer(cfg, rank: int) -> RolePlan:
    "Trainer rank `rank` under the old design"
    parts, text = trainer_components(cfg, rank), policy_shapes(cfg).text
    whole = snapshot_bytes(in_fp32(cfg))  # the whole model in fp32
    parts['snapshot'] = 3 * whole if rank == 0 else 0  # v-2, v-1 and v, the newest being the gathered export
    parts['snapshot_gather'] = 0 if rank == 0 else whole  # the others gather it all and drop it
    parts['transfer'] = transfer_bytes(in_fp32(cfg)) if parts['transfer'] else 0
    parts['logits'] = logits_bytes(micro_batch_rows(cfg) * row_tokens(cfg, text), text.vocab)
    return RolePlan(f"trainer {rank}", parts, ('unsharded', 'logits', 'activations', 'runtime'))


def old_engine(cfg, role: str) -> RolePlan:
    "An engine worker under the old design: every fp32 bucket staged at once beside vLLM's budget"
    plan = engine_worker(cfg, GPU, role)
    plan.components['transfer'] = snapshot_bytes(in_fp32(cfg))
    plan.problems = []  # the KV check is the new plan's; vLLM's own share is the same
    return plan


def old_plan(cfg) -> MemoryPlan:
    c = cfg.cluster
    trainers = [old_trainer(cfg, r) for r in range(c.trainer_ranks)]
    names = [
        f"engine {e}" if c.engine_gpus == 1 else f"engine {e} worker {w}"
        for e in range(c.engines)
        for w in range(c.engine_gpus)
    ]
    return MemoryPlan(GPU, trainers + [old_engine(cfg, n) for n in names], {})


def markdown(plan: MemoryPlan) -> str:
    "The plan's table as markdown (pandas' to_markdown needs tabulate, which the project does not install)"
    df = plan.table()
    head = '| ' + ' | '.join(df.columns) + ' |\n|---|' + '---:|' * (len(df.columns) - 1)
    rows = ['| ' + ' | '.join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row) + ' |' for row in df.values]
    return '\n'.join([head, *rows])


SHAPES = {'gsm8k': (2, 8), 'gsm8k_moe': (2, 8), 'geo3k': (2, 8), 'gsm8k_1gpu': (1, 1)}  # nodes, GPUs per node


def largest(plan: MemoryPlan) -> str:
    "The role with the largest peak, its GB and share of the GPU"
    r = max(plan.roles, key=lambda r: r.peak_bytes)
    return f"{r.role}, {r.peak_bytes / 1e9:.1f} GB ({100 * r.peak_bytes / plan.gpu_bytes:.1f}%)"


def summary() -> str:
    "Each GPU recipe's largest role in the new design, with the command that prints its whole plan"
    rows = ['| recipe | command | largest role |', '|---|---|---|']
    for name, (nodes, gpus) in SHAPES.items():
        command = f"molt-nb plan recipes/{name} --nodes {nodes} --gpus-per-node {gpus} --json"
        rows.append(f"| {name} | `{command}` | {largest(memory_plan(load_config(ROOT / 'recipes' / name), GPU))} |")
    return '\n'.join(rows)


def report() -> str:
    out = [summary(), '']
    for name, old in OLD_VALUES.items():
        new_cfg, old_cfg = load_config(ROOT / 'recipes' / name), load_config(ROOT / 'recipes' / name, old)
        new, before = memory_plan(new_cfg, GPU), old_plan(old_cfg)
        out += [f"**{name}, the new design** (the recipe as it is; largest: {largest(new)}):", '', markdown(new), '']
        out += [f"**{name}, the old design** ({', '.join(old)}; largest: {largest(before)}):", '', markdown(before), '']
    return '\n'.join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--append', help='append the tables to this markdown file (e.g. bench/RESULTS.md)')
    args = p.parse_args()
    text = report()
    print(text)
    if args.append:
        intro = (
            f"{datetime.date.today().isoformat()}, `.venv/bin/python bench/memory_plan.py --append bench/RESULTS.md` "
            "(no GPU: `molt_nb.memory`'s plan from each model's real config on the meta device, 80 GB GPUs, * marks an "
            "estimate; `nbs/14a_memory.ipynb` says how each component is counted). The old design's assumptions: "
            "three fp32 snapshots of the whole model on trainer rank 0's GPU and a whole fp32 gather on every other "
            "rank, every fp32 bucket staged at once on every engine worker beside vLLM's budget, a whole micro-batch's "
            "full-vocabulary fp32 logits, no activation checkpointing, and the recipes' values before the plan."
        )
        with open(args.append, 'a') as f:
            f.write(f"\n## Memory plan (issue 46)\n\n{textwrap.fill(intro, 118)}\n\n{text}")


if __name__ == '__main__':
    main()
