"""Align two runs' traces and apply the origin rules.

Records align by (step, kind, scope, id) - id is "<name>:<occurrence>" - never by arrival order. For each aligned
pair:
- inputs agree, outputs differ -> origin candidate (the record produced the first difference);
  for a collective, an input that differs on a peer rank makes it a downstream receiver instead;
  for a pipeline receive, the neighbour's send of the same micro-batch differing makes it downstream (else the data
  changed on the stage boundary itself);
  for a trivially deterministic op (view, slice, ...) the difference must come from the uninstrumented producer of
  its input (or a write into shared memory after it): reported as such, with the view as evidence (one hop later);
- inputs differ, outputs differ -> downstream receiver;
- a record present in one run only -> control-flow divergence.
No origin on any traced rank while records differ -> the origin is outside the capture (widen it).

Candidates are then ordered causally across ranks, never by rank number. A candidate that holds communication (a
traced collective, or a module whose record says it runs collectives inside: `comm`, e.g. an MoE layer's
all-to-all) is a **receiver** while a peer of its group holds a candidate no later than the peer's own record of the
same communication (for a traced collective strictly before it: its inputs are traced, and they agree). Every other
candidate is an **origin**. Only an origin is named; when every candidate is a receiver (peers that can explain each
other), the verdict is "candidates remain", with the rung that resolves them.
Digests recorded as null (tensor above max_numel) are not compared. Only steps and ranks traced in both runs count.

"identical" needs positive evidence: at least one record compared, and nothing left out. A rank traced in one run
only, a step one run's trace lacks (a shorter trace), or a requested step traced in neither run is listed in
`notes`; with no difference found that is "incomplete", and with nothing compared at all "nothing_compared". A
difference found in what both traces hold keeps its verdict (origin, control flow, outside), and the headline says
the traces were incomplete.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from taxbench.rundir.read import compact_ranges
from taxbench.tracing.trace_io import read_trace

TRIVIAL_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "split",
    "split_with_sizes", "unbind", "chunk", "narrow", "unsqueeze", "squeeze", "as_strided", "alias", "detach",
    "view_as", "expand_as", "unfold", "diagonal", "clone", "contiguous", "_to_copy", "copy_", "lift_fresh",
})

# Rules, in the order a report ranks them.
ORIGIN = "origin"
VIA_VIEW = "origin_before_view"
MISSING_IN_A = "missing_in_a"
MISSING_IN_B = "missing_in_b"

IDENTICAL = "identical"
CONTROL_FLOW = "control_flow"
OUTSIDE = "outside_capture"
UNRESOLVED = "candidates_remain"  # every candidate may have received its difference from a peer's candidate
INCOMPLETE = "incomplete"  # no difference in what was compared, but a rank or step was traced in one run only
NOTHING_COMPARED = "nothing_compared"  # not a single record aligned: no evidence either way
NO_EVIDENCE = (INCOMPLETE, NOTHING_COMPARED)

MAX_LISTED = 12  # candidates listed by `render`; --json lists all

# A candidate's role once ranks are ordered causally.
ROLE_ORIGIN = "origin"  # no peer's candidate explains it
ROLE_RECEIVER = "receiver"  # it holds communication and a peer's earlier candidate can explain its output


def op_base_name(name: str) -> str:
    """"aten.index_put_.default" -> "index_put_"."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 else name


def is_trivial(record: dict[str, Any]) -> bool:
    return record["kind"] == "op" and op_base_name(record["name"]) in TRIVIAL_OPS


@dataclass(frozen=True)
class Finding:
    rule: str
    rank: int
    step: int
    seq: int
    kind: str
    name: str
    id: str
    scope: str
    in_shapes: list[Any]
    out_shapes: list[Any]
    note: str = ""
    role: str = ""  # origin candidates only: ROLE_ORIGIN or ROLE_RECEIVER
    explained_by: list[str] = field(default_factory=list)  # a receiver's peer candidates, "rank R <kind> <id>"

    @property
    def is_candidate(self) -> bool:
        return self.rule in (ORIGIN, VIA_VIEW)

    @property
    def is_origin(self) -> bool:
        """A candidate no peer explains."""
        return self.is_candidate and self.role != ROLE_RECEIVER

    @property
    def is_missing(self) -> bool:
        return self.rule in (MISSING_IN_A, MISSING_IN_B)


