"""Compare training runs: the paper's curves and tables as PNGs and one markdown report (§4.1-4.3, App. E).

    python -m experiments.report runs/respo_n8 runs/grpo_n8                 # -> runs/report/report.md
    python -m experiments.report runs/respo_synthetic                       # -> runs/respo_synthetic/report/
    python -m experiments.report runs/a runs/b --out reports/a_vs_b --eval runs/a=evals/a

Each RUN_DIR is a run.out_dir of `python -m experiments.train` (config.json, metrics.jsonl, rollout files)
with, optionally, evaluation outputs of `python -m experiments.evaluate` in RUN_DIR/eval (or given with
--eval RUN_DIR=EVAL_DIR). Writes into --out (default: RUN_DIR/report for one run, else `report/` in the
runs' common parent directory):

  report.md            runs, early/late summary, Tab. 1, length bins (Tab. 4), Tabs. 5-7, linking the PNGs
  training_curves.png  training score (score+1)/2, response length, approx. KL, entropy vs policy updates
  length_bins.png      accuracy per shared response-length bin, per N (when evaluations exist)
  report.json          every table's numbers

Windows follow the paper (early peak through update 256, late mean over the last 128 of 1,024) and are
scaled to the shortest run when it is shorter; --early-until / --late-window set them explicitly. A
directory that is not a run, or files that disagree with each other, fail with one line naming them.
"""

from __future__ import annotations

import argparse
import os
import sys

from experiments.cli import ArgumentParser, run_cli
from respo_jax.eval.report import (
    PAPER_E3_BATCHES,
    ReportError,
    build_report,
    load_runs,
    summary_windows,
    write_report,
)
from respo_jax.runs import REPORT_DIR


def default_out_dir(run_dirs: list[str]) -> str:
    """RUN_DIR/report for one run; for several, report/ in their common parent directory."""
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], REPORT_DIR)
    parents = [os.path.dirname(os.path.abspath(os.path.normpath(d))) for d in run_dirs]
    return os.path.join(os.path.commonpath(parents), REPORT_DIR)


def _eval_dirs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        run, sep, path = pair.partition("=")
        if not sep or not run or not path:
            raise ReportError(f"--eval {pair!r}: expected RUN_DIR=EVAL_DIR")
        out[run] = path
    return out


class ReportWriteError(RuntimeError):
    """The report was built but could not be written (a full disk): exit status 1, one line."""


def _check_writable(out: str) -> None:
    """ReportError (before any work) when `out` cannot become a directory this process writes into."""
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ReportError(f"--out {out!r}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        raise ReportError(f"--out {out!r}: {existing} is not writable")


def main(argv: list[str] | None = None) -> str:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="training run directories")
    parser.add_argument("--out", default=None, help="output directory (see above for the default)")
    parser.add_argument("--eval", action="append", default=[], metavar="RUN_DIR=EVAL_DIR",
                        help="evaluation outputs of a run kept outside RUN_DIR/eval (repeatable)")
    parser.add_argument("--early-until", type=float, default=None,
                        help="early-peak window end in policy updates (default: 256, scaled for short runs)")
    parser.add_argument("--late-window", type=float, default=None,
                        help="late-mean window length in policy updates (default: 128, scaled for short "
                        "runs)")
    parser.add_argument("--e3-batches", type=int, default=PAPER_E3_BATCHES,
                        help="App. E.3 diagnostic window in rollout batches (default: the paper's 16)")
    parser.add_argument("--bins", type=int, default=10, help="response-length bins (App. E.2: 10)")
    parser.add_argument("--title", default=None, help="the report's title")
    args = parser.parse_args(argv)
    if args.bins < 3:
        parser.error(f"--bins must be >= 3 (two quantile bins and the cap bin); got {args.bins}")
    if args.e3_batches < 1:
        parser.error(f"--e3-batches must be >= 1; got {args.e3_batches}")

    runs = load_runs(args.run_dirs, _eval_dirs(args.eval))
    out = args.out or default_out_dir(args.run_dirs)
    _check_writable(out)
    windows = summary_windows(runs, args.early_until, args.late_window)
    title = args.title or "Run report: " + ", ".join(run.label for run in runs)
    report = build_report(runs, windows=windows, e3_batches=args.e3_batches, num_bins=args.bins, title=title)
    try:
        path = write_report(report, out)
    except OSError as err:
        raise ReportWriteError(f"writing the report to {out} failed: {err}") from None
    for run in runs:
        for note in run.notes:
            print(f"note: {note}", file=sys.stderr)
    print(f"report: {path}")
    return path


def cli(argv: list[str]) -> int:
    """`main` for the command line: bad flags, a bad run directory or --out, mismatched files
    (ReportError, and the statistics' checks of their inputs: ValueErrors) are one line on stderr and
    exit status 2; a report that cannot be written once built, one line and exit status 1."""
    return run_cli(main, argv, failures=(ReportWriteError,), usage_errors=(ValueError,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
