"""Images through the token-first contract: the engine, the step runner and the trainer agree on a tiny Qwen3-VL."""

import asyncio, copy, re

import pytest
import torch

from molt_nb.actor import PolicyActor
from molt_nb.agents import Env, StepEnvRunner
from molt_nb.chat import encode, literal
from molt_nb.core import Images, Result, SamplingParams, Segment, Trajectory, collate
from molt_nb.engine import TorchEngine
from molt_nb.models import tiny_dense
from molt_nb.vision import (
    VISION_TOKENS,
    draw_shapes,
    expand_ids,
    image_processor,
    process_images,
    tiny_vl,
    vision_ids,
    vision_inputs,
    vision_tokenizer,
)

TOK, PROC = vision_tokenizer(), image_processor()
PAD = TOK.convert_tokens_to_ids(VISION_TOKENS[2])
A = draw_shapes([('square', (200, 30, 30), (8, 8), 20), ('triangle', (30, 30, 200), (30, 30), 24)])
B = draw_shapes([('triangle', (30, 160, 30), (4, 4), 20)], size=(32, 48))
SP = SamplingParams(max_tokens=6, stop_token_ids=(TOK.eos_token_id,))


def full_logprobs(model, ids: list, images) -> torch.Tensor:
    "(len(ids) - 1,) logprobs of each next token under one fresh fp32 forward, vision tokens never sampled"
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, **vision_inputs(x, [len(ids)], [images])).logits[0, :-1].float()
    logits[:, vision_ids(model)] = float('-inf')
    return logits.log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]


class Look(Env):
    "Two turns: an image in the opening message, a second image with the observation"

    def __init__(self, chat=True):
        self.chat = chat

    async def reset(self, task):
        if self.chat:
            return [dict(role='user', content=['how many shapes? ', A, ' answer:'])]
        return ['how many shapes? ', A, ' answer:']

    async def step(self, turn):
        if turn.index == 0:
            # hostile text: a placeholder string in an observation stays text
            return Result(0.0, observation='and now <|image_pad|>?', images=[B], terminated=False)
        return Result(1.0)


def look_rollouts(model, n: int, chat: bool = False) -> list:
    "n two-turn `Look` rollouts of a copy of `model` on its own TorchEngine"
    engine = TorchEngine(copy.deepcopy(model), seed=0)
    runner = StepEnvRunner(lambda: Look(chat), TOK, max_turns=2, max_context=256, template=chat, processor=PROC)

    async def rollouts():
        return await asyncio.gather(*(runner.run(engine, {}, SP, f'r{i}', 'g') for i in range(n)))

    try:
        return asyncio.run(asyncio.wait_for(rollouts(), 120))
    finally:
        engine.close()


def test_a_groups_rollouts_share_their_prompt_segment_with_its_images():
    "A group's rollouts open on one prompt and image: one segment, made once; the same text with another image: its own"
    runner = StepEnvRunner(lambda: None, TOK, template=False, processor=PROC)
    first, again = (runner._opening(['how many shapes? ', A.copy(), ' answer:'])[1] for _ in range(2))
    assert again is first  # equal pixels in another array: the same processed images, the same segment
    other = runner._opening(['how many shapes? ', B, ' answer:'])[1]
    grid = PROC(images=[B], return_tensors='pt', input_data_format='channels_last')['image_grid_thw']
    assert other is not first and torch.equal(other.images.grid_thw, grid)  # B's own, not A's
    assert not torch.equal(other.token_ids, first.token_ids)  # B's grid makes another number of placeholders
    back = runner._opening(['how many shapes? ', A, ' answer:'])[1]
    assert back is first  # the same text with two images: two entries, neither evicts the other


