"""The tool_openai task (multiplication with a sandboxed Python tool) as an agent written against the Anthropic SDK.

Tasks, demonstrations, the tool and the reward are tool_openai's; only the client and the wire differ: tools
as `input_schema`, calls as `tool_use` blocks, all results of a turn as `tool_result` blocks of one user message.
"""

from pathlib import Path
import anthropic
from molt_nb.agents import ChatAgent, ChatAgentRunner, load_module
from molt_nb.core import Result

shared = load_module(Path(__file__).resolve().parent.parent / 'tool_openai' / 'agent.py')
tasks, demos, call_tool, MAX_TURNS = shared.tasks, shared.demos, shared.call_tool, shared.MAX_TURNS
PYTHON = dict(
    name='python',
    description=shared.PYTHON['function']['description'],
    input_schema=shared.PYTHON['function']['parameters'],
)


class PythonAgent(ChatAgent):
    async def run(self, ctx):
        client = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        messages, used, answer = ctx.messages, False, ''
        for _ in range(MAX_TURNS):
            m = await client.messages.create(
                model=ctx.model_name, max_tokens=ctx.sampling.max_tokens, messages=messages, tools=[PYTHON]
            )
            uses = [b for b in m.content if b.type == 'tool_use']
            if not uses:
                answer = ''.join(b.text for b in m.content if b.type == 'text')
                break
            messages = messages + [
                dict(
                    role='assistant',
                    content=[b.model_dump(include={'type', 'id', 'name', 'input', 'text'}) for b in m.content],
                )
            ]
            results = []
            for b in uses:
                out = await call_tool(b.name, shared.json.dumps(b.input))
                used |= not out.startswith(('error:', 'Traceback', 'TimeoutError'))
                results.append(dict(type='tool_result', tool_use_id=b.id, content=out))
            messages.append(dict(role='user', content=results))
        return Result(
            reward=shared.score(answer, ctx.label, used), info=dict(used_tool=float(used), turns=float(len(messages)))
        )


def AgentRunner(tokenizer, max_context: int = 1024):
    return ChatAgentRunner(PythonAgent, tokenizer, max_context=max_context)
