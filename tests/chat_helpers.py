"""What the chat-server test files share: the `add` tool on both wires, the conversation the tiny model is warm-started
on, the warm-started model itself (a fixture), and a spy on the engine."""

import pytest, torch
from molt_nb.chat import render
from molt_nb.core import SamplingParams
from molt_nb.models import build_tokenizer, tiny_dense
from molt_nb.train import demo_rows, supervised

TOK = build_tokenizer()
SCHEMA = dict(type='object', properties=dict(a=dict(type='integer'), b=dict(type='integer')), required=['a', 'b'])
OPENAI_TOOLS = [dict(type='function', function=dict(name='add', description='Add two integers.', parameters=SCHEMA))]
ANTHROPIC_TOOLS = [
    dict(name='add', description='Add two integers.', input_schema=SCHEMA)
]  # renders exactly as OPENAI_TOOLS
USER = dict(role='user', content='Add 1+2 and 3+4.')
CALLS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
)
ANSWER, YES = 'The sums are 3 and 7.', 'Yes.'
GREEDY = SamplingParams(temperature=0.0, max_tokens=160, stop_token_ids=(TOK.eos_token_id,))


def calls_message():
    args = ['{"a": 1, "b": 2}', '{"a": 3, "b": 4}']
    return dict(
        role='assistant',
        content='',
        tool_calls=[
            dict(id=f'c{i}', type='function', function=dict(name='add', arguments=a)) for i, a in enumerate(args)
        ],
    )


RESULTS = [dict(role='tool', tool_call_id='c0', content='3'), dict(role='tool', tool_call_id='c1', content='7')]
CONV3 = [USER, calls_message(), *RESULTS, dict(role='assistant', content=ANSWER), dict(role='user', content='Sure?')]


@pytest.fixture(scope='module')
def tool_model():
    "The tiny model warm-started to answer USER with two tool calls, the tool results with ANSWER, and 'Sure?' with YES"
    convs = [[USER], [USER, calls_message(), *RESULTS], CONV3]
    pairs = [(render(TOK, c, True, OPENAI_TOOLS), out + '<|im_end|>') for c, out in zip(convs, [CALLS, ANSWER, YES])]
    torch.manual_seed(0)
    model = tiny_dense(TOK)
    supervised(model, *demo_rows(TOK, pairs), steps=100, lr=3e-3, batch_size=3)
    return model.eval()


class Spy:
    "An engine proxy that keeps every prompt and generation (observes the real engine, changes nothing)"

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, token_ids, sampling, session_id=None):
        gen = await self.engine.generate(token_ids, sampling, session_id)
        self.calls.append((torch.as_tensor(token_ids).tolist(), gen))
        return gen

    def __getattr__(self, name):
        return getattr(self.engine, name)
