"""Two-digit addition with an exact-match reward: the prompt `07+45=` must be answered `52` and the end token.

The task: zero-padded operands so every prompt has six tokens, the plain
sum, completion style (no chat template). 500 held-out prompts (fixed by seed 1234) are never trained on.
"""

import random
from molt_nb.agents import Env, StepEnvRunner
from molt_nb.core import Result

HELD_OUT, SPLIT_SEED = 500, 1234


def _task(a: int, b: int) -> dict:
    return dict(prompt=f"{a:02d}+{b:02d}=", answer=str(a + b))


def tasks(split: str) -> list:
    "The tasks of `split`: 'eval' (500 fixed held-out sums) or 'train' (the other 9,500), in a fixed order"
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    if split not in ('train', 'eval'):
        raise ValueError(f"split is {split!r}, expected 'train' or 'eval'")
    return [_task(a, b) for a, b in (pairs[:HELD_OUT] if split == 'eval' else pairs[HELD_OUT:])]


def demos(n: int, seed: int = 0) -> list:
    "n labelled training examples as (prompt, completion) text pairs; the completion ends with the end token"
    train = tasks('train')
    # a random stream of its own: Random(seed).sample and Random(seed).shuffle draw the same numbers, so demos drawn
    # that way would be exactly the last prompts of a run's data order (shuffled with the same seed)
    return [(t['prompt'], t['answer'] + '<|im_end|>') for t in random.Random(f"arith-demos-{seed}").sample(train, n)]


class Arith(Env):
    "One turn: reward 1 for exactly the sum followed by the end token, else 0"

    async def reset(self, task):
        return task['prompt']

    async def step(self, turn):
        return Result(reward=float(turn.finish_reason == 'stop' and turn.text == turn.task['answer']))


def AgentRunner(tokenizer, max_context: int = 16):
    return StepEnvRunner(Arith, tokenizer, max_turns=1, max_context=max_context, template=False)