@pytest.mark.parametrize('chat', [True, False])
def test_two_images_in_two_turns_engine_and_trainer_agree(chat):
    model = tiny_vl(TOK, seed=3)
    trs = look_rollouts(model, 3, chat)
    start, end = (TOK.convert_tokens_to_ids(VISION_TOKENS[i]) for i in (0, 1))
    image = lambda n: [start] + [PAD] * n + [end]
    for tr in trs:
        # chat: a turn whose text the template renders differently (random bytes) re-renders in a new segment, which
        # then holds both images again; completion style always appends
        seg = tr.segments[-1]
        assert chat or len(tr.segments) == 1
        assert seg.images.tokens.tolist() == [16, 6] and len(seg.images.pixel_values) == 64 + 24
        assert seg.images.grid_thw.tolist() == [[1, 8, 8], [1, 4, 6]]
        ids = seg.token_ids.tolist()
        assert ids.count(PAD) == 22, 'exactly the two images are placeholders: the hostile string is text'
        if not chat:  # the canonical ids, built independently (the byte tokenizer has no merges to cross)
            act = seg.action_mask.tolist()
            a = act.index(True)
            b = a + act[a:].index(False)
            want = (
                encode(TOK, 'how many shapes? ')
                + image(16)
                + encode(TOK, ' answer:')
                + ids[a:b]
                + encode(TOK, literal(TOK, 'and now <|image_pad|>?'))
                + image(6)
            )
            assert ids[: len(want)] == want and all(act[len(want) :]), 'then the second turn, all sampled'
    # the trainer scores the collated rows exactly as the engine sampled them
    batch = collate(trs)
    actor = PolicyActor(copy.deepcopy(model), micro_batch_rows=2)
    lp = actor.logprobs(batch)
    gap = ((lp - batch.logprobs) * batch.action_mask).abs().max().item()
    assert gap < 1e-5, gap
    # and a fresh full forward of each row agrees too
    for tr in trs:
        seg = tr.segments[-1]
        ref = full_logprobs(model, seg.token_ids.tolist(), seg.images)
        assert (ref - seg.logprobs[1:])[seg.action_mask[1:]].abs().max() < 1e-5


def test_engine_logprobs_equal_a_full_forward_across_a_weight_load():
    "Rows with 2, 1 and 0 images decode in one batch; a weight load mid-decode re-prefills them with their images"
    model = tiny_vl(TOK, seed=4)
    new = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    changed = copy.deepcopy(model)
    changed.load_state_dict(new)
    ia, ib = process_images(PROC, [A], TOK), process_images(PROC, [B], TOK)
    rows = [
        (expand_ids(TOK, ['two: ', A, ' and ', B, ' ?'], torch.cat([ia.grid_thw, ib.grid_thw])), ia.cat(ib)),
        (expand_ids(TOK, ['one: ', B, ' ?'], ib.grid_thw), ib),
        (expand_ids(TOK, ['no image here ?'], []), None),
    ]
    engine = TorchEngine(copy.deepcopy(model), seed=0)
    sp = SamplingParams(max_tokens=40)

    async def go():
        tasks = [asyncio.create_task(engine.generate(ids, sp, images=im)) for ids, im in rows]
        while engine.stats['steps'] < 12:
            await asyncio.sleep(0.001)
        await engine.pause()
        await engine.load_weights(list(new.items()), version=1)
        await engine.resume()
        return await asyncio.gather(*tasks)

    try:
        gens = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        engine.close()
    for (ids, im), g in zip(rows, gens):
        assert len(g) == 40 and {0, 1} <= set(g.versions.tolist()), 'tokens on both sides of the load'
        full = ids + g.token_ids.tolist()
        for m, version in ((model, 0), (changed, 1)):
            ref = full_logprobs(m, full, im)[-len(g) :]
            mine = g.versions == version
            assert (ref[mine] - g.logprobs[mine]).abs().max() < 1e-5
        assert not set(g.token_ids.tolist()) & set(vision_ids(model)), 'a vision token was sampled'
    # the trainer on the collated rows (2, 1 and 0 images, pixels in row order) scores the tokens the new weights
    # sampled as the engine did
    segs = [
        Segment.prompt(ids, images=im).extend(g.token_ids, g.logprobs, g.versions) for (ids, im), g in zip(rows, gens)
    ]
    batch = collate([Trajectory(f'r{i}', 'g', 0, [s]) for i, s in enumerate(segs)])
    assert [0 if im is None else len(im) for im in batch.images] == [2, 1, 0]
    lp = PolicyActor(copy.deepcopy(changed), micro_batch_rows=3).logprobs(batch)
    new_tokens = batch.action_mask & (batch.versions == 1)
    assert new_tokens.sum() > 60 and (lp - batch.logprobs)[new_tokens].abs().max() < 1e-5


