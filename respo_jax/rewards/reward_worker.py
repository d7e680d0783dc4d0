"""One worker process of a slow user reward: reads JSON-line tasks on stdin, writes JSON-line results.

Started by `respo_jax.rewards.scoring.RewardPool` as `python -m respo_jax.rewards.reward_worker`, a fresh
interpreter (never a fork of the trainer). It finds the reward again without pickle: it imports the
module, or runs the file (a `--config` file included, under a module name other than `__main__`), that
defined the function, calls the file's `get_config()` when that is where the registration happens, and
looks the reward up by name. The protocol is `math_verify_worker`'s: first `{"ready": true, "pid"}`,
then for each task `{"id", "record", "response"}` one line `{"id", "score", "status", "soft_timeout",
"detail"}`, status "ok" (the score may be non-finite; the parent decides) or "error" (the reward raised
or returned something that is not a real number).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import numbers
import os
import sys


def load_reward(kind: str, source: str, name: str):
    """The reward function `name`: from module "module:function" (kind "module"), or registered by
    running file `source` (kind "file", under a module name other than `__main__`)."""
    from respo_jax.rewards.registry import REWARDS, get_reward

    if kind == "module":
        module_name, qualname = source.split(":", 1)
        module = importlib.import_module(module_name)
        if name not in REWARDS:  # a module-level function registered by someone else
            return getattr(module, qualname)
        return get_reward(name).fn
    else:
        spec = importlib.util.spec_from_file_location("reward_source", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if name not in REWARDS and hasattr(module, "get_config"):  # registered inside get_config()
        module.get_config()
    return get_reward(name).fn


def _score(fn, task: dict) -> dict:
    status, detail, score = "ok", "", 0.0
    try:
        value = fn(task["record"], task["response"])
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            status, detail = "error", f"returned {type(value).__name__}, not a real number"
        else:
            score = float(value)
    except Exception as error:  # noqa: BLE001 - any failure of user code is one failed response
        status, detail = "error", f"{type(error).__name__}: {str(error)[:300]}"
    return {"id": task["id"], "score": score, "status": status, "soft_timeout": False, "detail": detail}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source-kind", choices=("module", "file"), required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    # The protocol keeps a private copy of stdout; whatever the reward prints goes to stderr.
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    fn = load_reward(args.source_kind, args.source, args.name)

    def write(message: dict) -> None:
        protocol_out.write(json.dumps(message, ensure_ascii=True).encode("ascii") + b"\n")
        protocol_out.flush()

    write({"ready": True, "pid": os.getpid()})
    for line in sys.stdin.buffer:
        write(_score(fn, json.loads(line)))


if __name__ == "__main__":
    main()
