"""The token-identity check itself, fed each way a batch can lie: every mutation of what the engine sampled, or of
how collate laid it out, must fail with a message naming the rollout, the batch row, the position and the field."""

import dataclasses
from types import SimpleNamespace
import pytest, torch
from molt_nb.core import Segment, Trajectory, collate
from molt_nb.loop import check_token_identity

ROUTES = (
    torch.arange(2 * 9 * 2, dtype=torch.int16).reshape(2, 9, 1, 2) % 4
)  # (generation, prompt + sampled, layers, top_k)


def gen(ids, version, prompt_len, routes=None):
    "What the engine returned for one turn: the sampled tokens with their logprobs, version and (MoE) routes"
    ids = torch.tensor(ids)
    return SimpleNamespace(
        token_ids=ids,
        logprobs=-0.25 * torch.arange(1, len(ids) + 1),
        versions=torch.full((len(ids),), version, dtype=torch.int32),
        routes=routes,
        prompt_len=prompt_len,
    )


def rollouts(moe=False):
    """Two rollouts: 'a' has two turns in one segment (prompt, sample, tool output, sample) and 'b' two segments
    (its context was rewritten between turns); the engine's records of every turn; what the agents made of them"""
    r = lambda i, n: ROUTES[i, :n] if moe else None
    ga = [gen([5, 6], 3, 2, r(0, 4)), gen([7, 8, 9], 4, 6, r(1, 9))]
    a = (
        Segment.prompt([1, 2])
        .extend(ga[0].token_ids, ga[0].logprobs, ga[0].versions, r(0, 4)[2:] if moe else None)
        .extend([3, 4])
    )
    a = a.extend(ga[1].token_ids, ga[1].logprobs, ga[1].versions, r(1, 9)[6:] if moe else None)
    gb = [gen([10, 11], 4, 2, r(0, 4)), gen([12], 4, 3, r(1, 4))]
    b0 = Segment.prompt([1, 3]).extend(gb[0].token_ids, gb[0].logprobs, gb[0].versions, r(0, 4)[2:] if moe else None)
    b1 = Segment.prompt([1, 4, 2]).extend(gb[1].token_ids, gb[1].logprobs, gb[1].versions, r(1, 4)[3:] if moe else None)
    # observation tokens have routes too (-1 where the engine gave none is fine for them: only sampled tokens are
    # compared)
    if moe:
        a.routes[:2], b0.routes[:2], b1.routes[:3] = ROUTES[0, :2], ROUTES[0, :2], ROUTES[1, :3]
    trs = [Trajectory('a', 'g', 0, [a], reward=1.0), Trajectory('b', 'g', 0, [b0, b1], reward=0.0)]
    return trs, {'a': ga, 'b': gb}


def changed(seg: Segment, **fields) -> Segment:
    return dataclasses.replace(seg, **fields)


@pytest.mark.parametrize('moe', [False, True])
def test_a_faithful_batch_passes(moe):
    trs, gens = rollouts(moe)
    assert check_token_identity(trs, gens, collate(trs)) == 5 + 3  # every sampled token checked


def fails(trs, gens, batch, *parts):
    with pytest.raises(AssertionError) as e:
        check_token_identity(trs, gens, batch)
    for p in parts:
        assert p in str(e.value), f"{p!r} not in: {e.value}"
    return str(e.value)


def test_a_wrong_token_id():
    trs, gens = rollouts()
    a = trs[0].segments[0]
    trs[0].segments[0] = changed(
        a, token_ids=torch.where(torch.arange(len(a)) == 7, 99, a.token_ids)
    )  # the second turn's 2nd token
    fails(
        trs,
        gens,
        collate(trs),
        "rollout 'a'",
        "trained token 3",
        "batch row 0, position 7",
        "token id is 99",
        "the engine sampled 8",
    )


def test_a_wrong_version():
    trs, gens = rollouts()
    b1 = trs[1].segments[1]
    trs[1].segments[1] = changed(
        b1, versions=torch.where(b1.action_mask, 3, b1.versions)
    )  # stamped with the old policy
    fails(
        trs,
        gens,
        collate(trs),
        "rollout 'b'",
        "trained token 2",
        "batch row 2, position 3",
        "version is 3",
        "the engine sampled 4",
    )


