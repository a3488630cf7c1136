"""The chat server against the real OpenAI and Anthropic SDKs (async clients, streaming and not), backed by a
TorchEngine.

Tool-call round trips need a model that emits tool calls: the tiny model is warm-started on three demonstrations
(two parallel tool calls, then an answer, then a reply to a nudge) and decoded greedily, so every token still comes
from the engine's own sampling. Token identity is checked two ways: `check_token_identity` (the loop's own check:
trained ids, logprobs and versions equal what the engine returned) and a spy on the engine's prompts (every prompt
equals the chat template's rendering of the conversation the client sent: no lost messages, no lost glue)."""

import asyncio, copy, json
import pytest, torch
import anthropic, httpx2, openai
from molt_nb.agents import ChatAgent, ChatAgentRunner
from molt_nb.chat import encode, render
from molt_nb.chat_server import ChatServer
from molt_nb.core import Result, SamplingParams, collate
from molt_nb.engine import TorchEngine
from molt_nb.loop import check_token_identity
from molt_nb.models import tiny_dense
from molt_nb.pool import Recorder

from chat_helpers import (
    ANSWER,
    ANTHROPIC_TOOLS,
    GREEDY,
    OPENAI_TOOLS,
    TOK,
    USER,
    YES,
    Spy,
    tool_model,  # noqa: F401 (a fixture)
)


async def _serve(model, version=0, **options):
    engine = TorchEngine(copy.deepcopy(model), seed=0, version=version)
    return engine, await ChatServer(TOK, **options).start()


async def _session(model, max_context: int = 2048, version: int = 0):
    "A served engine behind a Spy, one session on it, and an OpenAI and an Anthropic client for that session"
    engine, server = await _serve(model, version=version)
    spy = Spy(engine)
    s = server.open(spy, GREEDY, max_context)
    oa = openai.AsyncOpenAI(base_url=server.base_url(s.id), api_key=server.token, max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=server.session_url(s.id), api_key=server.token, max_retries=0)
    return engine, server, spy, s, oa, an


def _check_identity(spy: Spy, session, convs: list, tools):
    """Each engine prompt is the template's rendering of the client's conversation; the segments hold exactly the
    prompts' deltas and the samples"""
    assert len(spy.calls) == len(convs)
    for (prompt, gen), conv in zip(spy.calls, convs):
        assert prompt == encode(TOK, render(TOK, conv, True, tools)), (
            'an engine prompt differs from the canonical rendering'
        )
    seg = session.segments[-1]
    last_prompt, last = spy.calls[-1]
    assert seg.token_ids.tolist() == last_prompt + last.token_ids.tolist()
    sampled = torch.cat([g.token_ids for _, g in spy.calls])
    assert torch.equal(torch.cat([s.token_ids[s.action_mask] for s in session.segments]), sampled)
    assert torch.equal(
        torch.cat([s.logprobs[s.action_mask] for s in session.segments]), torch.cat([g.logprobs for _, g in spy.calls])
    )
    assert torch.equal(
        torch.cat([s.versions[s.action_mask] for s in session.segments]), torch.cat([g.versions for _, g in spy.calls])
    )


# --- OpenAI wire -------------------------------------------------------------------------------------------


