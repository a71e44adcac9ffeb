"""The demo: train a small NNX model, checkpoint it asynchronously through Orbax's
CheckpointManager as safetensors, crash hard mid-run, resume from the latest step.

Run it as ``orbax-safetensors demo [DIR]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax import v0 as _v0
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.tools.inspection import stderr_is_terminal

DEFAULT_STEPS = 300
SAVE_EVERY = 50
CRASH_AT = 180


def _model_and_optimizer(seed: int) -> tuple[Any, Any]:
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = _jaxcompat.nnx_list(  # nnx.List on flax >= 0.12
                [
                    nnx.Linear(8, 64, rngs=rngs),
                    nnx.Linear(64, 64, rngs=rngs),
                    nnx.Linear(64, 1, rngs=rngs),
                ]
            )

        def __call__(self, x: Any) -> Any:
            for layer in self.layers[:-1]:
                x = nnx.gelu(layer(x))
            return self.layers[-1](x)

    model = MLP(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    return model, optimizer


def _batch(step: int) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.fold_in(jax.random.key(0), step), (128, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True)) + 0.1 * jnp.cos(3 * x[:, :1])
    return x, y


def _train_step_fn() -> Any:
    from flax import nnx

    @nnx.jit
    def train_step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
        def loss_fn(m: Any) -> Any:
            return ((m(x) - y) ** 2).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return train_step


def _note(text: str) -> None:
    """A line on stdout that does not break the progress bar (on stderr, if shown)."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def run_training(directory: str, start_fresh: bool, total_steps: int, crash_at: int | None) -> None:
    """Trains, checkpointing every SAVE_EVERY steps; optionally SIGKILLs itself at ``crash_at``."""
    import orbax.checkpoint as ocp
    from flax import nnx
    from tqdm import tqdm

    model, optimizer = _model_and_optimizer(seed=0)
    train_step = _train_step_fn()
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    mngr = ocp.CheckpointManager(directory, options=options)
    start = 0
    latest = None if start_fresh else mngr.latest_step()
    if latest is not None:
        abstract = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        restored = mngr.restore(
            latest,
            args=ocp.args.Composite(
                state=_v0.SafetensorsRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        nnx.update(model, restored["state"]["model"])
        nnx.update(optimizer, restored["state"]["optimizer"])
        start = latest
        print(
            f"resumed from step {latest} (loss there was {restored['meta']['loss']:.4f}); "
            f"files: {os.path.join(directory, str(latest), 'state')}",
            flush=True,
        )
    bar = tqdm(
        range(start, total_steps),
        desc="training",
        unit="step",
        initial=start,
        total=total_steps,
        file=sys.stderr,
        disable=not stderr_is_terminal(),  # a bar only on a terminal, never in piped output
        mininterval=0.5,
    )
    loss = float("nan")
    log_path = os.path.join(directory, "losses.jsonl")
    replayed: dict[int, float] = {}
    if latest is not None and os.path.exists(log_path):
        with open(log_path) as f:
            replayed = {r["step"]: r["loss"] for r in map(json.loads, f)}
    log = open(log_path, "a")  # noqa: SIM115 - kept open for the whole run
    for step in bar:
        x, y = _batch(step)
        loss = float(train_step(model, optimizer, x, y))
        done = step + 1
        if done in replayed and done == start + 1:
            same = "identical" if replayed[done] == loss else "DIFFERENT"
            _note(
                f"  step {done}: loss {loss:.6f}; the crashed run had {replayed[done]:.6f} "
                f"at this step ({same}: training continues exactly where it stopped)"
            )
        log.write(json.dumps({"step": done, "loss": loss}) + "\n")
        log.flush()
        if done % 10 == 0:
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if done % SAVE_EVERY == 0 or done == total_steps:
            state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
            mngr.save(
                done,
                args=ocp.args.Composite(
                    state=_v0.SafetensorsSave(state),
                    meta=ocp.args.JsonSave({"loss": loss, "step": done}),
                ),
            )
            _note(f"  step {done}: loss {loss:.4f}, async checkpoint started")
        if crash_at is not None and done == crash_at:
            _note(f"  step {done}: simulating a crash (SIGKILL), with no chance to clean up")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    mngr.wait_until_finished()
    mngr.close()
    bar.close()
    log.close()
    print(f"finished at step {total_steps}, loss {loss:.4f}", flush=True)


def main(directory: str | None = None, steps: int = DEFAULT_STEPS) -> int:
    """The demo's entry point; returns a process exit code."""
    directory = os.path.abspath(directory or tempfile.mkdtemp(prefix="orbax-safetensors-demo-"))
    os.makedirs(directory, exist_ok=True)
    crash_at = min(CRASH_AT, steps - 1)
    t0 = time.time()
    print(f"orbax-safetensors demo: checkpoints go to {directory}", flush=True)
    print(f"1/2  training run that will crash at step {crash_at}", flush=True)
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "orbax_safetensors._src.tools.demo",
            "train",
            directory,
            str(steps),
            str(crash_at),
        ],
        check=False,
    )
    if child.returncode != -signal.SIGKILL:
        print(
            f"the training run exited with {child.returncode}, not the simulated crash", flush=True
        )
        return 1
    print("2/2  a fresh process resumes from the latest committed checkpoint", flush=True)
    run_training(directory, start_fresh=False, total_steps=steps, crash_at=None)
    _report(directory)
    print(f"done in {time.time() - t0:.1f} s", flush=True)
    return 0


def _report(directory: str) -> None:
    steps = [step for step, _ in _steps.list_steps(directory)]
    print(f"kept steps (max_to_keep=2): {steps}")
    item = os.path.join(directory, str(steps[-1]), "state")
    meta = _read.read_metadata(item)
    total = sum(os.path.getsize(os.path.join(item, f)) for f in meta["files"])
    print(
        f"latest step's arrays: {item}/{meta['files'][0]} ({len(meta['tensors'])} tensors, {total} bytes)"
    )
    print("open it with any safetensors reader, e.g.:")
    print(
        f"  python -c \"from safetensors.numpy import load_file; print(list(load_file('{item}/{meta['files'][0]}')))\""
    )


if __name__ == "__main__":  # the training run main() starts, and kills, in a child process
    _, _, directory, steps, crash_at = sys.argv
    run_training(directory, start_fresh=True, total_steps=int(steps), crash_at=int(crash_at))
