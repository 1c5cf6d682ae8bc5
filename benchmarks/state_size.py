"""Size of RECAP's proposer state over a long stream (no model needed).

    .venv/bin/python benchmarks/state_size.py --requests 400 --vocab 49152

Replays a stream of requests on the synthetic language of `recap.overhead.SyntheticTarget`
(prompts of 384 tokens, 128 new tokens each) and reports, at checkpoints, the rows held by U
(persistent, at most one per vocabulary token) and by C/G (request-local: measured at the end
of a request, before they are cleared), with the payload size of the rows.
"""

from __future__ import annotations

import argparse
import json

from recap.decoding import decode
from recap.overhead import SyntheticTarget
from recap.proposers import RecapProposer


class _Peek(RecapProposer):
    """Records the C/G sizes just before each request ends (they are cleared then)."""

    def end_request(self) -> None:
        self.last_request = {"C": len(self.memory.bigram), "G": len(self.memory.trigram),
                             "bytes_with_cg": self.memory.nbytes()}
        super().end_request()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target = SyntheticTarget(args.vocab, seed=0)
    proposer = _Peek()
    checkpoints = {1, 10, 50, 100, 200, args.requests}
    report = []
    for request in range(1, args.requests + 1):
        prompt = target.sample_prompt(args.prompt_tokens, seed=request)
        decode(target, proposer, prompt, max_new_tokens=args.max_new_tokens)
        if request in checkpoints:
            row = {"requests": request, "U_rows": len(proposer.memory.unigram),
                   "U_MiB": proposer.memory.nbytes() / 2**20, **proposer.last_request}
            row["bytes_with_cg"] = row["bytes_with_cg"] / 2**20
            report.append(row)
            print(f"after {request:4d} requests: U {row['U_rows']:6d} rows ({row['U_MiB']:.2f} MiB); "
                  f"last request's C {row['C']:5d} / G {row['G']:5d} rows (all maps {row['bytes_with_cg']:.2f} MiB)",
                  flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"vocab": args.vocab, "checkpoints": report}, handle, indent=2)


if __name__ == "__main__":
    main()