def test_a_wrong_logprob():
    trs, gens = rollouts()
    a = trs[0].segments[0]
    trs[0].segments[0] = changed(
        a, logprobs=torch.where(torch.arange(len(a)) == 3, a.logprobs + 1e-6, a.logprobs)
    )  # "fixed" by rounding
    fails(trs, gens, collate(trs), "rollout 'a'", "trained token 1", "batch row 0, position 3", "logprob is")


def test_a_wrong_route():
    trs, gens = rollouts(moe=True)
    b0 = trs[1].segments[0]
    routes = b0.routes.clone()
    routes[3] = routes[3].flip(-1)
    trs[1].segments[0] = changed(b0, routes=routes)
    fails(trs, gens, collate(trs), "rollout 'b'", "trained token 1", "batch row 1, position 3", "route")


def test_a_dropped_token():
    "An agent that re-tokenized its turn and lost a token: the count differs and the first difference is named"
    trs, gens = rollouts()
    trs[0] = Trajectory(
        'a',
        'g',
        0,
        [
            Segment.prompt([1, 2])
            .extend(gens['a'][0].token_ids, gens['a'][0].logprobs, gens['a'][0].versions)
            .extend([3, 4])
            .extend(gens['a'][1].token_ids[:2], gens['a'][1].logprobs[:2], gens['a'][1].versions[:2])
        ],
        reward=1.0,
    )
    fails(
        trs,
        gens,
        collate(trs),
        "rollout 'a'",
        "trained token 4 (after its last trained token",
        "4 tokens trained, 5 sampled",
    )


@pytest.mark.parametrize('row_op', ['roll', 'shift'])
def test_a_shifted_batch_row(row_op):
    trs, gens = rollouts()
    batch = collate(trs)
    if row_op == 'roll':  # rows out of order: every tensor field rolled by one row, the row labels left in place
        batch = dataclasses.replace(
            batch,
            **{
                f: getattr(batch, f).roll(1, 0)
                for f in ('input_ids', 'attention_mask', 'action_mask', 'logprobs', 'versions')
            },
        )
        fails(
            trs,
            gens,
            batch,
            "rollout 'a' segment 0: batch row 0, position 1",
            "token id is 4, the segment's is 2",
            "shifted or changed",
        )
    else:  # one row's tokens moved one position right (a padding or BOS bug)
        ids = batch.input_ids.clone()
        ids[2, 1:] = batch.input_ids[2, :-1].clone()
        fails(
            trs,
            gens,
            dataclasses.replace(batch, input_ids=ids),
            "rollout 'b' segment 1: batch row 2, position 1",
            "token id is 1, the segment's is 4",
        )


def test_rows_relabelled_out_of_order():
    trs, gens = rollouts()
    batch = collate(trs)
    fails(trs, gens, batch.select([1, 0, 2]), "rollout 'a' segment 0: batch row 0 holds rollout 'b' segment 0")


def test_a_dropped_segment():
    trs, gens = rollouts()
    fails(trs, gens, collate(trs).select([0, 1]), "the batch has 2 rows for the 3 segments")  # dropped after collate
    short = [trs[0], Trajectory('b', 'g', 0, trs[1].segments[:1], reward=0.0)]  # dropped by the agent
    fails(short, gens, collate(short), "rollout 'b'", "trained token 2", "2 tokens trained, 3 sampled")


def test_a_trained_observation():
    "A token the engine never sampled marked as sampled, past the end of what it returned: an extra trained token"
    trs, gens = rollouts()
    b1 = trs[1].segments[1]
    trs[1].segments[1] = b1.extend([13], torch.tensor([-0.5]), 4)
    fails(trs, gens, collate(trs), "rollout 'b'", "4 tokens trained, 3 sampled")


def test_failed_rollouts_are_skipped_as_collate_skips_them():
    trs, gens = rollouts()
    trs.append(Trajectory('c', 'g', 0, [], error='agent raised'))
    assert check_token_identity(trs, gens, collate(trs)) == 8
