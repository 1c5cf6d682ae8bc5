"""Which continuation RECAP's output store offers after a match: what most often followed it
(`SuffixAutomaton.frequent_path`, today's rule) against what followed its first occurrence
(`SuffixAutomaton.after`, the rule before), on two streams:

- ``demo``: the demo VLM starting from its shipped memory (300 earlier answers), over
  ``--scenes`` held-out scenes, as the ``recap+memory`` column of ``make demo`` does;
- ``mmspec``: SmolLM2 on MMSpec (``--limit`` inputs per topic, later turns given the earlier
  answers), a fresh stream per topic, as ``recap bench`` runs it.

    .venv/bin/python benchmarks/store_rules.py --sets demo,mmspec --scenes 40 --limit 2

The cost profile is the model's own (cached or measured), frozen for the run: drafting then
does not depend on timing, so each rule's numbers are deterministic and a difference is the
rule's. Prints per rule: tau over all steps, the mean of the units' tau, drafted nodes per
step and the modeled verify time (the profile's cost of every step). Both rules' outputs are
checked equal (they must be: drafts never change what is generated).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from recap.core.store import SEPARATOR
from recap.core.suffix import SuffixAutomaton
from recap.decoding import decode
from recap.models import load
from recap.proposers import make_proposer
from recap.verifier.profile import load_or_measure

FREQUENT = SuffixAutomaton.frequent_path


def first_occurrence(automaton: SuffixAutomaton, state: int, max_tokens: int, stop: int | None = None) -> list[int]:
    """The rule before: the tokens after the match's first occurrence, cut at ``stop``."""
    tokens = automaton.after(state, max_tokens)
    return tokens[: tokens.index(stop)] if stop in tokens else tokens


RULES = {"first-occurrence": first_occurrence, "most-frequent": FREQUENT}


def demo_stream(scenes: int):
    from recap.demo_vlm.memory import MEMORY, QUESTION
    from recap.demo_vlm.scenes import HELD_OUT_START, make_example

    target = load("recap-demo-vlm")
    prepared = [target.prepare(QUESTION, make_example(HELD_OUT_START + i).image()) for i in range(scenes)]

    def run():
        proposer = make_proposer("recap", memory_file=MEMORY)
        return [decode(target, proposer, inputs, max_new_tokens=64) for inputs in prepared]

    return target, run


def mmspec_stream(limit: int, data: str):
    from recap.bench import data as bench_data

    target = load("smollm2-135m")
    units = bench_data.units_of(bench_data.select(bench_data.load_items(bench_data.mmspec_path(data)), limit=limit))

    def run():
        streams, answers, results = {}, {}, []
        for unit in units:
            proposer = streams.setdefault(unit.topic, make_proposer("recap"))
            inputs = target.prepare(bench_data.messages_for(unit, answers.get(unit.item.id, [])), None)
            result = decode(target, proposer, inputs, max_new_tokens=64)
            text = target.tokenizer.decode(result.tokens, skip_special_tokens=True).strip()
            answers.setdefault(unit.item.id, []).append(text)
            results.append(result)
        return results

    return target, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="demo,mmspec")
    parser.add_argument("--scenes", type=int, default=40)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--data", default="mmspec")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert SEPARATOR < 0  # the store's separator is never a token
    for name in args.sets.split(","):
        target, run = demo_stream(args.scenes) if name == "demo" else mmspec_stream(args.limit, args.data)
        profile = dataclasses.replace(load_or_measure(target), correction_rate=0.0)
        target.use_cost_profile(profile)
        outputs = None
        for rule, walk in RULES.items():
            SuffixAutomaton.frequent_path = walk
            try:
                results = run()
            finally:
                SuffixAutomaton.frequent_path = FREQUENT
            steps = [it for result in results for it in result.iterations]
            tokens = [result.tokens for result in results]
            if outputs is not None and tokens != outputs:
                raise SystemExit(f"{name}: the rules' outputs differ: a losslessness bug")
            outputs = tokens
            committed = sum(len(t) - 1 for t in tokens)  # the prefill's token is not a step's
            print(json.dumps({
                "set": name, "rule": rule, "units": len(results), "threads": torch.get_num_threads(),
                "tau_all_steps": round(committed / len(steps), 3),
                "mean_unit_tau": round(float(np.mean([result.tau for result in results])), 3),
                "nodes_per_step": round(sum(it.draft_size for it in steps) / len(steps), 2),
                "modeled_verify_s": round(float(np.sum(profile.predict([it.draft_size + 1 for it in steps]))), 3),
                "profile": profile.source}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
