"""Hostile clients against the real chat server over real HTTP (issue 16, "a chat server that nothing stalls").

Every class of hostile input gets a 4xx in its wire's own error shape within a second, `/health` keeps answering
while the worst of them (10 MB bodies) are refused, and the session answers the next good request as if nothing
had happened. The SDK checks use the real openai/anthropic clients with retries on, counting what they send.
The last test runs 64 streaming clients (half of them hang up early) on the server's own event loop, as a
ChatAgentRunner's agents are, backed by a real TorchEngine, and polls `/health` from another thread meanwhile.
"""

import asyncio, json, logging, statistics, threading, time
import pytest, torch
import anthropic, httpx2, openai
from molt_nb.chat_server import ChatLimits, ChatServer
from molt_nb.core import SamplingParams
from molt_nb.engine import TorchEngine
from molt_nb.models import build_tokenizer, tiny_dense

TOK = build_tokenizer()
SAMPLING = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(TOK.eos_token_id,))
USER = dict(role='user', content='Hi')
MB10 = 10 << 20


@pytest.fixture(scope='module')
def model():
    torch.manual_seed(0)
    return tiny_dense(TOK).eval()


async def _serve(model, max_context=512, **limits):
    "A served engine with one session, the session's two endpoints and the auth header"
    engine = TorchEngine(model, seed=0)
    server = await ChatServer(TOK, limits=ChatLimits(**limits)).start()
    s = server.open(engine, SAMPLING, max_context)
    urls = dict(openai=f"{server.base_url(s.id)}/chat/completions", anthropic=f"{server.session_url(s.id)}/v1/messages")
    return engine, server, s, urls, dict(authorization=f"Bearer {server.token}")


def _good(wire: str, k: int) -> dict:
    body = dict(model='policy', messages=[dict(role='user', content=f"Hello {k}")])
    return body | dict(max_tokens=8) if wire == 'anthropic' else body


async def _check_serves(http, s, urls, auth, wire: str, k: int):
    "The next good request is a 200 whose reply is the turn the session recorded"
    turns = s.turns
    res = await http.post(urls[wire], headers=auth, json=_good(wire, k))
    assert res.status_code == 200, res.text
    body = res.json()
    used = body['usage']['completion_tokens' if wire == 'openai' else 'output_tokens']
    assert s.turns == turns + 1 and used == s.segments[-1].num_actions > 0
    if wire == 'openai':
        assert body['object'] == 'chat.completion' and body['choices'][0]['finish_reason'] in ('stop', 'length')
    else:
        assert body['type'] == 'message' and body['stop_reason'] in ('end_turn', 'max_tokens')


def _check_error(res, wire: str, status: int, contains: str):
    "A 4xx in the wire's own error shape, with a message that says what went wrong"
    assert res.status_code == status, (res.status_code, res.text[:300])
    body = res.json()
    if wire == 'anthropic':
        assert body['type'] == 'error' and set(body['error']) == {'type', 'message'}, body
    else:
        assert set(body) == {'error'} and {'message', 'type', 'param', 'code'} <= set(body['error']), body
    assert contains in body['error']['message'], body['error']['message']
    assert res.headers['x-should-retry'] == 'false'


def _nested(depth: int) -> str:
    return '[' * depth + ']' * depth