def test_bad_images_are_refused_with_the_reason():
    ia = process_images(PROC, [A], TOK)
    ids = expand_ids(TOK, ['x ', A], ia.grid_thw)
    vl = TorchEngine(tiny_vl(TOK), seed=0)
    text = TorchEngine(tiny_dense(), seed=0)
    try:
        with pytest.raises(ValueError, match='reads none'):
            asyncio.run(text.generate(ids[:2], SP, images=ia))
        with pytest.raises(ValueError, match='need \\[16\\]'):
            asyncio.run(vl.generate(ids[:-3], SP, images=ia))
        asyncio.run(vl.generate(ids, SP, images=ia))  # its positions are memoised: the same ids with other images...
        other = Images(ia.pixel_values, ia.grid_thw, ia.token_id + 1, ia.merge)
        with pytest.raises(ValueError, match='tagged with placeholder'):  # ... are checked again
            asyncio.run(vl.generate(ids, SP, images=other))
        with pytest.raises(ValueError, match='no images were given'):
            asyncio.run(vl.generate(ids, SP))
    finally:
        vl.close(), text.close()
    # the opening's image budget counts against the context
    runner = StepEnvRunner(lambda: Look(), TOK, max_turns=2, max_context=24, processor=PROC)
    with pytest.raises(ValueError, match='16 of them for 1 image'):
        asyncio.run(runner.run(None, {}, SP, 'r', 'g'))
    # no processor: the runner says what to pass
    with pytest.raises(ValueError, match='no image processor'):
        asyncio.run(StepEnvRunner(lambda: Look(), TOK, max_turns=2).run(None, {}, SP, 'r', 'g'))
    # a cut through an image is refused
    seg = Segment.prompt(ids, images=ia)
    with pytest.raises(ValueError, match='would cut image 0'):
        seg.truncate(len(ids) - 3)


# --- the chat server takes images on both wires ---------------------------------------------------------------


def png_b64(pixels) -> str:
    import base64, io
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, 'PNG')
    return base64.b64encode(buf.getvalue()).decode()


