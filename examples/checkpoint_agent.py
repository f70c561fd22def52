"""A small long-running "agent" that checkpoints its state as ordinary files.

It is what sealfs is for: an agent that writes its working memory, tool
outputs and credentials to a directory, crashes, and resumes from its last
checkpoint. It uses the standard atomic-replace pattern (write a temporary
file, fsync, rename over the checkpoint, fsync the directory); sealfs makes
that pattern durable and leaves only ciphertext in the store.

Usage: python checkpoint_agent.py STATE_DIR [--steps N] [--delay SECONDS]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

# Planted in the agent's state so the demo can show it never reaches the store.
CANARY_CREDENTIAL = "sk-demo-CANARY-do-not-leak-4f1c9e"


def load(state_dir: Path) -> dict[str, object]:
    path = state_dir / "checkpoint.json"
    if not path.exists():
        return {"step": 0, "memory": [], "credential": CANARY_CREDENTIAL, "digest": ""}
    return dict(json.loads(path.read_text()))


def save(state_dir: Path, state: dict[str, object]) -> None:
    """Atomic replace: the checkpoint is wholly old or wholly new after any crash."""
    tmp = state_dir / "checkpoint.json.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, state_dir / "checkpoint.json")
    dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def work(state: dict[str, object]) -> dict[str, object]:
    """One step: a pretend tool call whose output joins the working memory."""
    step = int(str(state["step"])) + 1
    memory = list(state["memory"])  # type: ignore[call-overload]
    observation = f"step {step}: tool output " + hashlib.sha256(str(step).encode()).hexdigest() * 8
    memory.append(observation)
    digest = hashlib.sha256((str(state["digest"]) + observation).encode()).hexdigest()
    return {**state, "step": step, "memory": memory, "digest": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--delay", type=float, default=0.1)
    args = parser.parse_args()
    args.state_dir.mkdir(parents=True, exist_ok=True)
    state = load(args.state_dir)
    if state["step"]:
        print(f"resumed from checkpoint at step {state['step']}", flush=True)
    while int(str(state["step"])) < args.steps:
        state = work(state)
        save(args.state_dir, state)
        print(f"checkpointed step {state['step']}", flush=True)
        time.sleep(args.delay)
    print(f"done: {state['step']} steps, digest {str(state['digest'])[:16]}", flush=True)


if __name__ == "__main__":
    main()
