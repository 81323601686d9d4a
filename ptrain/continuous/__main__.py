"""`python -m ptrain.continuous`: look after a continuous run from the shell.

python -m ptrain.continuous rollback R [--no-push] [--url URL]   the previous champion again, pushed
python -m ptrain.continuous push R                   push the champion to continuous.serve_urls again
python -m ptrain.continuous rerun R K OUT            repeat round K from its saved config into OUT
python -m ptrain.continuous status R                 the champion and the leaderboard, a line per round
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ptrain.continuous", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rollback", help="make the previous champion current again and push it")
    p.add_argument("run_dir")
    p.add_argument("--no-push", action="store_true", help="move the pointer only")
    p.add_argument("--url", action="append", help="push here (repeatable) instead of the run's continuous.serve_urls")
    p = sub.add_parser("push", help="push the current champion to the run's continuous.serve_urls")
    p.add_argument("run_dir")
    p = sub.add_parser("rerun", help="run round K again from its saved config into OUT")
    p.add_argument("run_dir")
    p.add_argument("round", type=int)
    p.add_argument("out_dir")
    p = sub.add_parser("status", help="print the champion and one line per decided round")
    p.add_argument("run_dir")
    args = parser.parse_args(argv)

    from ptrain.continuous import ledger, loop

    try:
        if args.command == "rollback":
            loop.rollback(args.run_dir, push=not args.no_push, urls=args.url)
        elif args.command == "push":
            state = ledger.load_state(args.run_dir)
            urls = loop.serve_urls(args.run_dir)
            if state["champion"] is None or not urls:
                raise ValueError(f"{args.run_dir}: nothing to push (no champion, or continuous.serve_urls is empty)")
            outcomes = loop.push_weights(urls, state["champion"], f"round-{state['champion_round']}")
            print(json.dumps(outcomes, indent=2))
            return 0 if all(o["ok"] for o in outcomes) else 1
        elif args.command == "rerun":
            print(loop.rerun(args.run_dir, args.round, args.out_dir))
        else:
            state = ledger.load_state(args.run_dir)
            print(f"champion: {state['champion']} (round {state['champion_round']})")
            for row in ledger.read_jsonl(os.path.join(args.run_dir, ledger.LEADERBOARD)):
                envs = " ".join(f"{n}={e['champion_after']:.3f}" for n, e in sorted(row["envs"].items()))
                print(f"round {row['round']:>3} {row['decision']:<9} ${row['cost_usd']['total']:.4f}  {envs}")
    except (ValueError, FileNotFoundError) as e:
        print(f"ptrain.continuous: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