@pytest.mark.parametrize('stream', [False, True])
def test_openai_tool_calls_round_trip(tool_model, stream):
    async def main():
        engine, server, spy, s, client, _ = await _session(tool_model, version=3)

        async def ask(messages):
            if not stream:
                r = await client.chat.completions.create(model='policy', messages=messages, tools=OPENAI_TOOLS)
                return r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason, r.usage
            msg, finish, usage, calls = dict(role='assistant', content=''), None, None, {}
            async for ch in await client.chat.completions.create(
                model='policy',
                messages=messages,
                tools=OPENAI_TOOLS,
                stream=True,
                stream_options=dict(include_usage=True),
            ):
                usage = ch.usage or usage
                for c in ch.choices:
                    msg['content'] += c.delta.content or ''
                    for t in c.delta.tool_calls or []:
                        calls[t.index] = dict(
                            id=t.id,
                            type='function',
                            function=dict(name=t.function.name, arguments=t.function.arguments),
                        )
                    finish = c.finish_reason or finish
            if calls:
                msg['tool_calls'] = [calls[i] for i in sorted(calls)]
            return msg, finish, usage

        conv = [USER]
        m1, finish1, usage1 = await ask(conv)
        assert finish1 == 'tool_calls' and m1.get('content') in ('', None)
        assert [(c['function']['name'], json.loads(c['function']['arguments'])) for c in m1['tool_calls']] == [
            ('add', dict(a=1, b=2)),
            ('add', dict(a=3, b=4)),
        ]
        results = [
            dict(role='tool', tool_call_id=c['id'], content=str(sum(json.loads(c['function']['arguments']).values())))
            for c in m1['tool_calls']
        ]
        await engine.load_weights({}, 4)  # a new policy version between turns: the next tokens carry it
        conv2 = conv + [m1, *results]
        m2, finish2, usage2 = await ask(conv2)
        assert (m2['content'], finish2) == (ANSWER, 'stop')
        conv3 = conv2 + [m2, dict(role='user', content='Sure?')]
        m3, finish3, _ = await ask(conv3)
        assert (m3['content'], finish3) == (YES, 'stop')
        # both tool results reached the model, and everything stayed in one token-exact segment
        prompt2 = TOK.decode(spy.calls[1][0])
        assert '<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>' in prompt2
        assert len(s.segments) == 1
        canonical = [
            dict(role='user', content=USER['content']),
            _as_canonical(m1),
            *results,
            _as_canonical(m2),
            dict(role='user', content='Sure?'),
        ]
        _check_identity(spy, s, [canonical[:1], canonical[:4], canonical[:6]], OPENAI_TOOLS)
        assert (usage1.completion_tokens, usage2.completion_tokens) == (len(spy.calls[0][1]), len(spy.calls[1][1]))
        assert (usage1.prompt_tokens, usage2.prompt_tokens) == (len(spy.calls[0][0]), len(spy.calls[1][0]))
        assert set(s.segments[0].versions[s.segments[0].action_mask].tolist()) == {3, 4}
        await server.stop()
        engine.close()

    asyncio.run(main())


def _as_canonical(m: dict) -> dict:
    out = dict(role='assistant', content=m.get('content') or '')
    if m.get('tool_calls'):
        out['tool_calls'] = m['tool_calls']
    return out


def test_retry_returns_cached_reply_and_records_nothing(tool_model):
    async def main():
        engine, server, spy, s, client, _ = await _session(tool_model)
        first = await client.chat.completions.create(model='policy', messages=[USER], tools=OPENAI_TOOLS)
        before = s.segments[0]
        # the SDK's own retry of the same request (it sends x-stainless-retry-count > 0); a first attempt would be a new
        # sample
        again = await client.chat.completions.create(
            model='policy', messages=[USER], tools=OPENAI_TOOLS, extra_headers={'x-stainless-retry-count': '1'}
        )
        assert again.id == first.id and again.choices[0].message == first.choices[0].message
        assert len(spy.calls) == 1 and s.segments == [before]
        await server.stop()
        engine.close()

    asyncio.run(main())


# --- Anthropic wire ----------------------------------------------------------------------------------------


@pytest.mark.parametrize('stream', [False, True])
def test_anthropic_tool_use_round_trip(tool_model, stream):
    async def main():
        engine, server, spy, s, _, client = await _session(tool_model)

        async def ask(messages):
            if not stream:
                return await client.messages.create(
                    model='policy', max_tokens=200, messages=messages, tools=ANTHROPIC_TOOLS
                )
            async with client.messages.stream(
                model='policy', max_tokens=200, messages=messages, tools=ANTHROPIC_TOOLS
            ) as st:
                return await st.get_final_message()

        m1 = await ask([USER])
        assert m1.stop_reason == 'tool_use'
        uses = [b for b in m1.content if b.type == 'tool_use']
        assert [(b.name, b.input) for b in uses] == [('add', dict(a=1, b=2)), ('add', dict(a=3, b=4))]
        assert m1.usage.output_tokens == len(spy.calls[0][1]) and m1.usage.input_tokens == len(spy.calls[0][0])
        echo = [b.model_dump(exclude_none=True, include={'type', 'id', 'name', 'input', 'text'}) for b in m1.content]
        results = dict(
            role='user',
            content=[
                dict(type='tool_result', tool_use_id=b.id, content=str(b.input['a'] + b.input['b'])) for b in uses
            ],
        )
        m2 = await ask([USER, dict(role='assistant', content=echo), results])
        assert (m2.content[0].text, m2.stop_reason) == (ANSWER, 'end_turn')
        assert '<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>' in TOK.decode(
            spy.calls[1][0]
        )
        assert len(s.segments) == 1
        calls = [
            dict(id=b.id, type='function', function=dict(name=b.name, arguments=json.dumps(b.input))) for b in uses
        ]
        canonical = [
            USER,
            dict(role='assistant', content='', tool_calls=calls),
            *[dict(role='tool', content=r['content'], tool_call_id=r['tool_use_id']) for r in results['content']],
        ]
        _check_identity(spy, s, [canonical[:1], canonical], OPENAI_TOOLS)
        await server.stop()
        engine.close()

    asyncio.run(main())


