"""Geometry3K: a vision-language policy answers geometry questions about a diagram, with a Python tool.

Each task is a diagram and a question (Geometry3K, Lu et al. 2021: 2,101 train and 601 test problems). The policy
may call a `python` tool (run in molt_nb's sandbox, no network, a few seconds) up to `MAX_TOOL_TURNS` times, then
answers with `\\boxed{...}`. Reward: 1 when the boxed answer equals the reference (LaTeX numbers such as
`\\frac{40}{3}`, `2\\sqrt{221}` or `12.4` are evaluated, then compared within 1e-4 relative, absolute below 1), else
0; a turn cut off by max_tokens or an answer after the tool budget scores 0. At most `MAX_CALLS` calls of a turn
run.

The data is never downloaded and never made up behind the user's back. `tasks(split, data=..., synthetic=...)` takes
exactly one source, from the recipe's `task_options`:

- `data`: a directory holding Geometry3K as parquet, in the columns of the Hugging Face dataset `hiyouga/geometry3k`
  (`images`: a list of one image, `problem`: the question, `answer`): either `train.parquet` and `test.parquet`
  (`load_dataset('hiyouga/geometry3k')[split].to_parquet(...)`), or the dataset repository's own files
  (`hf download hiyouga/geometry3k --repo-type dataset --local-dir DIR`: `data/train-*.parquet`, `data/test-*.parquet`);
- `synthetic = true`: right triangles drawn in code with their legs labelled, asking for the hypotenuse (fixed by
  `seed`), for CPU checks of the recipe. Not Geometry3K.
"""

import ast, io, json, math, operator, random, re
from pathlib import Path

from molt_nb.agents import Env, StepEnvRunner
from molt_nb.chat_server import parse_tool_calls
from molt_nb.core import Result
from molt_nb.tools import run_python

MAX_TOOL_TURNS = 3  # turns whose tool calls are answered; the turn after the last must answer
MAX_CALLS = 2  # tool calls run per turn (each may take seconds of sandbox time); the rest are dropped, and said so
PROMPT = (
    "{problem}\nYou may run Python with the `python` tool to compute. Put your final answer within \\boxed{{}}, "
    "as a number or an exact expression such as \\frac{{3}}{{2}} or 2\\sqrt{{3}}."
)
PYTHON = dict(
    type='function',
    function=dict(
        name='python',
        description="Run a Python program; returns what it prints.",
        parameters=dict(type='object', properties=dict(code=dict(type='string')), required=['code']),
    ),
)
SPLITS = {'train': 'train', 'eval': 'test'}
BOXED = re.compile(r'\\boxed\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}')


