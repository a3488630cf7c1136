"""The tool-use recipes end to end, with the agent talking to the loopback chat server through the real OpenAI or
Anthropic SDK and its Python tool in the sandbox.

Where the tool output and the policy's tokens sit in a trajectory is checked on a scripted policy (a known-good
tool call, then the answer), so it cannot depend on what a tiny model happens to emit on a given CPU. The RL part
then trains the warm-started recipe on a real local Ray and checks every trained token against the engine."""

import dataclasses, json
from pathlib import Path
import pytest, torch
from molt_nb.agents import load_agent, load_module
from molt_nb.chat import encode
from molt_nb.config import load_config
from molt_nb.core import SamplingParams
from molt_nb.engine import Generation
from molt_nb.controller import launch
from molt_nb.models import build_tokenizer
from molt_nb.recipe import run_sync
from molt_nb.train import warm_start

ROOT = Path(__file__).resolve().parents[1]


class Scripted:
    "An engine whose turns are the given texts (version 0, logprob -0.5 per token); keeps the prompts it saw"

    version, max_model_len = 0, 1024

    def __init__(self, tok, texts):
        self.tok, self.texts, self.prompts = tok, list(texts), []

    async def generate(self, token_ids, sampling, session_id=None):
        self.prompts.append(torch.as_tensor(token_ids).tolist())
        ids = torch.tensor(encode(self.tok, self.texts.pop(0)))
        n = len(ids)
        return Generation(ids, torch.full((n,), -0.5), torch.zeros(n, dtype=torch.int32), None, 'stop', len(token_ids))


def _split(tok, tr) -> tuple:
    "(sampled text, observed text) of a trajectory, after checking that no token inside a tool response is sampled"
    start, end = tok.convert_tokens_to_ids('<tool_response>'), tok.convert_tokens_to_ids('</tool_response>')
    for seg in tr.segments:
        inside = False
        for i, a in zip(seg.token_ids.tolist(), seg.action_mask.tolist()):
            if i == start:
                inside = True
            assert not (inside and a), 'a tool-output token is marked as sampled'
            if i == end:
                inside = False
    sampled = tok.decode(torch.cat([s.token_ids[s.action_mask] for s in tr.segments]))
    observed = tok.decode(torch.cat([s.token_ids[~s.action_mask] for s in tr.segments]))
    return sampled, observed


@pytest.mark.parametrize('recipe', ['tool_openai', 'tool_anthropic'])
def test_tool_turn_masks(recipe):
    "A scripted tool call and answer through the real SDK: both are trained, the tool's output is masked"
    cfg, tok = load_config(ROOT / 'recipes' / recipe), build_tokenizer()
    module = load_module(cfg.agent_path)
    task = module.tasks('train')[0]
    arguments = json.dumps(dict(code=task['code']))
    call = f'<tool_call>\n{{"name": "python", "arguments": {arguments}}}\n</tool_call><|im_end|>'
    engine = Scripted(tok, [call, task['label'] + '<|im_end|>'])
    runner = load_agent(cfg.agent_path, tok)
    sampling = SamplingParams(max_tokens=96, stop_token_ids=(tok.eos_token_id,))
    tr = run_sync(runner.run(engine, task, sampling, 'r0', 'g0'))
    # the right answer (0.8) and a tool call that succeeded (0.2)
    assert tr.reward == pytest.approx(1.0) and tr.info['used_tool'] == 1.0
    sampled, observed = _split(tok, tr)
    assert sampled == call + task['label'] + '<|im_end|>'  # both scripted turns, exactly, and nothing else
    out = run_sync(module.call_tool('python', arguments))
    assert out.strip() == task['label']  # the sandbox really ran the call
    assert f"<tool_response>\n{out}\n</tool_response>" in observed, observed  # as the SDK sent it back
    first, second = engine.prompts
    assert second[: len(first)] == first  # one growing context


@pytest.mark.parametrize('recipe', ['tool_openai', 'tool_anthropic'])
def test_tool_recipe_trains(ray_local, tmp_path, recipe):
    "The recipe's warm start, then RL on Ray with the real SDK: every trained token is the engine's"
    cfg = load_config(ROOT / 'recipes' / recipe, ['loop.debug=true', f'run_dir="{tmp_path / "run"}"'])
    path, _ = warm_start(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path)))
    run = launch(cfg, name=recipe)
    try:
        run.wait(timeout=900)
        m = run.metrics()
    finally:
        run.kill()
    row, m = m.iloc[-1].dropna().to_dict(), m.iloc[1:]
    assert row['step'] == cfg.loop.steps and len(m) == cfg.loop.steps
    assert (m.identity_checked == m['train/tokens']).all() and (m['train/tokens'] > 0).all()
    assert row.get('pool/rollouts/ok', 0) >= cfg.rollout.n_samples * cfg.rollout.groups_per_step * cfg.loop.steps
