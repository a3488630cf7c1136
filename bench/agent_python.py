"""The agents' Python per rollout: the arith recipe's `StepEnvRunner` against an engine that answers at once.

In an async run the agents share the run actor's event loop (and its GIL) with the engine thread: each microsecond of
Python per rollout is a microsecond the engine waits for requests or for the GIL. This measures that Python alone,
128 rollouts (a step: 16 prompts x 8) at a time, with an engine stub that returns a fixed `Generation` (the answer
and the end token) without sampling. Reports the best of 5 rounds of 20 steps, in microseconds per rollout, two ways:

- the runner alone on the same 16 prompts each step (each group's opening is then cached: the agents' turn only);
- as the run calls it: `Pool.collect` of 16 groups, the recipe's pool settings, a `Router` in front of the stub,
  each group a new prompt (its opening rendered and tokenized once, as in a run).

    .venv/bin/python bench/agent_python.py

Not part of `make test`.
"""

import asyncio, time
from pathlib import Path

import torch

from molt_nb.config import load_config, policy_tokenizer
from molt_nb.engine import Generation
from molt_nb.pool import Pool
from molt_nb.recipe import recipe_parts
from molt_nb.router import Router

ROOT = Path(__file__).resolve().parents[1]


class Answering:
    "An engine stub: every request gets the same tokens back at once, as new `Generation` objects"

    version = 0

    def __init__(self, token_ids: list):
        n = len(token_ids)
        self.fields = torch.tensor(token_ids), torch.full((n,), -0.3), torch.zeros(n, dtype=torch.int32)

    async def generate(self, token_ids, sampling, session_id=None, images=None):
        return Generation(*self.fields, None, 'stop', len(token_ids))


async def best_us(step, rollouts: int, steps: int = 20, rounds: int = 5) -> float:
    "Best microseconds per rollout over `rounds` of `steps` calls of `step` (`rollouts` each), after 5 warm ones"
    for _ in range(5):
        await step()
    best = float('inf')
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            await step()
        best = min(best, (time.perf_counter() - start) / (steps * rollouts))
    return best * 1e6


async def per_rollout(cfg, runner, engine, tasks, sampling) -> float:
    "The runner alone, each step the same `tasks` (`groups_per_step` of them) x `n_samples` rollouts"
    n = cfg.rollout.n_samples

    async def step():
        return await asyncio.gather(
            *[runner.run(engine, t, sampling, f"g{g}/r{j}", f"g{g}", g) for g, t in enumerate(tasks) for j in range(n)]
        )

    return await best_us(step, len(tasks) * n)


async def through_pool(cfg, runner, engine, tasks, sampling, vocab_size: int) -> float:
    "`Pool.collect` of `groups_per_step` groups a step, the recipe's pool settings, a `Router` over `engine`"
    r = cfg.rollout
    router = Router(lambda slot, incarnation: engine, 1, vocab_size)
    pool = Pool(runner, router, tasks, sampling, r.n_samples, r.groups_in_flight, r.timeout_s, r.min_successes)
    pool.on_hold = router.hold  # as the run wires them (`Orchestrator._begin`)
    try:
        return await best_us(lambda: pool.collect(r.groups_per_step), r.groups_per_step * r.n_samples)
    finally:
        await pool.close()


def main():
    torch.set_num_threads(1)
    cfg = load_config(ROOT / 'recipes' / 'arith', ['run_dir="/tmp/molt-bench-agent-python"'])
    tok, _ = policy_tokenizer(cfg)
    parts = recipe_parts(cfg, tok)
    answer = tok.encode('52', add_special_tokens=False) + [tok.convert_tokens_to_ids('<|im_end|>')]
    engine = Answering(answer)
    groups = cfg.rollout.groups_per_step
    us = asyncio.run(per_rollout(cfg, parts.runner, engine, parts.train_tasks[:groups], parts.sampling))
    print(f"arith StepEnvRunner, the same {groups} prompts: {us:.1f} us of Python per rollout (best of 5 x 20 steps)")
    us = asyncio.run(through_pool(cfg, parts.runner, engine, parts.train_tasks, parts.sampling, len(tok)))
    print(f"through Pool.collect and a Router, new prompts: {us:.1f} us of Python per rollout (best of 5 x 20 steps)")


if __name__ == '__main__':
    main()
