"""A running total, three turns: the template for multi-turn recipes.

The Env opens with a sum (`07+45=`); each correct answer is met with the next number to add (`+13=`), so every
turn after the first must read the model's own last answer, several turns back in the conversation. A wrong
answer ends the episode. The reward is the fraction of the turns answered right (shaped: partial credit), the
score (what evaluation calls held-out accuracy) is 1 only for a whole chain right. The demos are played by a
scripted policy (`solve`) through the run's own runner, so the warm start trains on exactly the contexts the
rollouts see. The tiny model runs completion style (`template=False`: `07+45=52<|im_end|>+13=65<|im_end|>...`);
a chat model keeps its chat template (`agent_options = {template = true}`; the tiny model then needs
`max_context = 128` and `model.max_position = 128`, three turns being about 85 tokens): nothing else changes, the
demos are rendered through the template too. Copy this folder to start a multi-turn recipe: replace `tasks`, `Chain` and
`solve`.
"""

import random
from molt_nb.agents import Env, StepEnvRunner
from molt_nb.core import Result
from molt_nb.recipe import scripted_demos

HELD_OUT, SPLIT_SEED = 500, 1234


def tasks(split: str, turns: int = 3) -> list:
    "The tasks of `split`: a start and the numbers to add, 'eval' (500 fixed held-out chains) or 'train' (others)"
    if split not in ('train', 'eval'):
        raise ValueError(f"split is {split!r}, expected 'train' or 'eval'")
    rng = random.Random(SPLIT_SEED)
    chains = [[rng.randrange(100) for _ in range(turns + 1)] for _ in range(20_000)]
    return [dict(numbers=c) for c in (chains[:HELD_OUT] if split == 'eval' else chains[HELD_OUT:])]


def solve(task: dict, history: list) -> str:
    "The scripted policy the demos are played with: the running total after this turn"
    numbers = task['numbers']
    return str(sum(numbers[: len(history) + 2]))


def demos(n: int, seed: int, runner) -> list:
    "n (prompt, completion) pairs, one per turn of scripted episodes on train tasks, rendered as the rollouts are"
    return scripted_demos(runner, solve, random.Random(f"chain-demos-{seed}").sample(tasks('train'), n), n)


class Chain(Env):
    "Turn k answers the running total of the first k + 2 numbers; a wrong answer ends the chain"

    async def reset(self, task):
        a, b = task['numbers'][:2]
        return f"{a:02d}+{b:02d}="

    async def step(self, turn):
        numbers, k = turn.task['numbers'], turn.index
        turns = len(numbers) - 1
        right = turn.finish_reason == 'stop' and turn.text == str(sum(numbers[: k + 2]))
        if not right or k + 1 == turns:  # the chain ends: a wrong answer, or the last number added
            done = k + right
            return Result(reward=done / turns, score=float(done == turns))
        return Result(reward=0.0, observation=f"+{numbers[k + 2]:02d}=", terminated=False)


def AgentRunner(tokenizer, max_turns: int = 3, max_context: int = 64, template: bool = False):
    return StepEnvRunner(Chain, tokenizer, max_turns=max_turns, max_context=max_context, template=template)