def test_chat_server_round_trips_images_through_both_sdks():
    import anthropic, openai
    from molt_nb.chat_server import ChatLimits, ChatServer

    model = tiny_vl(TOK, seed=5)
    a, b = png_b64(A), png_b64(B)
    oa_image = lambda data: dict(type='image_url', image_url=dict(url=f'data:image/png;base64,{data}'))
    an_image = lambda data: dict(type='image', source=dict(type='base64', media_type='image/png', data=data))
    looked = lambda image: [  # the model called `look`; the tool's result is an image and a text
        dict(role='assistant', content=[dict(type='tool_use', id='t1', name='look', input={})]),
        dict(
            role='user',
            content=[dict(type='tool_result', tool_use_id='t1', content=[image, dict(type='text', text='?')])],
        ),
    ]

    async def go():
        engine = TorchEngine(copy.deepcopy(model), seed=0)
        server = await ChatServer(TOK, processor=PROC, limits=ChatLimits(max_images=2, max_image_bytes=20_000)).start()
        text_server = await ChatServer(TOK).start()
        sp = SamplingParams(max_tokens=5)
        try:
            sessions = []
            # OpenAI: an image in the first message, a second in a later turn
            s = server.open(engine, sp, 512)
            oa = openai.AsyncOpenAI(base_url=server.base_url(s.id), api_key=server.token, max_retries=0)
            msgs = [dict(role='user', content=[dict(type='text', text='count: '), oa_image(a)])]
            r1 = await oa.chat.completions.create(model='policy', messages=msgs)
            msgs += [
                dict(role='assistant', content=r1.choices[0].message.content),
                dict(role='user', content=[oa_image(b), dict(type='text', text=' and now?')]),
            ]
            await oa.chat.completions.create(model='policy', messages=msgs)
            sessions.append(s)
            # Anthropic: the same with image blocks
            s = server.open(engine, sp, 512)
            an = anthropic.AsyncAnthropic(base_url=server.session_url(s.id), api_key=server.token, max_retries=0)
            amsgs = [dict(role='user', content=[dict(type='text', text='count: '), an_image(a)])]
            r1 = await an.messages.create(model='policy', messages=amsgs, max_tokens=5)
            amsgs += [
                dict(role='assistant', content=r1.content[0].text if r1.content else ''),
                dict(role='user', content=[an_image(b), dict(type='text', text=' and now?')]),
            ]
            await an.messages.create(model='policy', messages=amsgs, max_tokens=5)
            sessions.append(s)
            # Anthropic: the second image in a tool's result (a tool that returns a picture)
            s = server.open(engine, sp, 512)
            an = anthropic.AsyncAnthropic(base_url=server.session_url(s.id), api_key=server.token, max_retries=0)
            amsgs = [dict(role='user', content=[dict(type='text', text='count: '), an_image(a)])]
            await an.messages.create(model='policy', messages=amsgs, max_tokens=5)
            amsgs += looked(an_image(b))
            await an.messages.create(model='policy', messages=amsgs, max_tokens=5)
            sessions.append(s)
            # refusals: each says why, with a 4xx
            s = server.open(engine, sp, 512)
            oa = openai.AsyncOpenAI(base_url=server.base_url(s.id), api_key=server.token, max_retries=0)
            big = png_b64(torch.randint(0, 255, (120, 120, 3), dtype=torch.uint8).numpy())  # noise: ~43 kB as PNG
            refused = {}
            for name, content in [
                ('too large', [oa_image(big)]),
                ('too many', [oa_image(a)] * 3),
                ('fetch', [dict(type='image_url', image_url=dict(url='http://example.com/a.png'))]),
                ('not an image', [oa_image('aGVsbG8=')]),
            ]:
                with pytest.raises(openai.APIStatusError) as e:
                    await oa.chat.completions.create(model='policy', messages=[dict(role='user', content=content)])
                refused[name] = (e.value.status_code, str(e.value))
            t = text_server.open(engine, sp, 512)
            to = openai.AsyncOpenAI(base_url=text_server.base_url(t.id), api_key=text_server.token, max_retries=0)
            with pytest.raises(openai.BadRequestError, match='reads text only'):
                await to.chat.completions.create(model='policy', messages=[dict(role='user', content=[oa_image(a)])])
            ta = anthropic.AsyncAnthropic(
                base_url=text_server.session_url(t.id), api_key=text_server.token, max_retries=0
            )
            with pytest.raises(anthropic.BadRequestError, match='reads text only'):
                opening = [dict(role='user', content='count: ')]
                await ta.messages.create(model='policy', messages=opening + looked(an_image(b)), max_tokens=5)
            an = anthropic.AsyncAnthropic(base_url=server.session_url(s.id), api_key=server.token, max_retries=0)
            with pytest.raises(anthropic.BadRequestError, match='fetches nothing'):
                url = dict(type='image', source=dict(type='url', url='http://example.com/a.png'))
                await an.messages.create(model='policy', messages=[dict(role='user', content=[url])], max_tokens=5)
            with pytest.raises(anthropic.BadRequestError, match='max_images'):  # a tool's images count too
                two = [dict(role='user', content=[an_image(a), an_image(a)])]
                await an.messages.create(model='policy', messages=two + looked(an_image(b)), max_tokens=5)
            with pytest.raises(anthropic.BadRequestError, match="'text', 'image' and 'tool_result' blocks"):
                await an.messages.create(
                    model='policy', messages=[dict(role='user', content=[{'type': 'audio'}])], max_tokens=5
                )
            return sessions, refused
        finally:
            await server.stop()
            await text_server.stop()
            engine.close()

    sessions, refused = asyncio.run(asyncio.wait_for(go(), 120))
    assert refused['too large'][0] == 413 and 'max_image_bytes' in refused['too large'][1]
    assert refused['too many'][0] == 400 and 'max_images' in refused['too many'][1]
    assert refused['fetch'][0] == 400 and 'data URI' in refused['fetch'][1]
    assert refused['not an image'][0] == 400 and 'could not be decoded' in refused['not an image'][1]
    trs = []
    for i, s in enumerate(sessions):
        seg = s.segments[-1]  # the second request extended the first turn's segment, or re-rendered both images
        assert seg.images.tokens.tolist() == [16, 6] and seg.token_ids.tolist().count(PAD) == 22
        assert torch.equal(seg.images.pixel_values, process_images(PROC, [A, B], TOK).pixel_values)
        trs.append(Trajectory(f'r{i}', 'g', 0, s.segments, reward=1.0))
    tool_turn = TOK.decode(sessions[2].segments[-1].token_ids)  # the second image inside the tool's response
    assert re.search(r'<tool_response>\n<\|vision_start\|>(<\|image_pad\|>){6}<\|vision_end\|>\?', tool_turn), tool_turn
    batch = collate(trs)
    lp = PolicyActor(copy.deepcopy(model), micro_batch_rows=2).logprobs(batch)
    assert ((lp - batch.logprobs) * batch.action_mask).abs().max() < 1e-5