@dataclass
class RankDiff:
    rank: int
    compared: int = 0
    differing: int = 0
    first_origin: Finding | None = None
    first_missing: Finding | None = None
    downstream: int = 0

    @property
    def first_event(self) -> Finding | None:
        events = [f for f in (self.first_origin, self.first_missing) if f is not None]
        return min(events, key=lambda f: (f.step, f.seq)) if events else None


@dataclass
class DiffReport:
    run_a: str
    run_b: str
    verdict: str
    primary: Finding | None
    ranks: list[RankDiff]
    steps: list[int]
    notes: list[str] = field(default_factory=list)  # what could not be compared (a missing rank, a shorter trace)
    candidates: list[Finding] = field(default_factory=list)  # every origin candidate with its role, in step order
    resolve: str = ""  # UNRESOLVED: the capture that tells the remaining candidates apart

    @property
    def compared(self) -> int:
        return sum(rank.compared for rank in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ranks": [asdict(r) | {"first_event": _dict(r.first_event)} for r in self.ranks]}


def _dict(finding: Finding | None) -> dict[str, Any] | None:
    return None if finding is None else asdict(finding)


def _key(record: dict[str, Any]) -> tuple[int, str, str, str]:
    return (record["step"], record["kind"], record["scope"], record["id"])


def _comparable(side: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(s.get("shape"), s.get("dtype"), s.get("label"), s.get("numel"), s.get("tensors")) for s in side]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    if _comparable(a) != _comparable(b):
        return False
    return all(x.get("digest") is None or y.get("digest") is None or x["digest"] == y["digest"]
               for x, y in zip(a, b, strict=True))


def _shapes(side: list[dict[str, Any]]) -> list[Any]:
    return [s["shape"] if "shape" in s else f"{s.get('label')}[{s.get('tensors')} tensors]" for s in side]


def _finding(rule: str, record: dict[str, Any], note: str = "") -> Finding:
    return Finding(rule, record["rank"], record["step"], record["seq"], record["kind"], record["name"], record["id"],
                   record["scope"], _shapes(record["in"]), _shapes(record["out"]), note)


def _label(finding: Finding) -> str:
    return f"rank {finding.rank} {finding.kind} {finding.id}" + (
        f" in {finding.scope}" if finding.scope and finding.scope != finding.name else "")


def _key_of(finding: Finding) -> tuple[int, str, str, str]:
    return (finding.step, finding.kind, finding.scope, finding.id)


def communication(record: dict[str, Any]) -> dict[str, Any] | None:
    """What the record says it communicates: {"collectives": [...], "group": [global ranks] or None (unknown)}; a
    traced collective always communicates (over every rank when its record does not say)."""
    comm = record.get("comm")
    if comm is None and record["kind"] == "collective":
        return {"collectives": [record["name"]], "group": None}
    return comm


def order_causally(candidates: list[Finding], records: dict[tuple[int, tuple[int, str, str, str]], dict[str, Any]],
                   ranks: list[int]) -> list[Finding]:
    """Each candidate with its role. `records` maps (rank, key) to run A's record (its seq orders the rank's step).

    A candidate that holds communication is a receiver while a peer of its group holds a candidate of the same step
    at or before the peer's record of the same communication (the point both ranks pass together); when the peer
    has no such record traced, any candidate of the peer's step may have been sent. For a traced collective the peer's
    own record does not count: its inputs are traced and agree, so the collective itself made the difference."""
    by_rank: dict[int, list[Finding]] = {}
    for finding in candidates:
        by_rank.setdefault(finding.rank, []).append(finding)
    ordered = []
    for finding in candidates:
        record = records[(finding.rank, _key_of(finding))]
        comm = communication(record)
        if comm is None:
            ordered.append(replace(finding, role=ROLE_ORIGIN))
            continue
        group = comm.get("group")
        peers = [rank for rank in (ranks if group is None else group) if rank != finding.rank]
        explaining: list[Finding] = []
        for peer in peers:
            meeting = records.get((peer, _key_of(finding)))
            for other in by_rank.get(peer, []):
                if other.step != finding.step:
                    continue
                if meeting is not None and (other.seq > meeting["seq"] or (
                        record["kind"] == "collective" and other.seq == meeting["seq"])):
                    continue
                explaining.append(other)
        role = ROLE_RECEIVER if explaining else ROLE_ORIGIN
        ordered.append(replace(finding, role=role, explained_by=[_label(other) for other in explaining]))
    # a receiver names the unexplained candidates among its explainers first
    origins = {_label(f) for f in ordered if f.role == ROLE_ORIGIN}
    return [replace(f, explained_by=sorted(f.explained_by, key=lambda label: label not in origins)) for f in ordered]


def innermost_modules(findings: Iterable[Finding]) -> list[str]:
    """The module scopes among `findings` that enclose no other one (the MoE layer, not the blocks around it)."""
    scopes = {f.scope for f in findings if f.kind == "module"}
    return sorted(scope for scope in scopes
                  if not any(other != scope and (scope == "" or other.startswith(scope + ".")) for other in scopes))


def resolving_capture(remaining: list[Finding], op_level: bool) -> str:
    """Which capture tells candidates that explain each other apart."""
    modules = innermost_modules(remaining)
    if modules and not op_level:
        return f"rung 3 inside {modules} (each rank's ops there show which one computed the difference)"
    if not modules and not op_level:
        return "rung 2 (module outputs: which rank computed the difference before it was communicated)"
    return ("a wider capture: rung 3 in every module on every rank (the difference was computed in a region the "
            "capture left out)")


# A pipeline stage receives what its neighbour sent: activations from stage - 1, gradients from stage + 1.
_SENDER = {"pipeline.recv": ("pipeline.send", -1), "pipeline.recv_grad": ("pipeline.send_grad", +1)}


def _pipeline_edge(record: dict[str, Any]) -> tuple[int, str, int, str]:
    """(step, name, stage, micro-batch occurrence) of a pipeline record (scope "pipeline/stage<k>[/backward]")."""
    stage = int(record["scope"].split("/")[1].removeprefix("stage"))
    return record["step"], record["name"], stage, record["id"].rsplit(":", 1)[1]


def _sender(record: dict[str, Any]) -> tuple[int, str, int, str] | None:
    if record["name"] not in _SENDER:
        return None
    step, name, stage, occurrence = _pipeline_edge(record)
    sent, offset = _SENDER[name]
    return step, sent, stage + offset, occurrence


def _differing_pipeline_sends(aligned: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]]) -> set[Any]:
    """Pipeline sends (activations or gradients) whose data differ between the runs, on any rank."""
    return {_pipeline_edge(a) for pairs in aligned.values() for a, b in pairs
            if a["kind"] == "pipeline" and a["name"].startswith("pipeline.send") and not _same(a["out"], b["out"])}