# ------------------------------------------------------------------------------------------------- the answer
def latex_number(text: str) -> float | None:
    """The value of a LaTeX number or expression ('12.4', '\\frac{40}{3}', '2\\sqrt{221}', '3\\pi', '45^\\circ',
    '1,200'), evaluated on a whitelist of arithmetic (no names but sqrt and pi, never `eval`); None when it is not
    one"""
    s = text.strip().strip('$').replace('\\left', '').replace('\\right', '').replace('\\!', '').replace('\\,', '')
    s = re.sub(r'\^\s*\{?\\circ\}?|°|\\degree|\\%', '', s).replace(' ', '')
    s = re.sub(r'(?<=\d),(?=\d{3}(?!\d))', '', s)  # 1,200 -> 1200
    s = s.replace('\\dfrac', '\\frac').replace('\\tfrac', '\\frac').replace('\\cdot', '*').replace('\\times', '*')
    for _ in range(8):  # nested \frac and \sqrt, innermost first
        s = re.sub(r'\\frac\{([^{}]*)\}\{([^{}]*)\}', r'((\1)/(\2))', s)
        s = re.sub(r'\\sqrt\{([^{}]*)\}', r'sqrt(\1)', s)
    s = (
        re.sub(r'\\sqrt(\d+)', r'sqrt(\1)', s)
        .replace('\\pi', 'pi')
        .replace('{', '(')
        .replace('}', ')')
        .replace('^', '**')
    )
    s = re.sub(r'(?<=[\d)])(?=[a-z(])', '*', s)  # 2sqrt(3), 3pi, 2(4) -> multiplication
    if not s or len(s) > 200 or not re.fullmatch(r'[\d.+\-*/()a-z]*', s):
        return None
    try:
        value = _arith(ast.parse(s, mode='eval').body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
        return None
    return value if isinstance(value, float) and math.isfinite(value) else None


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _arith(node) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id == 'pi':
        return math.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _arith(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exp = _arith(node.left), _arith(node.right)
        if abs(exp) > 16:
            raise ValueError('exponent too large')
        if base < 0 and exp != int(exp):
            raise ValueError('a fractional power of a negative number')  # Python would give a complex number
        return float(base**exp)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == 'sqrt'
        and len(node.args) == 1
        and not node.keywords
    ):
        v = _arith(node.args[0])
        if v < 0:
            raise ValueError('sqrt of a negative number')
        return math.sqrt(v)
    raise ValueError(f'not arithmetic: {ast.dump(node)[:60]}')


def final_answer(text: str) -> str | None:
    "The content of the last `\\boxed{}` after any thinking; None when there is none or a `<think>` never closed"
    if '<think>' in text and '</think>' not in text:
        return None
    boxed = BOXED.findall(text.rsplit('</think>', 1)[-1])
    return boxed[-1] if boxed else None


def score(text: str, answer: str) -> float:
    """1.0 when the boxed answer of `text` equals the reference `answer` (as text, or as numbers within 1e-4 of
    max(1, |answer|)), else 0.0"""
    got = final_answer(text)
    if got is None:
        return 0.0
    if got.replace(' ', '') == answer.replace(' ', ''):
        return 1.0
    a, b = latex_number(got), latex_number(answer)
    return float(a is not None and b is not None and abs(a - b) <= 1e-4 * max(1.0, abs(b)))


# --------------------------------------------------------------------------------------------------- the data
def _files(root: Path, split: str) -> list:
    "The parquet files of `split` under `root`: `{split}.parquet`, or the dataset repository's `data/{split}-*.parquet`"
    one = root / f'{split}.parquet'
    return [one] if one.is_file() else sorted((root / 'data').glob(f'{split}-*.parquet'))


def _image_bytes(cell, where: str) -> bytes:
    "The encoded bytes of a Geometry3K row's one image (datasets stores each as {'bytes', 'path'})"
    items = list(cell) if cell is not None and not isinstance(cell, (dict, bytes)) else [cell]
    if len(items) != 1:
        raise ValueError(f"{where}: 'images' holds {len(items)} images, expected exactly one diagram")
    item = items[0]
    data = item.get('bytes') if isinstance(item, dict) else item
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ValueError(
            f"{where}: the image has no bytes (only a path?): export the dataset with its images embedded "
            "(datasets' to_parquet does)"
        )
    return bytes(data)


def load_parquet(root: Path, split: str) -> list:
    "Geometry3K rows of `split` as tasks {'image' (encoded bytes), 'problem', 'answer'}"
    import pandas as pd

    files = _files(root, split)
    if not files:
        raise FileNotFoundError(
            f"{root} has no {split}.parquet (nor data/{split}-*.parquet): task_options.data must be a directory "
            "with Geometry3K's train and test splits as parquet, e.g. `hf download hiyouga/geometry3k --repo-type "
            "dataset --local-dir DIR`, or datasets.load_dataset('hiyouga/geometry3k')[split].to_parquet(...)"
        )
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    missing = {'images', 'problem', 'answer'} - set(frame.columns)
    if missing or frame.empty:
        raise ValueError(
            f"{files[0]}: columns {sorted(frame.columns)}, expected images, problem and answer (hiyouga/geometry3k)"
            + ('' if not frame.empty else '; it has no rows')
        )
    return [
        dict(image=_image_bytes(r.images, f"{files[0]} row {i}"), problem=str(r.problem), answer=str(r.answer))
        for i, r in enumerate(frame.itertuples(index=False))
    ]


def synthetic_tasks(n: int, seed: int) -> list:
    "`n` right triangles with labelled legs, asking for the hypotenuse, fixed by `seed` (a CPU stand-in)"
    from PIL import Image, ImageDraw

    rng, out = random.Random(f"geo3k-synthetic-{seed}"), []
    for _ in range(n):
        a, b = rng.randint(3, 24), rng.randint(3, 24)
        img = Image.new('RGB', (96, 64), 'white')
        d = ImageDraw.Draw(img)
        d.polygon([(10, 54), (86, 54), (10, 10)], outline='black')
        d.text((40, 55), str(b), fill='black')
        d.text((1, 28), str(a), fill='black')
        buf = io.BytesIO()
        img.save(buf, 'PNG')
        hyp = math.hypot(a, b)
        answer = str(round(hyp)) if hyp == round(hyp) else f"\\sqrt{{{a * a + b * b}}}"
        out.append(dict(image=buf.getvalue(), problem='<image>Find the length of the hypotenuse.', answer=answer))
    return out


def tasks(split: str, data: str | None = None, synthetic: bool = False) -> list:
    "The tasks of `split` ('train' or 'eval' = Geometry3K's test): from `data`'s parquet, or generated if `synthetic`"
    if split not in SPLITS:
        raise ValueError(f"split is {split!r}, expected 'train' or 'eval'")
    if (data is None) == (not synthetic):
        raise ValueError(
            f"give exactly one source of tasks, got data={data!r} and synthetic={synthetic!r}: set task_options.data "
            "to a directory with Geometry3K as parquet (hiyouga/geometry3k), or task_options.synthetic = true for "
            "the generated CPU check set (never in a real run)"
        )
    if synthetic:
        return synthetic_tasks(32, seed=0 if split == 'train' else 1)
    return load_parquet(Path(data), SPLITS[split])


def image(task: dict):
    "The task's diagram as an RGB PIL image"
    from PIL import Image

    return Image.open(io.BytesIO(task['image'])).convert('RGB')


# ---------------------------------------------------------------------------------------------------- the env
class Geo3K(Env):
    "The diagram and the question in; each tool call's output back as a tool message; the boxed answer scored"

    async def reset(self, task):
        problem = task['problem'].replace('<image>', '').strip()
        return [dict(role='user', content=[image(task), PROMPT.format(problem=problem)])]

    async def step(self, turn):
        if turn.finish_reason != 'stop':  # cut off: no answer
            return Result(reward=0.0, info=dict(tool_calls=turn.index))
        content, calls = parse_tool_calls(turn.text)
        if calls and turn.index < MAX_TOOL_TURNS:
            outputs = [await run_python(_code(c)) for c in calls[:MAX_CALLS]]
            if len(calls) > MAX_CALLS:
                outputs.append(f"({len(calls) - MAX_CALLS} more tool calls were not run: at most {MAX_CALLS} a turn)")
            return Result(reward=0.0, observation='\n'.join(outputs), terminated=False)
        return Result(reward=score(content, turn.task['answer']), info=dict(tool_calls=turn.index))


def _code(call: dict) -> str:
    "The program of a `python` tool call (another tool's call, or one without code, runs nothing useful)"
    args = call.get('arguments')
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return 'print("the python tool takes {\\"code\\": \\"...\\"}")'
    if call.get('name') != 'python' or not isinstance(args, dict) or not isinstance(args.get('code'), str):
        return 'print("unknown tool call: use python with {\\"code\\": \\"...\\"}")'
    return args['code']


def AgentRunner(tokenizer, processor, max_context: int = 8192):
    "`processor` is the policy's image processor (a run passes it: `policy_processor`)"
    return StepEnvRunner(
        Geo3K,
        tokenizer,
        max_turns=MAX_TOOL_TURNS + 1,
        max_context=max_context,
        observation_role='tool',
        tools=[PYTHON],
        processor=processor,
    )
