"""The speculative decoding stage of `scripts/gpu-check`: `tandem bench spec` (its fast
preset on the GPU) with each speculative method this tree serves, figures into the report."""
from __future__ import annotations

import json
import os
from typing import Any

from tandem_serve.bench.gpu_check.plans import Plan
from tandem_serve.bench.gpu_check.report import Budget, say
from tandem_serve.bench.gpu_check.supervise import tandem

# `tandem bench spec --spec-config` names, one arm each; a method the tree does not serve
# yet (proto/speculative.py's METHODS) is left out and named in the report.
SPEC_ARMS = ("ngram", "draft_model")


def spec_arms() -> tuple[list[str], list[str]]:
    """(the arms this tree serves, the ones it does not)."""
    from tandem_serve.bench.spec.main import SPEC_CONFIGS
    from tandem_serve.proto.speculative import METHODS

    served = [a for a in SPEC_ARMS if SPEC_CONFIGS[a]["method"] in METHODS]
    return served, [a for a in SPEC_ARMS if a not in served]


def stage_spec(plan: Plan, out: str, budget: Budget) -> tuple[dict[str, Any], str]:
    served, missing = spec_arms()
    path = os.path.join(out, "spec.json")
    args = ["bench", "spec", *plan.spec_args, "--json", path,
            *(a for arm in served for a in ("--spec-config", arm)),
            f"--server-arg=--device={plan.device}"]
    say(f"spec: arms {', '.join(served)}" + (f" (not served yet: {', '.join(missing)})"
                                             if missing else ""))
    proc = tandem(*args, timeout=budget.left - 10)
    if proc.returncode:
        raise RuntimeError(f"bench spec failed: {proc.stderr[-800:]}")
    with open(path) as f:
        result = json.load(f)
    fig = {"rows": result["rows"], "verdicts": result["verdicts"], "arms": served,
           "not_served": missing}
    note = f"Methods not served by this tree: {', '.join(missing)}.\n\n" if missing else ""
    return fig, (f"`tandem {' '.join(args)}` (the copier and its workloads: "
                 f"docs/bench/spec.md).\n\n{note}{proc.stdout.strip()}")