def diff_traces(
    trace_a: dict[int, list[dict[str, Any]]], trace_b: dict[int, list[dict[str, Any]]],
    run_a: str = "A", run_b: str = "B", steps: Iterable[int] | None = None,
) -> DiffReport:
    notes: list[str] = []
    ranks = sorted(set(trace_a) & set(trace_b))
    for rank in sorted(set(trace_a) ^ set(trace_b)):
        notes.append(f"rank {rank} is traced in {run_a if rank in trace_a else run_b} only; not compared")
    wanted = set(steps) if steps is not None else None
    if wanted is not None:
        traced = {r["step"] for trace in (trace_a, trace_b) for records in trace.values() for r in records}
        notes += [f"step {step} is traced in neither run" for step in sorted(wanted - traced)]

    aligned: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    only: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    all_steps: set[int] = set()
    for rank in ranks:
        steps_a = {r["step"] for r in trace_a[rank]}
        steps_b = {r["step"] for r in trace_b[rank]}
        common = steps_a & steps_b if wanted is None else steps_a & steps_b & wanted
        only_one = steps_a ^ steps_b if wanted is None else (steps_a ^ steps_b) & wanted
        for traced_in, short, alone in ((run_a, run_b, only_one & steps_a), (run_b, run_a, only_one & steps_b)):
            if alone:
                what = f"step {min(alone)}" if len(alone) == 1 else f"steps {compact_ranges(sorted(alone))}"
                notes.append(f"rank {rank}: {what} traced in {traced_in} only ({short}'s trace is shorter or lacks "
                             "them); not compared")
        all_steps |= common
        by_key_a = {_key(r): r for r in trace_a[rank] if r["step"] in common}
        by_key_b = {_key(r): r for r in trace_b[rank] if r["step"] in common}
        aligned[rank] = [(by_key_a[k], by_key_b[k]) for k in by_key_a if k in by_key_b]
        only[rank] = [(MISSING_IN_B, r) for k, r in by_key_a.items() if k not in by_key_b]
        only[rank] += [(MISSING_IN_A, r) for k, r in by_key_b.items() if k not in by_key_a]

    # Collective inputs that differ on some rank, so peers do not blame their own (matching) inputs.
    peer_input_differs: dict[tuple[int, str, str, str], int] = {}
    for rank, pairs in aligned.items():
        for a, b in pairs:
            if a["kind"] == "collective" and not _same(a["in"], b["in"]):
                peer_input_differs.setdefault(_key(a), rank)

    sends_differ = _differing_pipeline_sends(aligned)
    records = {(rank, _key(a)): a for rank in ranks for a, _ in aligned[rank]}

    results = []
    findings_of: dict[int, list[Finding]] = {}
    for rank in ranks:
        result = RankDiff(rank)
        findings: list[Finding] = []
        for a, b in aligned[rank]:
            result.compared += 1
            same_in, same_out = _same(a["in"], b["in"]), _same(a["out"], b["out"])
            if same_in and same_out:
                continue
            result.differing += 1
            if not same_in:
                if not same_out:
                    result.downstream += 1
                continue
            if a["kind"] == "collective" and _key(a) in peer_input_differs:
                result.downstream += 1
                continue
            if a["kind"] == "pipeline" and _sender(a) in sends_differ:  # it received what its neighbour sent
                result.downstream += 1
                continue
            if is_trivial(a):
                findings.append(_finding(VIA_VIEW, a, "a trivially deterministic op changed its data: the origin is "
                                         "the uninstrumented producer of its input (or a write into memory it shares)"))
            else:
                findings.append(_finding(ORIGIN, a))
        for rule, record in only[rank]:
            present = run_a if rule == MISSING_IN_B else run_b
            findings.append(_finding(rule, record, f"recorded in {present} only: control flow diverged"))
            result.differing += 1
        findings.sort(key=lambda f: (f.step, f.seq))
        findings_of[rank] = findings
        results.append(result)

    candidates = order_causally([f for rank in ranks for f in findings_of[rank] if f.is_candidate], records, ranks)
    roles = {(f.rank, _key_of(f)): f for f in candidates}
    for result in results:
        findings = [roles.get((f.rank, _key_of(f)), f) for f in findings_of[result.rank]]
        result.first_origin = next((f for f in findings if f.is_origin), None)
        result.first_missing = next((f for f in findings if f.is_missing), None)
        result.downstream += sum(f.role == ROLE_RECEIVER for f in findings)

    events = [r.first_event for r in results if r.first_event is not None]
    primary = min(events, key=lambda f: (f.step, f.rank, f.seq)) if events else None
    candidates.sort(key=lambda f: (f.step, f.rank, f.seq))
    resolve = ""
    if primary is not None:
        verdict = CONTROL_FLOW if primary.is_missing else ORIGIN
    elif candidates:
        verdict = UNRESOLVED
        resolve = resolving_capture(candidates, any(r["kind"] == "op" for r in records.values()))
    elif any(r.differing for r in results):
        verdict = OUTSIDE
    elif not any(r.compared for r in results):
        verdict = NOTHING_COMPARED
    else:
        verdict = INCOMPLETE if notes else IDENTICAL
    return DiffReport(run_a, run_b, verdict, primary, results, sorted(all_steps), notes, candidates, resolve)


