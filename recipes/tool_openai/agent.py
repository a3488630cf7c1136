"""Multiplication with a Python tool, as an agent written against the OpenAI SDK that owns its loop.

The agent asks the policy `What is 37*12?` with a `python` tool, runs every tool call in the sandbox
(molt_nb.tools.run_python), sends all results back, and stops at the first answer without a tool call or after
`MAX_TURNS` turns. Reward: 0.8 for the right product in the answer, 0.2 for using the tool successfully. The
chat server records the tokens; the tool output the agent sends back enters the trajectory masked.
"""

import json, random
import openai
from molt_nb.agents import ChatAgent, ChatAgentRunner
from molt_nb.chat import render
from molt_nb.core import Result
from molt_nb.tools import run_python

MAX_TURNS, SPLIT_SEED = 3, 4321
PYTHON = dict(
    type='function',
    function=dict(
        name='python',
        description='Run Python; returns stdout.',
        parameters=dict(type='object', properties=dict(code=dict(type='string')), required=['code']),
    ),
)


def tasks(split: str) -> list:
    "Products of two two-digit numbers: 100 held-out 'eval' tasks, the rest 'train'"
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    if split not in ('train', 'eval'):
        raise ValueError(f"split is {split!r}, expected 'train' or 'eval'")
    return [
        dict(prompt=f"What is {a}*{b}?", label=str(a * b), code=f"print({a}*{b})")
        for a, b in (pairs[:100] if split == 'eval' else pairs[100:])
    ]


def demos(n: int, seed: int = 0) -> list:
    "Labelled (prompt, completion) text pairs for a warm start: the tool call, then the answer after the tool's output"
    tok = _tokenizer()
    out = []
    for t in random.Random(f"tool-demos-{seed}").sample(tasks('train'), n):
        user = dict(role='user', content=t['prompt'])
        call = dict(
            role='assistant',
            content='',
            tool_calls=[
                dict(type='function', function=dict(name='python', arguments=json.dumps(dict(code=t['code']))))
            ],
        )
        out.append(
            (
                render(tok, [user], True, [PYTHON]),
                f'<tool_call>\n{{"name": "python", "arguments": '
                f'{json.dumps(dict(code=t["code"]))}}}\n</tool_call><|im_end|>',
            )
        )
        out.append(
            (
                render(tok, [user, call, dict(role='tool', content=t['label'] + '\n')], True, [PYTHON]),
                t['label'] + '<|im_end|>',
            )
        )
    return out


def _tokenizer():
    from molt_nb.models import build_tokenizer

    return build_tokenizer()


async def call_tool(name: str, arguments: str) -> str:
    "The answer of one tool call (errors are answers too: the model sees them)"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as e:
        return f"error: arguments are not JSON ({e})"
    if name != 'python' or not isinstance(args.get('code'), str):
        return f"error: unknown tool {name!r} or missing 'code'"
    return await run_python(args['code'], timeout_s=5, memory_mb=256)


def score(answer: str, label: str, used_tool: bool) -> float:
    return 0.8 * float(answer.strip() == label) + 0.2 * float(used_tool)


class PythonAgent(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages, used, answer = ctx.messages, False, ''
        for _ in range(MAX_TURNS):
            r = await client.chat.completions.create(model=ctx.model_name, messages=messages, tools=[PYTHON])
            msg = r.choices[0].message
            if not msg.tool_calls:
                answer = msg.content or ''
                break
            messages = messages + [msg.model_dump(exclude_none=True)]
            for c in msg.tool_calls:
                out = await call_tool(c.function.name, c.function.arguments)
                used |= not out.startswith(('error:', 'Traceback', 'TimeoutError'))
                messages.append(dict(role='tool', tool_call_id=c.id, content=out))
        return Result(
            reward=score(answer, ctx.label, used), info=dict(used_tool=float(used), turns=float(len(messages)))
        )


def AgentRunner(tokenizer, max_context: int = 1024):
    return ChatAgentRunner(PythonAgent, tokenizer, max_context=max_context)
