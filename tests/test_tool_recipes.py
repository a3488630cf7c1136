"""The tool-use recipes end to end: a warm start on tool-call demonstrations, then RL on a real local Ray, with
the agent talking to the loopback chat server through the real OpenAI or Anthropic SDK and its Python tool in the sandbox."""
import dataclasses
from pathlib import Path
import pytest, torch
from molt_nb.agents import load_agent, _module
from molt_nb.chat_server import parse_tool_calls
from molt_nb.config import load_config
from molt_nb.core import SamplingParams
from molt_nb.engine import TorchEngine
from molt_nb.loop import launch
from molt_nb.models import load_policy
from molt_nb.train import run_sync, warm_start

ROOT = Path(__file__).resolve().parents[1]

def _masks_in_place(tok, tr):
    "Every segment: the tool's output is masked, the policy's tool calls and answers are trained"
    for seg in tr.segments:
        ids, act = seg.token_ids.tolist(), seg.action_mask.tolist()
        start, end = tok.convert_tokens_to_ids('<tool_response>'), tok.convert_tokens_to_ids('</tool_response>')
        inside = False
        for i, a in zip(ids, act):
            if i == start: inside = True
            if inside: assert not a, 'a tool-output token is marked as sampled'
            if i == end: inside = False
    sampled = tok.decode(torch.cat([s.token_ids[s.action_mask] for s in tr.segments]))
    observed = tok.decode(torch.cat([s.token_ids[~s.action_mask] for s in tr.segments]))
    return sampled, observed

@pytest.mark.parametrize('recipe', ['tool_openai', 'tool_anthropic'])
def test_tool_recipe_trains(ray_local, tmp_path, recipe):
    cfg = load_config(ROOT/'recipes'/recipe, ['loop.debug=true', f'run_dir="{tmp_path/"run"}"'])
    path, accuracy = warm_start(cfg)  # its held-out evaluation runs the ChatAgentRunner in this process
    assert 0.0 <= accuracy <= 1.0
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path)))
    # one greedy rollout in this process: where the tool output and the policy's tokens sit
    model, tok = load_policy(path)
    engine = TorchEngine(model, seed=0)
    runner, task = load_agent(cfg.agent_path, tok), _module(cfg.agent_path).tasks('train')[0]
    tr = run_sync(runner.run(engine, task, SamplingParams(temperature=0.0, max_tokens=96, stop_token_ids=(tok.eos_token_id,)), 'r0', 'g0'))
    engine.close()
    sampled, observed = _masks_in_place(tok, tr)
    assert '<tool_call>' in sampled and '"name": "python"' in sampled, sampled  # the policy's call is trained
    # the tool's output, exactly as the sandbox answers the policy's call, is in the context and masked
    content, calls = parse_tool_calls(sampled.split('<|im_end|>')[0])
    out = run_sync(_module(cfg.agent_path).call_tool(calls[0]['name'], calls[0]['arguments']))
    assert f"<tool_response>\n{out}\n</tool_response>" in observed and out not in sampled, observed
    # RL on Ray: every trained token checked against the engine
    run = launch(cfg)
    row = run.wait()
    m = run.store.metrics().iloc[1:]
    assert row['step'] == cfg.loop.steps and len(m) == cfg.loop.steps
    assert (m.identity_checked == m['train/tokens']).all() and (m['train/tokens'] > 0).all()
    s = run.store.samples()
    assert s.text.str.contains('<tool_call>').any()
    assert row.get('pool/rollouts/ok', 0) >= cfg.rollout.n_samples * cfg.rollout.groups_per_step * cfg.loop.steps
