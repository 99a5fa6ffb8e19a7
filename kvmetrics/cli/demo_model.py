"""``kvmetrics demo-model``: a tiny Llama (config and seeded weights) for a demo server."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmetrics.cli.common import Command, fail, say


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="DIR", help="where to write config.json and "
                   "model.safetensors (created; existing weights are kept)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seeds the weights")


def _run(args: argparse.Namespace) -> int:
    from kvmetrics.lab.demo_model import write_tiny_llama
    from kvmetrics.metrics.files import FileRefused

    folder = Path(args.folder)
    if folder.is_symlink() and not folder.exists():
        # mkdir on a dangling link fails with "File exists", which names no cause.
        return fail(f"{folder} is a link to {folder.readlink()}, which does not exist: "
                    "create that folder or remove the link")
    if folder.exists() and not folder.is_dir():
        return fail(f"{folder} is not a directory")
    if not folder.parent.is_dir():
        return fail(f"{folder.parent} does not exist")
    try:
        write_tiny_llama(folder, seed=args.seed)
    except FileRefused as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot write {folder}: {e.strerror}")
    say(f"tiny Llama written to {folder} (serve it with scripts/demo-vllm-serve.sh)")
    return 0


COMMAND = Command(
    "demo-model", "write a tiny Llama (no download) for a demo vllm serve", _add, _run,
    description="Write config.json and seeded random float32 weights of a two-layer Llama "
    "(vocabulary 1024) that vLLM's CPU build serves in seconds. No tokenizer: send token "
    "ids (the demo server runs with --skip-tokenizer-init).",
    examples=("kvmetrics demo-model tiny-llama",
              "bash scripts/demo-vllm-serve.sh      # writes it and starts vllm serve"))
