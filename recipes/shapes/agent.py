"""Shapes: a vision-language task on images drawn in code. Each image holds one to four squares and triangles in red,
green or blue, one per cell of a 4x4 grid; the prompt is the image and a question, completion style:

- `triangles?`: how many triangles (0 to 4), answered with the digit;
- `largest?`: the colour of the largest shape (sizes differ), answered `red`, `green` or `blue`;

each followed by the end token. Reward 1 for exactly the answer, else 0. 2000 held-out tasks (their own seed stream)
are never trained on: a run evaluates on the first `loop.eval_tasks` of them (300, recipe.toml), and `bench/learn.py`
compares RL's final policy with the control's on all of them. Held-out images and the labelled demos ask the two
questions half and half; RL's unlabelled images may ask `triangles?` more often (`tasks`' `triangles`, set in
recipe.toml), where the warm start has the most to learn.
"""

import random
from molt_nb.agents import Env, StepEnvRunner
from molt_nb.core import Result
from molt_nb.vision import draw_shapes

COLOURS = dict(red=(220, 40, 40), green=(40, 170, 40), blue=(40, 70, 220))
CELL, GRID, HELD_OUT, TRAIN = 16, 4, 2000, 20000


def _task(rng: random.Random) -> dict:
    n = rng.randint(1, 4)
    cells = rng.sample(range(GRID * GRID), n)
    sizes = rng.sample(range(7, CELL + 1), n)  # distinct: one largest shape
    shapes = []
    for cell, s in zip(cells, sizes):
        r, c = divmod(cell, GRID)
        dr, dc = rng.randint(0, CELL - s), rng.randint(0, CELL - s)
        shapes.append(
            (rng.choice(('square', 'triangle')), rng.choice(list(COLOURS)), (r * CELL + dr, c * CELL + dc), s)
        )
    return _ask(dict(shapes=shapes), rng.choice(('triangles', 'largest')))


def _ask(task: dict, question: str) -> dict:
    "`task` asking `question`, with its answer"
    shapes = task['shapes']
    if question == 'triangles':
        answer = str(sum(k == 'triangle' for k, *_ in shapes))
    else:
        answer = max(shapes, key=lambda x: x[3])[1]
    return dict(task, question=question, answer=answer)


def tasks(split: str, triangles: float = 0.5) -> list:
    """The tasks of `split`: 'eval' (2000 fixed held-out images, half of them asking `triangles?`) or 'train' (20,000
    others), in a fixed order. `triangles`: the share of the train split's images that ask `triangles?`; each image of
    it asks the question `_task` drew, switched to the other on a stream of its own as far as that share needs"""
    if split not in ('train', 'eval'):
        raise ValueError(f"split is {split!r}, expected 'train' or 'eval'")
    if not 0 <= triangles <= 1:
        raise ValueError(f"triangles is {triangles!r}: give the share of 'triangles?' questions, from 0 to 1")
    n = HELD_OUT if split == 'eval' else TRAIN
    out = [_task(random.Random(f"shapes-{split}-{i}")) for i in range(n)]
    if split == 'eval':
        return out
    switch = random.Random("shapes-flip")
    for i, t in enumerate(out):
        other, rate = ('triangles', 2 * triangles - 1) if t['question'] == 'largest' else ('largest', 1 - 2 * triangles)
        if rate > 0 and switch.random() < rate:
            out[i] = _ask(t, other)
    return out


def image(task: dict):
    "The task's image, (64, 64, 3) uint8"
    return draw_shapes([(k, COLOURS[c], at, s) for k, c, at, s in task['shapes']], size=(GRID * CELL, GRID * CELL))


def prompt(task: dict) -> list:
    return [image(task), f" {task['question']}? "]


def demos(n: int, seed: int = 0) -> list:
    "n labelled training examples as (prompt, completion) pairs; the prompt is the image and the question"
    rng = random.Random(f"shapes-demos-{seed}")
    picked = rng.sample(range(TRAIN), n)
    return [
        (prompt(t), t['answer'] + '<|im_end|>') for t in (_task(random.Random(f"shapes-train-{i}")) for i in picked)
    ]


class Shapes(Env):
    "One turn: reward 1 for exactly the answer followed by the end token, else 0"

    async def reset(self, task):
        return prompt(task)

    async def step(self, turn):
        return Result(reward=float(turn.finish_reason == 'stop' and turn.text == turn.task['answer']))


def AgentRunner(tokenizer, processor, max_context: int = 48):
    "`processor` is the policy's image processor (a run passes it: `policy_processor`)"
    return StepEnvRunner(Shapes, tokenizer, max_turns=1, max_context=max_context, template=False, processor=processor)