# --- compaction, through the ChatAgentRunner ---------------------------------------------------------------


class Compacting(ChatAgent):
    "Uses the tools, then compacts its history (drops the tool exchange) before the last question"

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        r1 = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, tools=OPENAI_TOOLS)
        calls = r1.choices[0].message.tool_calls
        results = [dict(role='tool', tool_call_id=c.id, content='3' if i == 0 else '7') for i, c in enumerate(calls)]
        conv = ctx.messages + [r1.choices[0].message.model_dump(exclude_none=True), *results]
        r2 = await client.chat.completions.create(model=ctx.model_name, messages=conv, tools=OPENAI_TOOLS)
        compacted = ctx.messages + [
            dict(role='user', content='Summary: the sums are 3 and 7.'),
            dict(role='user', content='Sure?'),
        ]
        r3 = await client.chat.completions.create(model=ctx.model_name, messages=compacted, tools=OPENAI_TOOLS)
        return Result(
            reward=0.75,
            info=dict(
                answer=float(r2.choices[0].message.content == ANSWER), last=len(r3.choices[0].message.content or '')
            ),
        )


def test_compaction_seals_a_segment_sharing_rollout_and_reward(tool_model):
    async def main():
        engine = TorchEngine(copy.deepcopy(tool_model), seed=0)
        runner, record = ChatAgentRunner(Compacting, TOK, max_context=2048), Recorder(engine)
        tr = await runner.run(record, dict(prompt=USER['content']), GREEDY, 'g0/r0', 'g0')
        assert tr.info['answer'] == 1.0
        assert len(tr.segments) == 2 and tr.reward == 0.75
        batch = collate([tr])
        assert (
            batch.rollout_ids == ['g0/r0', 'g0/r0']
            and batch.rewards.tolist() == [0.75, 0.75]
            and batch.segment_index.tolist() == [0, 1]
        )
        assert check_token_identity([tr], {'g0/r0': record.generations}, batch) == sum(
            len(g) for g in record.generations
        )
        # the second segment starts from the re-templated compacted conversation
        compacted = [
            USER,
            dict(role='user', content='Summary: the sums are 3 and 7.'),
            dict(role='user', content='Sure?'),
        ]
        second = tr.segments[1]
        assert second.token_ids[~second.action_mask].tolist() == encode(TOK, render(TOK, compacted, True, OPENAI_TOOLS))
        await (await runner.server()).stop()
        engine.close()

    asyncio.run(main())


# --- bad and hostile input ---------------------------------------------------------------------------------


