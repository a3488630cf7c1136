"""GSM8K grade-school math with a verifier: the policy reasons in its chat turn and ends with `\\boxed{N}`; the
reward is 1 when the final number equals the reference answer, else 0.

The data is never downloaded and never made up behind the user's back. `tasks(split, data=..., synthetic=...)` takes
exactly one source, from the recipe's `task_options`:

- `data`: a directory holding `train.jsonl` and `test.jsonl` (the 'eval' split), one `{"question", "answer"}` object a
  line, as the Hugging Face datasets export of `openai/gsm8k` writes them (the answer ends with `#### 72`);
- `synthetic = true`: a small set of generated two-step word problems (fixed by `seed`), for CPU checks of the recipe.

Neither, or both, is an error that says what to set.
"""

import json, random, re
from fractions import Fraction
from pathlib import Path

from molt_nb.agents import Env, StepEnvRunner
from molt_nb.core import Result

PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
FILES = {'train': 'train.jsonl', 'eval': 'test.jsonl'}
NUMBER = re.compile(r'(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:/\d+)?')  # a minus after a digit is an operator: 3-1
FRAC = re.compile(r'\\d?frac\{(-?\d+)\}\{(\d+)\}')  # LaTeX \frac{7}{2} is 7/2
BOXED = re.compile(r'\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}')


def number(text: str) -> Fraction | None:
    "The last number written in `text` ('1,234', '-3.5', '7/2', '$18.00'), exactly; None when there is none"
    found = NUMBER.findall(FRAC.sub(r'\1/\2', text))
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(',', ''))
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(text: str) -> Fraction | None:
    """The answer of a completion: the number in its last `\\boxed{}` after any thinking, else its last number; None
    when it has none, or when a `<think>` block never closed (the answer was never given)"""
    if '<think>' in text and '</think>' not in text:
        return None
    text = text.rsplit('</think>', 1)[-1]
    boxed = BOXED.findall(text)
    return number(boxed[-1]) if boxed else number(text)


def reference(answer: str) -> str:
    "The reference number of a GSM8K answer ('... #### 1,234' -> '1234'), or the answer itself when it has no ####"
    return answer.rsplit('####', 1)[-1].strip().replace(',', '')


def score(text: str, answer: str) -> float:
    "1.0 when the completion's final number equals the reference `answer` exactly, else 0.0 (malformed included)"
    got = final_answer(text)
    return float(got is not None and got == Fraction(answer))


def load_jsonl(path: Path) -> list:
    "GSM8K rows of a JSONL file as tasks {'question', 'answer'} (the answer is the reference number as text)"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: task_options.data must be a directory with train.jsonl and test.jsonl, e.g. "
            "datasets.load_dataset('openai/gsm8k', 'main')[split].to_json(...) for 'train' and 'test'"
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bad = [i for i, r in enumerate(rows) if not {'question', 'answer'} <= set(r)]
    if bad or not rows:
        raise ValueError(
            f"{path}: line {bad[0] + 1 if bad else 1} has no 'question' and 'answer' (or the file is empty)"
        )
    return [dict(question=r['question'], answer=reference(r['answer'])) for r in rows]


TEMPLATES = [
    (
        "{name} has {a} apples and buys {b} bags with {c} apples in each. How many apples does {name} have now?",
        lambda a, b, c: a + b * c,
    ),
    (
        "A shelf holds {a} books. {name} puts {b} boxes of {c} books on it, then takes {c} books away. How many books "
        "are on the shelf?",
        lambda a, b, c: a + b * c - c,
    ),
    (
        "{name} earns {a} dollars a day for {b} days and spends {c} dollars. How many dollars are left?",
        lambda a, b, c: a * b - c,
    ),
]
NAMES = ['Ava', 'Ben', 'Chloe', 'Dev', 'Emma', 'Farid']


def synthetic_tasks(n: int, seed: int) -> list:
    "`n` generated word problems in GSM8K's shape, fixed by `seed` (a CPU stand-in: not GSM8K)"
    rng = random.Random(f"gsm8k-synthetic-{seed}")
    out = []
    for _ in range(n):
        text, solve = rng.choice(TEMPLATES)
        a, b, c = rng.randint(2, 60), rng.randint(2, 12), rng.randint(2, 20)
        out.append(dict(question=text.format(name=rng.choice(NAMES), a=a, b=b, c=c), answer=str(solve(a, b, c))))
    return out


def tasks(split: str, data: str | None = None, synthetic: bool = False) -> list:
    "The tasks of `split` ('train' or 'eval'): from `data`'s JSONL files, or generated when `synthetic` is true"
    if split not in FILES:
        raise ValueError(f"split is {split!r}, expected 'train' or 'eval'")
    if (data is None) == (not synthetic):
        raise ValueError(
            f"give exactly one source of tasks, got data={data!r} and synthetic={synthetic!r}: set "
            "task_options.data to a directory with GSM8K's train.jsonl and test.jsonl, or task_options.synthetic = "
            "true for the generated CPU check set (never in a real run)"
        )
    if synthetic:
        return synthetic_tasks(64, seed=0 if split == 'train' else 1)
    return load_jsonl(Path(data) / FILES[split])


class GSM8K(Env):
    "One chat turn: the question in, reward 1 for the right final number (a truncated turn scores 0)"

    async def reset(self, task):
        return [{'role': 'user', 'content': PROMPT.format(question=task['question'])}]

    async def step(self, turn):
        return Result(reward=score(turn.text, turn.task['answer']) if turn.finish_reason == 'stop' else 0.0)


def AgentRunner(tokenizer, max_context: int = 4096):
    return StepEnvRunner(GSM8K, tokenizer, max_turns=1, max_context=max_context)