# --- the trainer steps on images, and the dashboard shows them ------------------------------------------------


def test_train_step_and_token_view_show_one_chip_per_image():
    "A GRPO step on multi-turn image rollouts moves the vision tower; the token view shows each image once, on hover"
    from test_browser import FLAGS, chromium
    from molt_nb.store import sample_frame, token_columns
    from molt_nb.widgets import STYLE, token_html

    model = tiny_vl(TOK, seed=6)
    trs = look_rollouts(model, 4)
    for i, tr in enumerate(trs):
        tr.reward = float(i % 2)  # a group with a spread: GRPO has advantages to step on
    batch = collate(trs)
    actor = PolicyActor(copy.deepcopy(model), micro_batch_rows=2)
    vision_before = [p.detach().clone() for p in actor.model.model.visual.parameters()]
    res = actor.train_step(batch)
    assert torch.isfinite(torch.tensor(res.metrics['loss'])), res.metrics
    moved = [not torch.equal(a, b) for a, b in zip(vision_before, actor.model.model.visual.parameters())]
    assert any(moved), 'the gradient reached the vision tower'
    frame = sample_frame(1, trs, TOK, token_columns(batch, res))
    assert [len(x) for x in frame['images']] == [2] * 4, 'two distinct images per rollout, each drawn once'
    assert len(set(frame['images'][0])) == 2 and frame['images'][0] == frame['images'][1]
    page_html = f"<html><body>{STYLE}{token_html(frame.iloc[0].to_dict())}</body></html>"
    assert '<|image_pad|>' not in page_html

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            page.set_content(page_html)
            chips = page.locator('.tok.image')
            assert chips.count() == 2
            assert page.locator('.tok').count() == 2 + len(frame['token_ids'][0]), 'the sampled tokens, one chip each'
            thumb = chips.nth(1).locator('img.thumb')
            assert not thumb.is_visible(), 'the thumbnail shows on hover only'
            chips.nth(1).hover()
            assert thumb.is_visible()
            size = thumb.evaluate('(i) => [i.complete, i.naturalWidth, i.naturalHeight]')
            assert size == [True, 48, 32], size  # image B (32x48), decoded
        finally:
            browser.close()


def test_molt_nb_train_runs_the_shapes_recipe_end_to_end(tmp_path):
    """The real command on recipes/shapes at toy scale, as a user starts it (no RAY_* variables): the warm start on
    image demos, async RL through Ray, the control; the samples hold each rollout's image"""
    from shapes_run import train_shapes

    train_shapes(tmp_path, 'loop.seconds=8', 'rollout.groups_in_flight=8')


def test_shapes_rl_asks_triangles_more_often_and_held_out_stays_half_and_half():
    """The recipe's task mix as a run reads it: RL's unlabelled images ask `triangles?` 3 times in 4, each with the
    right answer for its question; held-out images and demos ask both questions half and half, as before"""
    from pathlib import Path
    from molt_nb.agents import load_module
    from molt_nb.config import load_config

    recipe = Path(__file__).resolve().parents[1] / 'recipes' / 'shapes'
    cfg, agent = load_config(recipe), load_module(recipe / 'agent.py')
    train, even = agent.tasks('train', **cfg.task_options), agent.tasks('train')
    share = lambda ts: sum(t['question'] == 'triangles' for t in ts) / len(ts)
    assert abs(share(train) - 0.75) < 0.02 and abs(share(even) - 0.5) < 0.02
    assert all(a['shapes'] == b['shapes'] for a, b in zip(train, even))  # the same images, other questions
    for t in train:
        kinds = [k for k, *_ in t['shapes']]
        largest = max(t['shapes'], key=lambda x: x[3])[1]
        assert t['answer'] == (str(kinds.count('triangle')) if t['question'] == 'triangles' else largest)
    assert agent.tasks('eval', **cfg.task_options) == agent.tasks('eval') and 0.45 < share(agent.tasks('eval')) < 0.55
    assert 0.4 < sum(p[1].strip() == 'triangles?' for p, _ in agent.demos(200)) / 200 < 0.6
    with pytest.raises(ValueError, match='from 0 to 1'):
        agent.tasks('train', triangles=1.5)