def test_bad_input_gets_4xx_in_the_wire_format_and_leaves_the_session_intact(tool_model):
    async def main():
        engine, server, spy, s, oa, an = await _session(tool_model, max_context=1024)
        r1 = await oa.chat.completions.create(model='policy', messages=[USER], tools=OPENAI_TOOLS)
        state = (list(s.segments), s.key, s.turns)
        m1 = r1.choices[0].message.model_dump(exclude_none=True)

        async def refused(call, error, status, contains):
            with pytest.raises(error) as e:
                await call
            assert e.value.status_code == status and contains in str(e.value), str(e.value)
            assert (list(s.segments), s.key, s.turns) == state and len(spy.calls) == 1

        wrong = openai.AsyncOpenAI(base_url=server.base_url(s.id), api_key='not-the-token', max_retries=0)
        await refused(
            wrong.chat.completions.create(model='policy', messages=[USER]),
            openai.AuthenticationError,
            401,
            'wrong API key',
        )
        await refused(
            anthropic.AsyncAnthropic(base_url=server.session_url(s.id), api_key='x', max_retries=0).messages.create(
                model='policy', max_tokens=5, messages=[USER]
            ),
            anthropic.AuthenticationError,
            401,
            'wrong API key',
        )
        gone = openai.AsyncOpenAI(base_url=server.base_url('nosuchsession'), api_key=server.token, max_retries=0)
        await refused(
            gone.chat.completions.create(model='policy', messages=[USER]), openai.NotFoundError, 404, 'does not exist'
        )
        await refused(
            oa.chat.completions.create(model='gpt-5', messages=[USER]),
            openai.NotFoundError,
            404,
            "model 'gpt-5' is not served here",
        )
        await refused(
            an.messages.create(model='claude', max_tokens=5, messages=[USER]),
            anthropic.NotFoundError,
            404,
            "model 'claude' is not served here",
        )
        bad_args = dict(m1, tool_calls=[dict(m1['tool_calls'][0], function=dict(name='add', arguments='{"a": 1,'))])
        await refused(
            oa.chat.completions.create(
                model='policy', messages=[USER, bad_args, dict(role='tool', tool_call_id='x', content='3')]
            ),
            openai.BadRequestError,
            400,
            'arguments is not JSON',
        )
        await refused(
            an.messages.create(
                model='policy',
                max_tokens=5,
                messages=[
                    USER,
                    dict(role='assistant', content=[dict(type='tool_use', id='t', name='add', input='{"a": 1')]),
                ],
            ),
            anthropic.BadRequestError,
            400,
            'tool_use input is a JSON object',
        )
        long = dict(role='user', content='x' * 1100)
        await refused(
            oa.chat.completions.create(model='policy', messages=[long]),
            openai.BadRequestError,
            400,
            'context holds 1024',
        )
        await refused(
            an.messages.create(model='policy', max_tokens=5, messages=[long]),
            anthropic.BadRequestError,
            400,
            'context holds 1024',
        )
        await refused(
            oa.chat.completions.create(model='policy', messages=[USER], n=2),
            openai.BadRequestError,
            400,
            'one choice per request',
        )
        await refused(
            oa.chat.completions.create(model='policy', messages=[USER], stop=['sums']),
            openai.BadRequestError,
            400,
            'not a single token',
        )
        # raw HTTP: malformed JSON and missing token, with each wire's error body
        async with httpx2.AsyncClient() as http:
            for url, wire in (
                (f"{server.base_url(s.id)}/chat/completions", 'openai'),
                (f"{server.session_url(s.id)}/v1/messages", 'anthropic'),
            ):
                res = await http.post(
                    url,
                    content=b'{"model": "policy", "messages": [',
                    headers=dict(authorization=f"Bearer {server.token}", **{'content-type': 'application/json'}),
                )
                body = res.json()
                assert res.status_code == 400
                assert (
                    (body['error']['type'] == 'invalid_request_error' and 'not valid JSON' in body['error']['message'])
                    if wire == 'openai'
                    else (
                        body['type'] == 'error'
                        and body['error']['type'] == 'invalid_request_error'
                        and 'not valid JSON' in body['error']['message']
                    )
                )
                res = await http.post(url, json=dict(model='policy', messages=[USER], max_tokens=5))
                assert res.status_code == 401 and ('no API key' in json.dumps(res.json()))
                res = await http.post(
                    url, json=dict(messages=[USER]), headers=dict(authorization=f"Bearer {server.token}")
                )
                assert res.status_code == 400 and 'model' in json.dumps(res.json())
            res = await http.get(f"{server.url}/v1/models")
            assert res.status_code == 401
            res = await http.get(f"{server.url}/v1/models", headers=dict(authorization=f"Bearer {server.token}"))
            assert res.json()['data'][0]['id'] == 'policy'
            assert (await http.get(f"{server.url}/health")).json() == dict(status='ok')
            res = await http.post(
                f"{server.url}/s/{s.id}/v1/embeddings", headers=dict(authorization=f"Bearer {server.token}"), json={}
            )
            assert res.status_code == 404 and res.json()['error']['type'] == 'not_found_error'
        assert (list(s.segments), s.key, s.turns) == state
        # the session goes on as if nothing happened: the next turn extends the same segment
        results = [dict(role='tool', tool_call_id=c['id'], content=v) for c, v in zip(m1['tool_calls'], '37')]
        r2 = await oa.chat.completions.create(model='policy', messages=[USER, m1, *results], tools=OPENAI_TOOLS)
        assert r2.choices[0].message.content == ANSWER and len(s.segments) == 1 and s.turns == 2
        await server.stop()
        engine.close()

    asyncio.run(main())