def diff_runs(run_a: Path, run_b: Path, steps: Iterable[int] | None = None) -> DiffReport:
    return diff_traces(read_trace(run_a), read_trace(run_b), str(run_a), str(run_b), steps)


def describe(finding: Finding) -> str:
    scope = finding.scope or "<top level>"
    rule = ROLE_RECEIVER if finding.role == ROLE_RECEIVER else finding.rule
    text = (f"step {finding.step} rank {finding.rank}: {rule} {finding.kind} {finding.id} in {scope}; "
            f"in {finding.in_shapes} -> out {finding.out_shapes}" + (f" ({finding.note})" if finding.note else ""))
    if finding.explained_by:
        more = len(finding.explained_by) - 1
        text += (f" (it communicates, and a peer's earlier candidate can explain it: {finding.explained_by[0]}"
                 + (f", and {more} more" if more else "") + ")")
    return text


def render(report: DiffReport) -> str:
    lines = [f"diff {report.run_a} vs {report.run_b} (steps {report.steps or 'none in common'})"]
    headline = {
        IDENTICAL: "identical: every traced record agrees bit for bit",
        ORIGIN: "origin found",
        CONTROL_FLOW: "control-flow divergence: a record exists in one run only",
        OUTSIDE: "records differ but no origin on any traced rank: the origin is outside the capture; widen it "
                 "(earlier step, deeper rung, more modules/ranks)",
        UNRESOLVED: "candidates remain: each candidate communicates with a peer whose earlier candidate can explain "
                    f"it, so none is named; resolve them with {report.resolve}",
        INCOMPLETE: "incomplete: every record compared agrees, but the traces do not cover the same ranks and steps "
                    "(notes below); not evidence of identical runs",
        NOTHING_COMPARED: "nothing compared: no traced record exists in both runs for these ranks and steps; capture "
                          "the step in both runs (experiment.trace.steps, or `taxbench localize`)",
    }[report.verdict]
    if report.notes and report.verdict not in NO_EVIDENCE:
        headline += f" (traces incomplete: {report.notes[0]}" + (
            f", and {len(report.notes) - 1} more" if len(report.notes) > 1 else "") + ")"
    lines.append(f"verdict: {headline}")
    if report.primary is not None:
        lines.append(f"first: {describe(report.primary)}")
    for rank in report.ranks:
        event = rank.first_event
        summary = describe(event) if event is not None else "no origin" + (
            f" ({rank.downstream} downstream receivers)" if rank.downstream else "")
        lines.append(f"  rank {rank.rank}: {rank.compared} compared, {rank.differing} differ; {summary}")
    if report.candidates and (len(report.candidates) > 1 or report.verdict == UNRESOLVED):
        lines.append("candidates (inputs agree, outputs differ), ordered causally across ranks:")
        lines.extend(f"  {f.role}: {describe(f)}" for f in report.candidates[:MAX_LISTED])
        if len(report.candidates) > MAX_LISTED:
            lines.append(f"  ... and {len(report.candidates) - MAX_LISTED} more (--json lists them all)")
    lines.extend(f"note: {note}" for note in report.notes)
    return "\n".join(lines)