def test_routing_replay_on_a_moe_vlm():
    "A Qwen3-VL-MoE: the engine reports each token's experts (image tokens too), and the trainer replays them"
    from molt_nb.models import moe_gates
    from molt_nb.routing import RoutingConfig

    model = tiny_vl(TOK, seed=7, experts=4)
    assert sorted(moe_gates(model)) == [0, 1]
    trs = look_rollouts(model, 3)
    seg = trs[0].segments[-1]
    assert seg.routes is not None and seg.routes.shape[1:] == (2, 2)
    assert (seg.routes[seg.token_ids == PAD] >= 0).all(), 'the image tokens were routed and reported'
    batch = collate(trs)
    actor = PolicyActor(copy.deepcopy(model), micro_batch_rows=2, routing=RoutingConfig(replay=True))
    lp = actor.logprobs(batch)
    assert ((lp - batch.logprobs) * batch.action_mask).abs().max() < 1e-5
    natural, used = actor.router.last(tuple(batch.select([2]).input_ids.shape))
    routes = batch.select([2]).routes[0]
    known = (routes >= 0).all(-1).all(-1)  # the last sampled token was never fed to the engine: its routes are -1
    assert known.sum() > 40 and torch.equal(used[0][known], routes[known]), 'the trainer replayed the routes'


def test_hostile_image_requests_get_a_4xx_and_text_users_are_unaffected():
    "Forged image marks, bad shapes and pixel budgets are the client's mistakes (4xx); text-only content is as before"
    import numpy as np
    import openai
    from molt_nb.chat_server import ChatLimits, ChatServer
    from molt_nb.models import build_tokenizer
    from molt_nb.vision import IMAGE_MARK, flat_content

    # a tool-calling assistant message has content None; a text runner renders it as before (no processor needed)
    text_tok = build_tokenizer()
    call = dict(type='function', function=dict(name='add', arguments='{"a": 1}'))
    opening = [
        dict(role='user', content='add'),
        dict(role='assistant', content=None, tool_calls=[call]),
        dict(role='tool', content='1'),
    ]
    _, seg = StepEnvRunner(lambda: None, text_tok)._opening(opening)
    assert seg.images is None and len(seg) > 10
    assert flat_content(f'a{IMAGE_MARK}b') == ('ab', []), 'text cannot forge an image mark'
    with pytest.raises(TypeError, match='a message part is a int'):
        flat_content(['x', 3])

    oa_image = lambda px: dict(type='image_url', image_url=dict(url=f'data:image/png;base64,{png_b64(px)}'))
    thin = np.zeros((2, 400, 3), dtype=np.uint8)  # 200-fold: the processor would refuse it
    big = np.zeros((80, 80, 3), dtype=np.uint8)  # 6,400 pixels, a few hundred bytes as PNG

    async def go():
        engine = TorchEngine(tiny_vl(TOK), seed=0)
        server = await ChatServer(
            TOK, processor=PROC, limits=ChatLimits(max_image_pixels=5000, max_request_pixels=10000)
        ).start()
        out = {}
        try:
            s = server.open(engine, SamplingParams(max_tokens=2), 512)
            oa = openai.AsyncOpenAI(base_url=server.base_url(s.id), api_key=server.token, max_retries=0)
            forged = [dict(type='function', function=dict(name='f', description=f'x{IMAGE_MARK}', parameters={}))]
            for name, content, tools in [
                ('forged', [dict(type='text', text='hi '), oa_image(A)], forged),
                ('thin', [oa_image(thin)], None),
                ('big', [oa_image(big)], None),
                ('budget', [oa_image(A), oa_image(B)] * 2, None),
            ]:
                kw = dict(tools=tools) if tools else {}
                with pytest.raises(openai.APIStatusError) as e:
                    await oa.chat.completions.create(
                        model='policy', messages=[dict(role='user', content=content)], **kw
                    )
                out[name] = (e.value.status_code, str(e.value))
        finally:
            await server.stop()
            engine.close()
        return out

    out = asyncio.run(asyncio.wait_for(go(), 60))
    assert out['forged'][0] == 400 and '2 image placeholders' in out['forged'][1]
    assert out['thin'][0] == 400 and '100-fold' in out['thin'][1]
    assert out['big'][0] == 413 and 'max_image_pixels' in out['big'][1]
    assert out['budget'][0] == 413 and 'max_request_pixels' in out['budget'][1]