def test_binds_loopback_by_default_and_always_requires_the_token(tool_model):
    async def main():
        engine, server = await _serve(tool_model)
        assert server._server.servers[0].sockets[0].getsockname()[0] == '127.0.0.1'
        other = await ChatServer(
            TOK, host='127.0.0.2'
        ).start()  # a configured address (still on loopback, as tests must be)
        assert other._server.servers[0].sockets[0].getsockname()[0] == '127.0.0.2' and other.token != server.token
        s = other.open(engine, GREEDY, 1024)
        async with httpx2.AsyncClient() as http:
            url = f"{other.base_url(s.id)}/chat/completions"
            assert (await http.post(url, json=dict(model='policy', messages=[USER]))).status_code == 401
            assert (
                await http.post(
                    url,
                    json=dict(model='policy', messages=[USER]),
                    headers=dict(authorization=f"Bearer {server.token}"),
                )
            ).status_code == 401
            assert (
                await http.post(
                    url, json=dict(model='policy', messages=[USER]), headers=dict(authorization=f"Bearer {other.token}")
                )
            ).status_code == 200
        await other.stop()
        await server.stop()
        engine.close()

    asyncio.run(main())


# --- many sessions at once ---------------------------------------------------------------------------------


class Chatty(ChatAgent):
    "Three turns, each with its own marker, through either wire"

    async def run(self, ctx):
        k = ctx.task['k']
        if k % 2:
            client = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
            messages = [dict(role='user', content=f"session {k}")]
            for turn in range(3):
                m = await client.messages.create(
                    model=ctx.model_name, max_tokens=8, messages=messages, stream=turn == 1
                )
                if turn == 1:  # a raw event stream: rebuild the text
                    text = ''.join([e.delta.text async for e in m if e.type == 'content_block_delta'])
                else:
                    text = m.content[0].text
                messages += [dict(role='assistant', content=text), dict(role='user', content=f"turn {turn} of {k}")]
        else:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            messages = [dict(role='user', content=f"session {k}")]
            for turn in range(3):
                r = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=8)
                messages += [
                    r.choices[0].message.model_dump(exclude_none=True),
                    dict(role='user', content=f"turn {turn} of {k}"),
                ]
        return Result(reward=float(k))


def test_32_concurrent_sessions_do_not_interleave():
    async def main():
        torch.manual_seed(0)
        engine = TorchEngine(tiny_dense(TOK), seed=0)
        runner = ChatAgentRunner(Chatty, TOK, max_context=512)
        sampling = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(TOK.eos_token_id,))
        records = {f"g{k}/r0": Recorder(engine) for k in range(32)}
        trs = await asyncio.gather(
            *[runner.run(records[f"g{k}/r0"], dict(k=k), sampling, f"g{k}/r0", f"g{k}") for k in range(32)]
        )
        batch = collate(trs)
        checked = check_token_identity(trs, {rid: r.generations for rid, r in records.items()}, batch)
        assert checked == sum(len(g) for r in records.values() for g in r.generations) and checked > 0
        for k, tr in enumerate(trs):
            assert tr.reward == k and len(tr.segments) == 1 and len(records[tr.rollout_id].generations) == 3
            text = TOK.decode(tr.segments[0].token_ids[~tr.segments[0].action_mask])
            assert text.startswith(f"<|im_start|>user\nsession {k}<|im_end|>") and text.count(f" of {k}<|im_end|>") == 2
            assert all(f"session {j}<" not in text for j in range(32) if j != k)
        assert (await runner.server()).sessions == {}
        await (await runner.server()).stop()
        engine.close()

    asyncio.run(main())