def _schema(depth: int) -> dict:
    "A JSON schema nested `depth` JSON levels deep (an object property is two levels: properties, then the property)"
    out = dict(type='string')
    for _ in range(depth // 2):
        out = dict(type='object', properties=dict(x=out))
    return out


def _many_calls(n: int) -> list:
    return [dict(id=f"c{i}", type='function', function=dict(name='add', arguments='{}')) for i in range(n)]


def _hostile(wire: str) -> list:
    "(name, raw body, status, what the message says) for every class of hostile input on one wire"
    good = _good(wire, 0)
    raw = lambda **over: json.dumps(good | over).encode()
    user = lambda content: raw(messages=[dict(role='user', content=content)])
    cases = [
        ('10 MB with Content-Length', b' ' * MB10, 413, 'ChatLimits.max_body_bytes'),
        ('3000 messages', raw(messages=[USER] * 3000), 400, 'ChatLimits.max_messages'),
        (
            'nesting depth 5000',
            user('X').replace(b'"X"', _nested(5000).encode()),
            400,
            'more than 64 levels deep (ChatLimits.max_depth)',
        ),
        (
            '5000-digit integer',
            raw(max_tokens=1).replace(b'"max_tokens": 1', b'"max_tokens": ' + b'9' * 5000),
            400,
            'integer of 5000 digits',
        ),
        ('NaN', raw(max_tokens=1).replace(b'"max_tokens": 1', b'"max_tokens": NaN'), 400, 'not JSON'),
        ('lone surrogate', user('a\ud800b'), 400, 'lone surrogate'),
        ('CESU-8 surrogate bytes', user('aXb').replace(b'X', b'\xed\xa0\x80'), 400, 'not valid UTF-8'),
        ('invalid UTF-8', user('aXb').replace(b'X', b'\xff\xfe'), 400, 'not valid UTF-8'),
        ('truncated JSON', raw()[:-3], 400, 'not valid JSON'),
        ('body is a list', b'[]', 400, 'send a JSON object'),
        ('model is a number', raw(model=5), 400, 'model'),
        ('messages is a string', raw(messages='hi'), 400, 'messages'),
        ('message is a number', raw(messages=[5]), 400, 'messages[0]'),
        ('role is a list', raw(messages=[dict(role=['user'], content='x')]), 400, 'role'),
        ('content is a number', raw(messages=[dict(role='user', content=5)]), 400, 'messages[0].content'),
        ('content part is a number', raw(messages=[dict(role='user', content=[5])]), 400, 'messages[0].content[0]'),
        (
            'text is a number',
            raw(messages=[dict(role='user', content=[dict(type='text', text=5)])]),
            400,
            'messages[0].content[0]',
        ),
        (
            '2000 content parts',
            raw(messages=[dict(role='user', content=[dict(type='text', text='a')] * 2000)]),
            400,
            'ChatLimits.max_parts',
        ),
        ('max_tokens is a word', raw(max_tokens='many'), 400, 'max_tokens'),
        ('max_tokens is a float', raw(max_tokens=1.5), 400, 'max_tokens'),
        ('max_tokens is 0', raw(max_tokens=0), 400, 'at least one token'),
        ('max_tokens is a string of digits', raw(max_tokens='8'), 400, 'max_tokens: Input should be a valid integer'),
        ('stream is a string', raw(stream='true'), 400, 'stream: Input should be a valid boolean'),
        ('stream is a list', raw(stream=[]), 400, 'stream'),
        ('tools is a string', raw(tools='x'), 400, 'tools'),
        ('tool is a number', raw(tools=[5]), 400, 'tools[0]'),
    ]
    if wire == 'openai':
        tool = lambda params: dict(type='function', function=dict(name='f', parameters=params))
        calls = lambda c: raw(messages=[USER, dict(role='assistant', content='', tool_calls=c)])
        cases += [
            ('200 tools', raw(tools=[tool({})] * 200), 400, 'ChatLimits.max_tools'),
            ('tool schema nested 900 deep', raw(tools=[tool(_schema(900))]), 400, 'more than 64 levels deep'),
            ('200 tool calls', calls(_many_calls(200)), 400, 'ChatLimits.max_tool_calls'),
            ('5 stops', raw(stop=[f"s{i}" for i in range(5)]), 400, 'at most 4'),
            (
                'tool_choice function is a string',
                raw(tool_choice=dict(type='function', function='f')),
                400,
                "tool_choice is {",
            ),
            (
                'tool_choice function is a list',
                raw(tool_choice=dict(type='function', function=['f'])),
                400,
                "tool_choice is {",
            ),
            (
                'tool_choice names an unknown tool',
                raw(tools=[tool({})], tool_choice=dict(type='function', function=dict(name='nope'))),
                400,
                'not among the request',
            ),
            ('tool_choice is a made-up word', raw(tool_choice='bogus'), 400, "send 'auto' or 'none'"),
            (
                '1e400',
                raw(max_tokens=1).replace(b'"max_tokens": 1', b'"max_tokens": 1e400'),
                400,
                "beyond a double's range",
            ),
            ('stop is a number', raw(stop=5), 400, 'stop'),
            ('tool_calls is an object', calls({'a': 1}), 400, 'tool_calls is a dict'),
            ('tool call is a string', calls(['x']), 400, 'tool_calls[0] is not a tool call'),
            (
                'function is a string',
                calls([dict(id='c', type='function', function='x')]),
                400,
                'tool_calls[0] is not a tool call',
            ),
            (
                'tool call id is a number',
                calls([dict(id=5, type='function', function=dict(name='f', arguments='{}'))]),
                400,
                'not a tool call',
            ),
            (
                'arguments nested 3000 deep',
                calls([dict(id='c', type='function', function=dict(name='f', arguments=_nested(3000)))]),
                400,
                'arguments nests more than 64 levels deep',
            ),
            (
                'arguments with a 5000-digit integer',
                calls([dict(id='c', type='function', function=dict(name='f', arguments='{"a": ' + '9' * 5000 + '}'))]),
                400,
                'integer of 5000 digits',
            ),
            (
                'arguments are a number',
                calls([dict(id='c', type='function', function=dict(name='f', arguments=5))]),
                400,
                'arguments',
            ),
            (
                'tool_call_id is a number',
                raw(messages=[USER, dict(role='tool', content='3', tool_call_id=5)]),
                400,
                'tool_call_id',
            ),
            ('function tool is a string', raw(tools=[dict(type='function', function='x')]), 400, 'tools[0]'),
            ('n is a word', raw(n='x'), 400, 'n'),
            ('n is a string of digits', raw(n='1'), 400, 'n: Input should be a valid integer'),
            ('max_completion_tokens is 0', raw(max_completion_tokens=0), 400, 'max_completion_tokens is 0'),
            (
                'max_completion_tokens is a string of digits',
                raw(max_completion_tokens='8'),
                400,
                'max_completion_tokens: Input should be a valid integer',
            ),
            ('stream_options is a number', raw(stream_options=5), 400, 'stream_options'),
        ]
    else:
        use = lambda **b: raw(
            messages=[USER, dict(role='assistant', content=[dict(type='tool_use', id='t', name='f', input={}) | b])]
        )
        cases += [
            ('200 tools', raw(tools=[dict(name='f', input_schema={})] * 200), 400, 'ChatLimits.max_tools'),
            (
                'tool schema nested 900 deep',
                raw(tools=[dict(name='f', input_schema=_schema(900))]),
                400,
                'more than 64 levels deep',
            ),
            (
                '200 tool_use blocks',
                raw(
                    messages=[
                        USER,
                        dict(
                            role='assistant',
                            content=[dict(type='tool_use', id=f't{i}', name='f', input={}) for i in range(200)],
                        ),
                    ]
                ),
                400,
                'ChatLimits.max_tool_calls',
            ),
            ('9 stop sequences', raw(stop_sequences=[f"s{i}" for i in range(9)]), 400, 'at most 8'),
            ('tool_choice without a type', raw(tool_choice=dict(name='f')), 400, "send 'auto' or 'none'"),
            ('stop_sequences is a string', raw(stop_sequences='x'), 400, 'stop_sequences'),
            ('max_tokens missing', json.dumps(dict(model='policy', messages=[USER])).encode(), 400, 'max_tokens'),
            ('system is a number', raw(system=5), 400, 'system'),
            ('system block is a number', raw(system=[5]), 400, 'system[0]'),
            ('block is a number', raw(messages=[dict(role='user', content=[5])]), 400, 'messages[0].content[0]'),
            ('image block', raw(messages=[dict(role='user', content=[dict(type='image')])]), 400, 'reads text only'),
            ('tool_use input is a string', use(input='x'), 400, 'input'),
            ('tool_use name is a number', use(name=5), 400, 'name'),
            (
                'tool_result content is a number',
                raw(messages=[dict(role='user', content=[dict(type='tool_result', tool_use_id='t', content=5)])]),
                400,
                'content',
            ),
            ('tool is not a custom tool', raw(tools=[dict(name='f')]), 400, 'tools[0]'),
        ]
    return cases


@pytest.mark.parametrize('wire', ['openai', 'anthropic'])
def test_each_hostile_input_is_a_quick_4xx_in_the_wire_shape_and_the_session_serves_on(model, wire):
    async def main():
        engine, server, s, urls, auth = await _serve(model)
        async with httpx2.AsyncClient(timeout=30) as http:
            await _check_serves(http, s, urls, auth, wire, 0)
            problems, times = [], []  # every class is tried, so a failure lists all the classes that fail
            for k, (name, body, status, contains) in enumerate(_hostile(wire)):
                state = (list(s.segments), s.key, s.turns)
                start = time.perf_counter()
                res = await http.post(urls[wire], headers=auth | {'content-type': 'application/json'}, content=body)
                took = time.perf_counter() - start
                times.append(took)
                try:
                    _check_error(res, wire, status, contains)
                    assert took < 1.0, f"refused after {took:.2f} s"
                    assert (list(s.segments), s.key, s.turns) == state, 'the session changed'
                except (AssertionError, KeyError, ValueError) as e:
                    problems.append(f"{name}: {str(e)[:200]}")
                await _check_serves(http, s, urls, auth, wire, k + 1)
        print(f"{wire}: {len(_hostile(wire))} hostile classes, slowest refusal {max(times) * 1000:.0f} ms")
        assert not problems, '\n'.join(problems)
        await server.stop()
        engine.close()

    asyncio.run(main())


def test_nul_characters_are_text(model):
    "NUL is valid JSON and valid Unicode: accepted in user content and tool output, and it reaches the prompt"

    async def main():
        engine, server, s, urls, auth = await _serve(model)
        body = dict(
            model='policy',
            messages=[
                dict(role='user', content='a\x00b'),
                dict(role='assistant', content='ok'),
                dict(role='user', content='c\x00d'),
            ],
        )
        async with httpx2.AsyncClient(timeout=30) as http:
            res = await http.post(urls['openai'], headers=auth, json=body)
        assert res.status_code == 200, res.text
        prompt = TOK.decode(s.segments[-1].token_ids[~s.segments[-1].action_mask])
        assert 'a\x00b' in prompt and 'c\x00d' in prompt
        await server.stop()
        engine.close()

    asyncio.run(main())


def test_wrong_auth_is_refused_before_the_body_is_read(model):
    async def main():
        engine, server, s, urls, auth = await _serve(model)
        async with httpx2.AsyncClient(timeout=30) as http:
            for wire in ('openai', 'anthropic'):
                for headers, says in (
                    ({}, 'no API key'),
                    (dict(authorization='Bearer nope'), 'a wrong API key'),
                    ({'x-api-key': 'nope'}, 'a wrong API key'),
                ):
                    start = time.perf_counter()
                    res = await http.post(urls[wire], headers=headers, content=b' ' * MB10)
                    _check_error(res, wire, 401, says)
                    assert time.perf_counter() - start < 1.0
                await _check_serves(http, s, urls, auth, wire, 1)
        await server.stop()
        engine.close()

    asyncio.run(main())


class _Held:
    "An engine whose turns wait until released: their requests stay in flight"

    def __init__(self, engine):
        self.engine, self.release, self.waiting = engine, asyncio.Event(), 0

    async def generate(self, token_ids, sampling, session_id=None):
        self.waiting += 1
        await self.release.wait()
        return await self.engine.generate(token_ids, sampling, session_id)


def test_requests_past_max_connections_get_a_503_in_the_wire_shape_and_the_server_recovers(model):
    """Beyond ChatLimits.max_connections requests in flight a request is a 503 in its wire's JSON shape; idle
    connections count for nothing (they are ChatLimits.max_pending's)"""

    async def main():
        engine, server, s, urls, auth = await _serve(model, max_connections=8)
        held = _Held(engine)
        busy = [server.open(held, SAMPLING, 512) for _ in range(8)]
        idle = [await asyncio.open_connection('127.0.0.1', server.port) for _ in range(8)]
        async with httpx2.AsyncClient(timeout=10, limits=httpx2.Limits(max_connections=32)) as http:
            assert (await http.get(f"{server.url}/health")).status_code == 200
            flight = [
                asyncio.ensure_future(
                    http.post(f"{server.base_url(b.id)}/chat/completions", headers=auth, json=_good('openai', k))
                )
                for k, b in enumerate(busy)
            ]
            for _ in range(500):
                if held.waiting == 8:
                    break
                await asyncio.sleep(0.01)
            for wire in ('openai', 'anthropic'):
                res = await http.post(urls[wire], headers=auth, json=_good(wire, 0))
                _check_error(res, wire, 503, 'ChatLimits.max_connections')
                assert res.json()['error']['type'] == 'overloaded_error'
            held.release.set()
            assert [r.status_code for r in await asyncio.gather(*flight)] == [200] * 8
            await _check_serves(http, s, urls, auth, 'openai', 0)
        for _, writer in idle:
            writer.close()
        await server.stop()
        engine.close()

    asyncio.run(main())


def _chunks(size: int, chunk: int = 1 << 16):
    async def gen():
        for _ in range(size // chunk):
            yield b' ' * chunk

    return gen()


class Health:
    "Polls /health from its own thread (its own loop and connection) and keeps every latency"

    def __init__(self, url: str, every: float = 0.02):
        self.url, self.every, self.latencies, self.failures, self._stop = (
            f"{url}/health",
            every,
            [],
            [],
            threading.Event(),
        )
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx2.Client(timeout=10) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = http.get(self.url).json() == dict(status='ok')
                except Exception as e:
                    ok = repr(e)
                self.latencies.append(time.perf_counter() - start)
                if ok is not True:
                    self.failures.append(ok)
                time.sleep(self.every)

    async def __aenter__(self):
        self._thread.start()
        return self

    async def __aexit__(
        self, *exc
    ):  # joined off the loop: the poll in flight needs the server, which runs on this loop
        self._stop.set()
        await asyncio.to_thread(self._thread.join)

    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100, method='inclusive')[98]


def test_health_answers_while_10mb_bodies_are_refused(model):
    """413 on Content-Length, 413 while streaming a chunked body, and 400 from the character count when the limit allows
    10 MB"""

    async def main():
        engine, server, s, urls, auth = await _serve(model, max_body_bytes=16 << 20)
        small = await ChatServer(TOK).start()  # the default limit, 4 MiB
        t = small.open(engine, SAMPLING, 512)
        small_url = f"{small.base_url(t.id)}/chat/completions"
        small_auth = dict(authorization=f"Bearer {small.token}")
        huge = dict(model='policy', max_tokens=5, messages=[dict(role='user', content='x' * MB10)])
        async with httpx2.AsyncClient(timeout=60) as http:
            await _check_serves(
                http, s, urls, auth, 'openai', 0
            )  # warm up: the engine's first step holds the GIL for a while
            async with Health(server.url) as near, Health(small.url) as far:
                await asyncio.sleep(0.2)
                for wire in ('openai', 'anthropic'):
                    start = time.perf_counter()
                    res = await http.post(urls[wire], headers=auth, json=huge)
                    _check_error(res, wire, 400, 'context holds 512')
                    assert res.json()['error'].get('code', 'context_length_exceeded') == 'context_length_exceeded'
                    assert time.perf_counter() - start < 1.0
                    await _check_serves(http, s, urls, auth, wire, 1)
                for body in (lambda: b' ' * MB10, lambda: _chunks(MB10)):
                    start = time.perf_counter()
                    res = await http.post(small_url, headers=small_auth, content=body())
                    _check_error(res, 'openai', 413, 'takes at most 4194304 (ChatLimits.max_body_bytes)')
                    assert time.perf_counter() - start < 1.0
                    res = await http.post(small_url, headers=small_auth, json=_good('openai', 0))
                    assert res.status_code == 200
                await asyncio.sleep(0.1)
        print(
            f"/health max {max(near.latencies + far.latencies) * 1000:.0f} ms over "
            f"{len(near.latencies + far.latencies)} polls while 10 MB bodies were refused"
        )
        for h in (near, far):
            assert not h.failures and len(h.latencies) >= 10, (h.failures, len(h.latencies))
            assert max(h.latencies) < 0.1, f"/health took {max(h.latencies) * 1000:.0f} ms"
        await small.stop()
        await server.stop()
        engine.close()

    asyncio.run(main())


class _Broken:
    "An engine whose every call fails: a server-side bug as the client sees it"

    async def generate(self, token_ids, sampling, session_id=None):
        raise RuntimeError('the engine broke')


def test_sdks_do_not_retry_client_errors_or_server_bugs(model):
    async def main():
        engine, server, s, urls, auth = await _serve(model)
        broken = server.open(_Broken(), SAMPLING, 512)
        sent = []

        async def count(request):
            sent.append(request.url.path)

        def clients(session):
            http = httpx2.AsyncClient(event_hooks=dict(request=[count]))
            return (
                openai.AsyncOpenAI(
                    base_url=server.base_url(session.id), api_key=server.token, max_retries=2, http_client=http
                ),
                anthropic.AsyncAnthropic(
                    base_url=server.session_url(session.id), api_key=server.token, max_retries=2, http_client=http
                ),
            )

        oa, an = clients(s)
        for call, error, says in [
            (
                oa.chat.completions.create(model='policy', messages=[USER] * 3000),
                openai.BadRequestError,
                'ChatLimits.max_messages',
            ),
            (
                an.messages.create(
                    model='policy', max_tokens=5, messages=[USER], tools=[dict(name='f', input_schema=_schema(900))]
                ),
                anthropic.BadRequestError,
                'levels deep',
            ),
            (
                oa.chat.completions.create(
                    model='policy',
                    messages=[USER],
                    tools=[dict(type='function', function=dict(name='f', parameters=_schema(900)))],
                ),
                openai.BadRequestError,
                'levels deep',
            ),
            (
                oa.chat.completions.create(model='policy', messages=[dict(role='user', content='x' * MB10)]),
                openai.APIStatusError,
                'ChatLimits.max_body_bytes',
            ),
            (
                an.messages.create(model='policy', max_tokens=5, messages=[dict(role='user', content='x' * MB10)]),
                anthropic.APIStatusError,
                'ChatLimits.max_body_bytes',
            ),
        ]:
            sent.clear()
            with pytest.raises(error) as e:
                await call
            assert 400 <= e.value.status_code < 500 and says in str(e.value) and len(sent) == 1, (
                str(e.value)[:200],
                sent,
            )
        oa, an = clients(broken)
        for call, error in [
            (oa.chat.completions.create(model='policy', messages=[USER]), openai.InternalServerError),
            (an.messages.create(model='policy', max_tokens=5, messages=[USER]), anthropic.InternalServerError),
        ]:
            sent.clear()
            with pytest.raises(error) as e:
                await call
            assert e.value.status_code == 500 and 'a retry fails the same way' in str(e.value) and len(sent) == 1, (
                str(e.value)[:200],
                sent,
            )
        await server.stop()
        engine.close()

    asyncio.run(main())


# --- 64 clients at once ------------------------------------------------------------------------------------

ROUNDS, TOKENS = 16, 32


async def _client(http, server, s, k: int, round: int) -> str:
    """One streaming client: evens read the whole stream; odds hang up, before the reply (k % 4 == 1) or after its first
    event"""
    body = dict(
        model='policy',
        stream=True,
        max_tokens=TOKENS,
        messages=[dict(role='user', content=f"client {k}, round {round}")],
    )
    auth = dict(authorization=f"Bearer {server.token}")

    async def stream():
        async with http.stream('POST', f"{server.base_url(s.id)}/chat/completions", headers=auth, json=body) as res:
            assert res.status_code == 200
            events = []
            async for line in res.aiter_lines():
                if line.startswith('data: '):
                    events.append(line[6:])
                if k % 4 == 3:
                    return 'hung up mid-stream'
            assert events[-1] == '[DONE]' and json.loads(events[-2])['choices'][0]['finish_reason'] in (
                'stop',
                'length',
            )
            return 'read'

    if k % 4 != 1:
        return await stream()
    task = asyncio.ensure_future(stream())
    await asyncio.sleep(0.01 * (k % 7))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return 'hung up before the reply'


def test_64_streaming_clients_half_hanging_up_keep_health_fast_and_leak_nothing(model, caplog):
    async def main():
        engine = TorchEngine(model, seed=0)
        server = await ChatServer(TOK).start()
        sampling = SamplingParams(temperature=1.0, max_tokens=TOKENS, stop_token_ids=(TOK.eos_token_id,))
        before = {t for t in asyncio.all_tasks()}
        sessions = [server.open(engine, sampling, 512) for _ in range(64)]

        async def clients(rounds):  # on the server's loop, as a ChatAgentRunner's agents are
            async with httpx2.AsyncClient(timeout=60, limits=httpx2.Limits(max_connections=100)) as http:
                for round in rounds:
                    outcomes = await asyncio.gather(
                        *[_client(http, server, s, k, round) for k, s in enumerate(sessions)]
                    )
                    assert (
                        sorted(set(outcomes)) == ['hung up before the reply', 'hung up mid-stream', 'read']
                        and outcomes.count('read') == 32
                    )

        await clients([-1])  # warm up: the engine's first steps hold the GIL for a while
        async with Health(server.url) as health:
            await clients(range(ROUNDS))
        for _ in range(200):  # handlers of hung-up clients finish their turn on their own
            if not any(s.lock.locked() for s in sessions) and {t for t in asyncio.all_tasks()} - before <= {
                asyncio.current_task()
            }:
                break
            await asyncio.sleep(0.05)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], (
            'a hung-up client was logged as a server failure'
        )
        assert not health.failures, health.failures[:3]
        assert len(health.latencies) >= 20
        print(
            f"/health p99 {health.p99() * 1000:.0f} ms, max {max(health.latencies) * 1000:.0f} ms over "
            f"{len(health.latencies)} polls"
        )
        assert health.p99() < 0.25, f"/health p99 {health.p99() * 1000:.0f} ms over {len(health.latencies)} polls"
        leaked = {t for t in asyncio.all_tasks()} - before - {asyncio.current_task()}
        assert not leaked, leaked
        assert not any(s.lock.locked() for s in sessions) and 'running=0, pending=0' in repr(engine)
        assert all(s.turns >= 1 for s in sessions[::2])
        for s in sessions:
            server.close(s.id)
        assert server.sessions == {}
        s = server.open(engine, SAMPLING, 512)
        async with httpx2.AsyncClient(timeout=30) as http:
            await _check_serves(
                http,
                s,
                dict(openai=f"{server.base_url(s.id)}/chat/completions"),
                dict(authorization=f"Bearer {server.token}"),
                'openai',
                0,
            )
        await server.stop()
        engine.close()

    asyncio.run(main())
