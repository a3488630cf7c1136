"""The README's main-job command, run as a user would."""

import re, subprocess, sys, os
from pathlib import Path

import pytest
import torch

from molt_nb import cli
from molt_nb.models import build_tokenizer, tiny_dense

BIN = Path(sys.executable).parent
EOS = build_tokenizer().eos_token_id


def token_rows(stdout):
    "Per-request summary reasons and the rows of the token table `molt-nb sample` prints."
    lines = stdout.splitlines()
    reasons = {int(m[1]): m[2] for m in (re.match(r"request (\d+): .* \((\w+)\)$", l) for l in lines) if m}
    header = next(i for i, l in enumerate(lines) if l.split()[:3] == ["request", "position", "text"])
    return reasons, [l.split() for l in lines[header + 1 :]]


def test_molt_nb_sample_prints_a_token_table():
    out = subprocess.run(
        [BIN / "molt-nb", "sample", "--max-tokens", "24", "--update-at", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr
    reasons, rows = token_rows(out.stdout)
    assert len(reasons) == 3  # three default prompts
    for req, reason in reasons.items():  # 24 tokens each, unless the request sampled EOS
        ids = [int(r[3]) for r in rows if r[0] == str(req)]
        if reason == "length":
            assert len(ids) == 24
        else:
            assert reason == "stop" and ids[-1] == EOS and len(ids) <= 24
    versions = {int(r[-1]) for r in rows}
    assert versions <= {0, 1}
    if "length" in reasons.values():
        assert versions == {0, 1}  # the weight update landed while requests were in flight
    assert all(float(r[-2]) <= 0 for r in rows)  # logprobs
    for req in range(3):  # per request, versions never go back
        v = [int(r[-1]) for r in rows if r[0] == str(req)]
        assert v == sorted(v)


def test_molt_nb_sample_stops_at_eos(monkeypatch, capsys):
    "A request that samples the tokenizer's EOS ends there, with reason 'stop'."
    tok = build_tokenizer()
    model = tiny_dense(tok)
    # +50 on EOS's logit in every lm_head call: the prefill's, so each request's first token is EOS
    boost = lambda m, i, out: out.index_add(-1, torch.tensor([EOS]), torch.full_like(out[..., :1], 50.0))
    model.lm_head.register_forward_hook(boost)
    monkeypatch.setattr(cli, "_load", lambda name, seed: (model, tok))
    cli.main(["sample", "--max-tokens", "8", "--update-at", "-1"])
    reasons, rows = token_rows(capsys.readouterr().out)
    assert reasons == {0: "stop", 1: "stop", 2: "stop"}
    assert [(r[0], r[1], int(r[3])) for r in rows] == [(str(i), "0", EOS) for i in range(3)]


def test_molt_nb_rejects_an_unknown_command():
    out = subprocess.run([BIN / "molt-nb", "fly"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "invalid choice" in out.stderr


def test_sample_stops_at_every_end_of_turn_id():
    "The tokenizer's EOS and the model's own generation_config EOS ids (a chat checkpoint may end turns at another)."
    tok, model = build_tokenizer(), tiny_dense()
    model.generation_config.eos_token_id = [5, EOS]
    assert cli._stop_ids(model, tok) == (EOS, 5)
    model.generation_config.eos_token_id = None
    assert cli._stop_ids(model, tok) == (EOS,)


PARITY = Path(__file__).resolve().parents[1] / "recipes" / "parity"


def test_train_flags_go_anywhere(capsys):
    """`--no-control` before, after or between the overrides: every override is kept, so both typos are named (argparse
    blames nothing)."""
    for argv in (
        ["train", str(PARITY), "--no-control", "loop.stepz=1", "loop.sead=2"],
        ["train", "--no-control", str(PARITY), "loop.stepz=1", "loop.sead=2"],
        ["train", str(PARITY), "loop.stepz=1", "--no-control", "loop.sead=2"],
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        msg = str(e.value.code)
        assert (
            "2 mistakes" in msg
            and "loop.stepz: did you mean loop.steps?" in msg
            and "loop.sead: did you mean loop.seed?" in msg
        ), msg
    args = cli._parse(["train", "r", "a=1", "--no-control", "b=2"])
    assert (args.recipe, args.overrides, args.no_control) == ("r", ["a=1", "b=2"], True)
    with pytest.raises(SystemExit):
        cli._parse(["train", "r", "--no-contrl"])  # an unknown flag is still refused
    assert "unrecognized arguments: --no-contrl" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["gsm8k", "arith"])
def test_plan_refuses_a_cluster_without_nodes(recipe, capsys, no_checkpoint):
    """`molt-nb plan --nodes 0` (or negative) is refused with a message: it ended in a TypeError traceback (gsm8k) or
    planned "on 0 (nodes with GPUs) GPUs" (arith); the placement check refuses it too, for a caller past argparse"""
    path = str(PARITY.parent / recipe)
    for nodes in ("0", "-1"):
        with pytest.raises(SystemExit) as e:
            cli.main(["plan", path, "--nodes", nodes, "--gpus-per-node", "8"])
        assert e.value.code == 2 and f"argument --nodes: {nodes}: a cluster's count is a whole number >= 1" in (
            capsys.readouterr().err
        )
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", path, "--nodes", "1", "--gpus-per-node", "-8"])
    assert "argument --gpus-per-node: -8: a cluster's count is a whole number >= 0" in capsys.readouterr().err
    args = cli._parse(["plan", path, "--nodes", "1", "--gpus-per-node", "8"])
    args.nodes = 0
    with pytest.raises(SystemExit) as e:
        cli.plan_command(args)
    assert "does not fit 0 (no nodes) GPUs: the cluster has no nodes" in str(e.value.code), e.value.code
