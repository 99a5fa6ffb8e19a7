"""``python -m kvmetrics.lab.vllm.mutations --budget N --seed S [--jobs J]``:
generate mutants of vLLM's counted path, run each, print the table; exit 1 on any
SILENT or CRASH (and on an unchanged vLLM that is not CORRECT)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from kvmetrics.lab.vllm.mutations import campaign, generator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmetrics.lab.vllm.mutations",
                                     description=__doc__)
    parser.add_argument("--budget", type=int, default=30, help="mutants to run")
    parser.add_argument("--seed", type=int, default=0, help="which sites are drawn")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--site", metavar="MODULE:OPERATOR:SITE", action="append",
                        default=[], help="also run the first mutant whose site starts with "
                        "SITE (repeatable; with --budget 0, only these)")
    args = parser.parse_args(argv)
    if args.budget < 0 or args.jobs < 1:
        parser.error("--budget must be >= 0 and --jobs >= 1")
    chosen = (generator.generate(args.budget, args.seed,
                                 generator.counted_modules(overlayable_only=True))
              if args.budget else [])
    for wanted in args.site:
        try:
            module, operator, prefix = wanted.split(":", 2)
            chosen.append(generator.mutant_at(module, operator, prefix))
        except (ValueError, LookupError) as e:
            parser.error(f"--site {wanted}: {e}")
    mutants = [None, *chosen]
    print(f"{len(mutants) - 1} mutants (seed {args.seed}) and vLLM unchanged", flush=True)
    outcomes = campaign.run_all(mutants, args.jobs,
                                progress=lambda o: print(campaign.row(o), flush=True))
    print("\nmutant  module  operator  site  class  differs  flags")
    for outcome in outcomes:
        print(campaign.row(outcome))
    counts = Counter(o.verdict for o in outcomes[1:])
    print("\n" + ", ".join(f"{v} {counts.get(v, 0)}" for v in
                           ("CORRECT", "FLAGGED", "SILENT", "CRASH", "INVALID")))
    bad = counts.get("SILENT", 0) + counts.get("CRASH", 0)
    return 1 if bad or outcomes[0].verdict != "CORRECT" else 0


if __name__ == "__main__":
    sys.exit(main())
