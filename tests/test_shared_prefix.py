"""Rows that share a prompt, scored with the prompt's forward once (`molt_nb.actor.shared_prefix_logprobs`): on a
ragged batch (prompts and tails of different lengths, a multi-turn row with an observation between its actions, a
row without any action) the action tokens' logprobs and the gradient are those of the whole rows; models where a
cached prefix could differ from the whole row are scored whole."""

import copy

import pytest
import torch
import torch.nn.functional as F

from molt_nb.actor import PolicyActor, cache_keyword, prefix_plan, shared_prefix_logprobs
from molt_nb.config import AlgoConfig
from molt_nb.core import Batch
from molt_nb.models import tiny_dense

EVERY = dict(at_most=1.0, min_saved=0)  # share whatever repeats, however little it saves


def ragged(prompts: tuple = (3, 7, 5), copies: int = 1) -> Batch:
    """Three prompts (of 3, 7 and 5 tokens by default). Prompt A: tails of 1, 4 and 6 tokens, the last a second turn
    (2 actions, 2 observation tokens, 2 actions); prompt B: tails of 2, 3 and 5; prompt C: one row with no action at
    all. `copies`: A's and B's rows that many times (new tails each time); rewards alternate 1, 0 within a prompt"""
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(1, 250, (n,), generator=g)
    a, b, c = (tok(n) for n in prompts)
    rows = []  # (ids, actions: 1 where the token is sampled, group)
    for _ in range(copies):
        for n in (1, 4):
            rows.append((torch.cat([a, tok(n)]), [0] * len(a) + [1] * n, 'a'))
        rows.append((torch.cat([a, tok(6)]), [0] * len(a) + [1, 1, 0, 0, 1, 1], 'a'))
        for n in (2, 3, 5):
            rows.append((torch.cat([b, tok(n)]), [0] * len(b) + [1] * n, 'b'))
    rows.append((c, [0] * len(c), 'c'))
    B, T = len(rows), max(len(r) for r, _, _ in rows)
    ids, mask, action = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T)
    for i, (r, acts, _) in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)], action[i, : len(r)] = r, True, torch.tensor(acts, dtype=torch.float)
    rewards = (torch.arange(B) % 2 == 0).float()
    return Batch(
        input_ids=ids,
        attention_mask=mask,
        action_mask=action[:, 1:].bool(),
        logprobs=torch.zeros(B, T - 1),
        versions=torch.zeros(B, T - 1, dtype=torch.int32),
        rewards=rewards,
        scores=rewards.clone(),
        prompt_index=torch.zeros(B, dtype=torch.long),
        segment_index=torch.zeros(B, dtype=torch.long),
        truncated=torch.zeros(B, dtype=torch.bool),
        rollout_ids=[f"r{i}" for i in range(B)],
        group_ids=[grp for _, _, grp in rows],
    )


def whole(model, batch: Batch, temperature: float) -> torch.Tensor:
    "The reference: every row through the model whole"
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    return -F.cross_entropy((logits / temperature).transpose(1, 2), batch.input_ids[:, 1:], reduction='none')


def scored(model, batch: Batch, shared: bool) -> tuple:
    "(action logprobs, gradient of a weighted sum of them) on one path"
    model.zero_grad(set_to_none=True)
    lp = shared_prefix_logprobs(model, batch, 0.7, **EVERY) if shared else whole(model, batch, 0.7)
    assert lp is not None, "the shared path was not taken"
    lp = lp.masked_fill(~batch.action_mask, 0.0)
    (lp * torch.linspace(-1, 1, lp.shape[1])).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_ragged_rows_score_as_whole_rows():
    batch, model = ragged(), tiny_dense().train()
    index, L, _ = prefix_plan(batch, **EVERY)
    assert index.tolist() == [0, 0, 0, 1, 1, 1, 2] and L.tolist() == [2, 2, 2, 6, 6, 6, 4]
    (lp_w, g_w), (lp_s, g_s) = scored(model, batch, False), scored(model, batch, True)
    assert batch.action_mask.sum() == 19 and (lp_w[batch.action_mask] != 0).all()
    assert (lp_w - lp_s).abs().max() < 1e-5
    assert sorted(g_w) == sorted(g_s)
    assert max(float((g_w[n] - g_s[n]).norm() / g_w[n].norm()) for n in g_w) < 1e-4


def test_a_step_through_the_actor_is_the_whole_rows_step():
    """One optimizer step with sharing on and off, on the ragged rows with longer prompts (so that the default plan
    shares): the same loss, gradient norm and update"""
    batch = ragged(prompts=(20, 30, 9), copies=4)
    base, out = tiny_dense(), {}
    for shared in (True, False):
        actor = PolicyActor(copy.deepcopy(base), AlgoConfig(), temperature=0.7, shared_prefix=shared)
        out[shared] = (actor.train_step(batch), dict(actor.model.named_parameters()))
    (on, w_on), (off, w_off) = out[True], out[False]
    assert on.live_rows == off.live_rows and len(on.live_rows) == 24
    assert prefix_plan(batch.select(on.live_rows)) is not None  # the default plan shares the trained rows
    for k in ('loss', 'pg_loss', 'grad_norm'):
        assert abs(on.metrics[k] - off.metrics[k]) <= 1e-4 * max(1.0, abs(off.metrics[k])), k
    delta = lambda w: torch.cat([(w[n] - p).flatten() for n, p in base.named_parameters()]).detach()
    assert float((delta(w_on) - delta(w_off)).norm() / delta(w_off).norm()) < 1e-3


@pytest.mark.parametrize(
    'change, why',
    [
        (dict(use_sliding_window=True, sliding_window=4, layer_types=['sliding_attention'] * 2), 'a sliding window'),
        (dict(rope_parameters=dict(rope_type='dynamic', factor=2.0, rope_theta=10000.0)), 'dynamic RoPE'),
        (dict(attention_dropout=0.1), 'dropout while training'),
    ],
)
def test_models_where_a_cached_prefix_could_differ_score_whole(change, why):
    model = tiny_dense().train()
    assert cache_keyword(model) == 'cache' or cache_keyword(model) == 'past_key_values'
    for k, v in change.items():
        setattr(model.config, k, v)
    assert cache_keyword(model) is None, why
    assert shared_prefix_logprobs(model, ragged(), **EVERY) is None, why


def test_a_model_that_ignores_the_cache_is_scored_whole():
    "A forward that takes `cache` and drops it (a wrapper, an old transformers): the cache stays empty, no sharing"
    model = tiny_dense().train()

    class Forgetful(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, logits_to_keep=0, **kw):
            kw.pop("use_cache", None)
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)

    assert cache_keyword(Forgetful()) == 'cache'
    assert shared_prefix_logprobs(Forgetful(), ragged(), **EVERY) is None
