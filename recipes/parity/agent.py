"""The smallest recipe that learns anything: reward 1 when the first sampled token has an even id.

A random tiny model scores about 50%, so every group is informative from the first step, which makes it the
recipe of the loop's tests and smoke runs. Completion style, no chat template.
"""

from molt_nb.agents import Env, StepEnvRunner
from molt_nb.core import Result


def tasks(split: str) -> list:
    "Prompts 'n:' for n in 0..999 ('train') or 1000..1099 ('eval')"
    if split not in ('train', 'eval'):
        raise ValueError(f"split is {split!r}, expected 'train' or 'eval'")
    return [dict(prompt=f"{n}:") for n in (range(1000) if split == 'train' else range(1000, 1100))]


class Parity(Env):
    async def reset(self, task):
        return task['prompt']

    async def step(self, turn):
        return Result(reward=float(len(turn.token_ids) > 0 and int(turn.token_ids[0]) % 2 == 0))


def AgentRunner(tokenizer, max_context: int = 64):
    return StepEnvRunner(Parity, tokenizer, max_turns=1, max_context=max_context, template=False)
