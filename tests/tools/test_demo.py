"""The demo (issue 3, point 7): ``orbax-safetensors demo DIR`` trains, crashes, resumes.

Runs the real console script in a subprocess with a short run (110 steps: checkpoints at 50 and
100, a SIGKILL at step 109, a resume, a final checkpoint at 110) and checks what it left, and
that its piped output holds lines only (the progress bar is for terminals).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

STEPS = 110
SAVE_EVERY = 50
CRASH_AT = STEPS - 1
MAX_TO_KEEP = 2
# tqdm's marks: a redraw, a bar, a rate, a percentage followed by a bar.
PROGRESS_MARKS = re.compile(r"\r|[\u2588-\u258f]|[?\d][kMGTP]?(it|B|step)/s|\d%\|")


def _command() -> list[str]:
    script = shutil.which("orbax-safetensors")
    if script is not None:
        return [script]
    return [sys.executable, "-m", "orbax_safetensors.cli"]


@pytest.mark.timeout(240)
def test_demo_crashes_and_resumes_with_identical_losses(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    proc = subprocess.run(
        [*_command(), "demo", str(root), "--steps", str(STEPS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=220,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert f"checkpoints go to {root}" in out
    # stdout and stderr are pipes here (as in a CI log): no progress bar in either, only lines.
    for stream in (out, proc.stderr):
        bar = PROGRESS_MARKS.search(stream)
        assert bar is None, f"progress bar in piped output: {stream[max(0, bar.start() - 200) :]}"
    assert "simulating a crash (SIGKILL)" in out

    # It resumed from a committed checkpoint step written before the crash.
    match = re.search(r"resumed from step (\d+)", out)
    assert match, out[-3000:]
    resumed = int(match.group(1))
    assert resumed % SAVE_EVERY == 0 and 0 < resumed < CRASH_AT

    # losses.jsonl holds the crashed run's steps 1..CRASH_AT, then the resumed run's steps.
    records = [json.loads(line) for line in (root / "losses.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == list(range(1, CRASH_AT + 1)) + list(range(resumed + 1, STEPS + 1))
    crashed = {r["step"]: r["loss"] for r in records[:CRASH_AT]}
    replayed = {r["step"]: r["loss"] for r in records[CRASH_AT:]}
    first = resumed + 1
    assert replayed[first] == crashed[first]  # bit-identical: the state was restored exactly
    overlap = sorted(set(crashed) & set(replayed))
    np.testing.assert_allclose(
        [replayed[s] for s in overlap], [crashed[s] for s in overlap], rtol=1e-6
    )
    assert "identical" in out and "DIFFERENT" not in out

    # max_to_keep steps remain, the latest is the final step, no partial step is left.
    kept = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())
    assert len(kept) == MAX_TO_KEEP
    assert kept == [STEPS - STEPS % SAVE_EVERY, STEPS]
    assert not list(root.glob("*.orbax-checkpoint-tmp"))
    assert f"finished at step {STEPS}" in out

    # The final step is a standard safetensors file any reader opens.
    item = root / str(STEPS) / "state"
    tensors = load_file(str(item / "model.safetensors"))
    assert any(k.startswith("model.") for k in tensors)
    assert any(k.startswith("optimizer.") for k in tensors)
    meta = json.loads((root / str(STEPS) / "meta" / "metadata").read_text())
    assert meta["step"] == STEPS
    assert meta["loss"] == replayed[STEPS]
