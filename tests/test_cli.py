"""The README's main-job command, run as a user would."""
import subprocess, sys, os
from pathlib import Path

BIN = Path(sys.executable).parent


def test_molt_nb_sample_prints_a_token_table():
    out = subprocess.run([BIN / "molt-nb", "sample", "--max-tokens", "24", "--update-at", "3"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, l in enumerate(lines) if l.split()[:3] == ["request", "position", "text"])
    rows = [l.split() for l in lines[header + 1:]]
    assert len(rows) == 3 * 24 # three default prompts, 24 tokens each
    versions = {int(r[-1]) for r in rows}
    assert versions == {0, 1} # the weight update landed while requests were in flight
    assert all(float(r[-2]) <= 0 for r in rows) # logprobs
    for req in range(3): # per request, versions never go back
        v = [int(r[-1]) for r in rows if r[0] == str(req)]
        assert v == sorted(v)


def test_molt_nb_rejects_an_unknown_command():
    out = subprocess.run([BIN / "molt-nb", "fly"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "invalid choice" in out.stderr
