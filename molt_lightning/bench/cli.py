"""``molt-bench``: run matched protocols over seeds, import runs made elsewhere, compare two run sets.

    molt-bench run PROTOCOL --stack molt|molt-sync|trl|trl-rollout-func|tinker-cookbook --seeds N --out DIR
                   [--set steps=30] [--engine torch|vllm]
    molt-bench import FILE... --protocol PROTOCOL --source-stack verl|nemo-rl|slime|areal|... --out DIR
    molt-bench check RUNSET...  # collapse, NaN, missing/repeated steps, mismatch out of range, outliers, lengths
    molt-bench compare A B [--metric M] [--margin D|P%] [--by step|samples|wall] [--allow-diff FIELD] [--report DIR]
                           [--exclude SIDE:SEED] [--accept-check]
    molt-bench compare-published [NAME=]MEAN,SD,N [NAME=]MEAN,SD,N --goal max|min --margin D|P%  # a paper's numbers
    molt-bench heldout RUN_DIR | BEFORE.json AFTER.json [--margin D]  # held-out accuracy before/after, verdict
    molt-bench protocols        # the protocols shipped in protocols/, with fingerprints
    molt-bench reproduce NAME [--out DIR]   # re-run a result the READMEs report (--list: which)

Arguments are parsed before anything heavy is imported (``--help`` answers at once); torch, Lightning and TRL load
only inside ``run``. Errors a user can fix (a protocol mismatch, a missing column, a bad flag) print one message
naming the problem and the fix, and exit with status 2. The verdict never changes the exit status; ``check``
exits with 1 when it finds an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="molt-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a protocol's seeds on one stack here")
    r.add_argument("protocol", help="a protocol YAML path, or a name from protocols/ (e.g. arithmetic-tiny)")
    r.add_argument("--stack", required=True, help="molt | molt-sync | trl (stock TRL GRPOTrainer, its own generation; "
                   "single-turn protocols; --engine vllm: its vLLM colocate mode) | trl-rollout-func (TRL with the "
                   "protocol's multi-turn agent in rollout_func) | tinker-cookbook (tinker-cookbook's RL trainer "
                   "through molt tinker; single-turn protocols with model.lora)")
    r.add_argument("--seeds", type=int, default=None, help="run the protocol's first N seeds (default: all)")
    r.add_argument("--out", required=True, type=Path, help="output folder (resumed if it holds the same run)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change a protocol field for this run (recorded), e.g. --set steps=30")
    r.add_argument("--engine", default="torch", choices=("torch", "vllm"),
                   help="rollout engine (molt stacks; trl: its own generation, or its colocated vLLM)")
    r.add_argument("--torch-threads", type=int, default=None, help="molt stacks: trainer intra-op threads")
    r.add_argument("--no-admit-ahead", action="store_true", help="molt stacks: model.rollout.admit_ahead false "
                   "(only the batch the trainer waits for runs while it waits)")
    r.add_argument("--switch-interval-ms", type=float, default=None,
                   help="molt stacks: model.rollout.switch_interval_ms")

    i = sub.add_parser("import", help="import runs made elsewhere (one file or folder per seed)")
    i.add_argument("sources", nargs="+", type=Path, help="metrics files or folders, one per seed")
    i.add_argument("--protocol", required=True, help="the protocol those runs followed")
    i.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="protocol fields those runs changed, e.g. --set max_lag=2")
    i.add_argument("--source-stack", required=True, help="whose column names: molt, trl, trl-wandb, slime, "
                   "nemo-rl, verl, areal, roll, labs-molt, openrlhf, tinker-cookbook (its metrics.jsonl), or custom "
                   "(then give every --map)")
    i.add_argument("--format", default=None, help="lightning-csv | jsonl | tensorboard | wandb-csv | nemo-rl-json | "
                   "verl-console | slime-console | areal-console (default: guess)")
    i.add_argument("--map", dest="maps", action="append", default=[], metavar="NAME=COLUMN",
                   help="map a protocol metric (or step, samples_per_step, step_base) to a source column")
    i.add_argument("--step-key", default=None, help="the source's step column, if not a usual name")
    i.add_argument("--seed-ids", default=None, help="comma-separated seed of each run, in order (default 0..N-1)")
    i.add_argument("--devices", type=int, default=1, help="devices per run (divides per-device metrics)")
    i.add_argument("--label", default=None, help="a name for this run set in reports")
    i.add_argument("--out", required=True, type=Path)

    c = sub.add_parser("compare", help="compare two run sets with a named test and a verdict")
    c.add_argument("a", type=Path, help="run set A")
    c.add_argument("b", type=Path, help="run set B (the reference for relative margins)")
    c.add_argument("--metric", action="append", default=None, help="metric(s) to compare (default: the protocol's)")
    c.add_argument("--margin", default=None, help="equivalence margin: a number, or N%% of B's mean")
    c.add_argument("--goal", default=None, choices=("max", "min"), help="for metrics the protocol does not list")
    c.add_argument("--by", default="step", choices=("step", "samples", "wall"), help="x axis and horizon")
    c.add_argument("--summary", default=None, choices=("final", "mean", "auc", "ttt"),
                   help="override the protocol's; ttt: time to the metric's threshold (with --by wall: seconds)")
    c.add_argument("--threshold", type=float, default=None, help="override the metric's threshold (time to threshold)")
    c.add_argument("--allow-diff", action="append", default=[], metavar="FIELD",
                   help="a protocol field the runs may differ in (e.g. max_lag); repeat for several")
    c.add_argument("--alpha", type=float, default=0.05)
    c.add_argument("--power", type=float, default=0.8, help="target power for the seed-count advice")
    c.add_argument("--exclude", action="append", default=[], metavar="SIDE:SEED",
                   help="leave a seed out (e.g. one `check` flags), recorded in the report; repeat for several")
    c.add_argument("--accept-check", action="store_true",
                   help="give verdicts even over seeds that `molt-bench check` finds errors in")
    c.add_argument("--report", type=Path, default=None, help="report folder (default bench-reports/A-vs-B)")
    c.add_argument("--no-report", action="store_true", help="print only")

    cp = sub.add_parser("compare-published", help="the verdict from published mean, SD and runs per side",
                        description="Welch, TOST, CIs, verdict and runs needed from two published summaries (e.g. "
                        "a paper's 119.4 +- 2.3 s over 3 runs). Mann-Whitney, IQM and bootstrap need per-run values "
                        "and are not computed.")
    cp.add_argument("a", help="side A as [NAME=]MEAN,SD,N, e.g. molt=119.4,2.3,3 (SD over runs, not a standard error)")
    cp.add_argument("b", help="side B, the reference for relative margins, e.g. baseline=109.5,10.3,3")
    cp.add_argument("--goal", required=True, choices=("max", "min"), help="which way is better (min: step time)")
    cp.add_argument("--margin", required=True, help="equivalence margin: a number, or N%% of B's mean (e.g. 10%%)")
    cp.add_argument("--metric", default="metric", help="the metric's name, for the report")
    cp.add_argument("--alpha", type=float, default=0.05)
    cp.add_argument("--power", type=float, default=0.8, help="target power for the runs-needed advice")
    cp.add_argument("--json", action="store_true", help="print the numbers as JSON instead")

    k = sub.add_parser("check", help="sanity checks on run sets (compare runs them too, before any verdict)")
    k.add_argument("runsets", nargs="+", type=Path)
    k.add_argument("--metric", action="append", default=None, help="the metrics you will compare (default: the "
                   "protocol's); NaN in those is an error, elsewhere a warning")

    h = sub.add_parser("heldout", help="held-out accuracy before and after training (Evaluate's rounds or two "
                       "`molt eval --out` files), with the verdict")
    h.add_argument("paths", nargs="+", type=Path, help="a run folder (its eval.jsonl), or BEFORE.json AFTER.json")
    h.add_argument("--margin", type=float, default=0.05, help="equivalence margin in accuracy (default 0.05)")

    sub.add_parser("protocols", help="list the shipped protocols and their fingerprints")

    rp = sub.add_parser("reproduce", help="re-run a reported result (benchmarks/reported.yaml) and write its "
                        "report next to the reported numbers")
    rp.add_argument("name", nargs="?", help="the result's name (see --list)")
    rp.add_argument("--list", action="store_true", help="list the reported results")
    rp.add_argument("--out", type=Path, default=None, help="output folder (default reproductions/NAME)")
    rp.add_argument("--registry", type=Path, default=None, help="another registry file (tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .protocol import ProtocolError
    from .runs import RunSetError

    try:
        return COMMANDS[args.command](args)
    except (ProtocolError, RunSetError, FileExistsError, ValueError, ImportError) as e:
        print(f"molt-bench {args.command}: error: {e}", file=sys.stderr)
        return 2


def cmd_run(args) -> int:
    from .protocol import load_protocol
    from .runner import run

    protocol = load_protocol(args.protocol, args.overrides)
    out = run(protocol, args.stack, args.seeds, args.out,
              {"engine": args.engine, "torch_threads": args.torch_threads, "admit_ahead": not args.no_admit_ahead,
               "switch_interval_ms": args.switch_interval_ms})
    print(f"[molt-bench] wrote {out}")
    return 0


def cmd_import(args) -> int:
    from .protocol import load_protocol
    from .runner import import_runs

    protocol = load_protocol(args.protocol, args.overrides)
    seeds = [int(s) for s in args.seed_ids.split(",")] if args.seed_ids else None
    out = import_runs(args.sources, protocol, args.source_stack, args.out, args.format, args.maps, seeds,
                      args.step_key, args.devices, args.label)
    from .runs import MANIFEST

    imported = json.loads((out / MANIFEST).read_text())["seeds"]
    print(f"[molt-bench] imported {len(imported)} run(s) from {len(args.sources)} source(s) into {out}")
    for seed, info in imported.items():
        used = ", ".join(f"{k} <- {v}" for k, v in info["columns_used"].items() if k != "step")
        missing = f"; missing: {', '.join(info['missing_metrics'])}" if info["missing_metrics"] else ""
        print(f"  seed {seed}: {info['imported_from']}, {info['steps']} rows; {used}{missing}")
    return 0


def cmd_compare(args) -> int:
    from . import report
    from .compare import compare_runsets, text_report

    a, b, allowed, results = compare_runsets(
        args.a, args.b, args.metric, by=args.by, summary=args.summary, margin=args.margin, goal=args.goal,
        threshold=args.threshold,
        allow=args.allow_diff, alpha=args.alpha, power=args.power, exclude=args.exclude,
        accept_check=args.accept_check)
    print(text_report(a, b, allowed, results))
    if not args.no_report:
        folder = args.report or Path("bench-reports") / f"{a.path.name}-vs-{b.path.name}"
        paths = report.write(folder, a, b, allowed, results)
        print(f"\nreport: {paths['markdown']}  {paths['html']}")
    return 0


def cmd_compare_published(args) -> int:
    from .published import compare_published, parse_side, text_report

    c = compare_published(parse_side(args.a, "A"), parse_side(args.b, "B"), margin=args.margin, goal=args.goal,
                          alpha=args.alpha, power=args.power, metric=args.metric)
    print(json.dumps(c.as_dict(), indent=1) if args.json else text_report(c, args.power))
    return 0


def cmd_check(args) -> int:
    from . import check
    from .runs import load_runset

    found_errors = False
    for path in args.runsets:
        rs = load_runset(path)
        findings = check.check_runset(rs, args.metric)
        found_errors |= bool(check.errors(findings))
        print(check.text(rs, findings))
    return 1 if found_errors else 0


def cmd_heldout(args) -> int:
    from .heldout import heldout

    print(heldout(args.paths, args.margin))
    return 0


def cmd_protocols(args) -> int:
    from .protocol import PROTOCOL_DIR, load_protocol

    protocols = [(load_protocol(path), path) for path in sorted(PROTOCOL_DIR.glob("*.yaml"))]
    width = max((len(p.name) for p, _ in protocols), default=0)
    for p, path in protocols:
        print(f"{p.name:{width}s}  {p.fingerprint}  {path}")
    return 0


def cmd_reproduce(args) -> int:
    from . import reproduce

    registry = args.registry or reproduce.REGISTRY
    if args.list or not args.name:
        print(reproduce.listing(registry))
        return 0
    report = reproduce.reproduce(args.name, args.out, registry)
    print(report.read_text())
    print(f"[molt-bench] wrote {report}")
    return 0


COMMANDS = {"run": cmd_run, "import": cmd_import, "check": cmd_check, "compare": cmd_compare,
            "compare-published": cmd_compare_published, "heldout": cmd_heldout,
            "protocols": cmd_protocols, "reproduce": cmd_reproduce}

if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep the entry point guarded
    sys.exit(main())
