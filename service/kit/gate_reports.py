"""The files a CI gate writes beside its exit code, shared by `lsa certify` (one Lipschitz
bound) and `lsa robustness --inputs` (certified accuracy on a set of inputs): JUnit XML, a
Markdown job summary (appended: `$GITHUB_STEP_SUMMARY` collects every step's output), and for
the robustness gate the counterexamples PGD found, as a .npz a user can load and replay."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np


def md_cell(text: object) -> str:
    """Table-cell safe: no pipes or newlines, and no raw HTML (`<model>` would vanish)."""
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace("|", "\\|").replace("\n", " "))


def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def append_summary(path: Path, text: str) -> None:
    # Appended: a CI job summary file ($GITHUB_STEP_SUMMARY) collects every step's output.
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text)


def junit_suite(name: str, elapsed_s: float, *, tests: int, failures: int, errors: int,
                skipped: int, properties: Mapping[str, Any]) -> tuple[ET.Element, ET.Element]:
    """(root, suite): `testsuites` holding one `testsuite` with the counts and properties
    (None values left out); the caller adds the test cases to the suite."""
    counts = {"tests": str(tests), "failures": str(failures), "errors": str(errors),
              "skipped": str(skipped), "time": f"{elapsed_s:.3f}"}
    root = ET.Element("testsuites", {"name": name, **counts})
    suite = ET.SubElement(root, "testsuite", {
        "name": name, **counts,
        # UTC without an offset: the JUnit schema's timestamp has none.
        "timestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S")})
    props = ET.SubElement(suite, "properties")
    for key, value in properties.items():
        if value is not None:
            ET.SubElement(props, "property", {"name": key, "value": str(value)})
    return root, suite


def junit_bytes(root: ET.Element) -> bytes:
    ET.indent(root)
    xml: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return xml + b"\n"


# --- lsa robustness --inputs ---------------------------------------------------------------

ICONS = {"passed": "✅", "failed": "❌", "error": "⚠️", "report": "📋"}


def sample_note(s: Mapping[str, Any]) -> str:
    """One input's verdict in words ("attacked: label 1 flipped to 2 at distance 0.031")."""
    status = s["status"]
    if status == "certified":
        by = s.get("certified_by")
        return "certified" + (f" by the {by} route" if by else "")
    if status == "attacked":
        if s.get("flip_class") is None:
            return "attacked: PGD found a label flip inside the ball"
        return (f"attacked: label {s['label']} flipped to {s['flip_class']} at distance "
                f"{s['flip_distance']:.6g}")
    if status == "misclassified":
        pred = s.get("predicted")
        return "misclassified at the input itself" + (f" (predicted {pred})"
                                                      if pred is not None else "")
    return "unknown: neither certified nor attacked at this radius"


def set_message(out: Mapping[str, Any]) -> str:
    gate = out.get("min_certified_accuracy")
    k = out["counts"]
    head = (f"certified accuracy {out['certified_accuracy']:.4f} at radius "
            f"{out['radius']:.6g} ({out['norm']}-norm): {k['certified']} of {out['n']} inputs "
            f"certified, {k['attacked']} attacked, {k['unknown']} unknown, "
            f"{k['misclassified']} misclassified")
    if gate is None:
        return head
    return head + (f"; {'at least' if out['passed'] else 'below'} the threshold {gate:g}")


def set_outcome(out: Mapping[str, Any] | None) -> str:
    """passed / failed (the gate), report (no gate given), error (no result)."""
    if out is None:
        return "error"
    if out.get("passed") is None:
        return "report"
    return "passed" if out["passed"] else "failed"


def set_junit_xml(model: Path, norm: str, radius: float | None, gate: float | None,
                  out: Mapping[str, Any] | None, message: str, elapsed_s: float) -> bytes:
    """The gate as one test case (failure below the threshold, error for exit 2; absent
    without a threshold) and every input as one (passing when certified, else skipped with
    its verdict: an attacked input is a finding about the model, not the gate's failure)."""
    outcome = set_outcome(out)
    samples: Sequence[Mapping[str, Any]] = [] if out is None else out["samples"]
    gate_case = gate is not None or outcome == "error"
    skipped = sum(s["status"] != "certified" for s in samples)
    props: dict[str, Any] = {"model": str(model), "norm": norm, "radius": radius,
                             "min_certified_accuracy": gate}
    if out is not None:
        props.update({k: out.get(k) for k in (
            "n", "certified_accuracy", "attack_accuracy", "clean_accuracy", "model_sha256",
            "certificate_id", "lsa_version")})
    root, suite = junit_suite("lsa robustness", elapsed_s, tests=len(samples) + gate_case,
                              failures=int(outcome == "failed"),
                              errors=int(outcome == "error"), skipped=skipped,
                              properties=props)
    if gate_case:
        what = (f"certified accuracy >= {gate:g}" if gate is not None
                else "certified accuracy")
        case = ET.SubElement(suite, "testcase", {
            "classname": "lsa.robustness",
            "name": f"{model}: {what} at radius {radius:g} ({norm}-norm)" if radius
            else f"{model}: {what}",
            "time": f"{elapsed_s:.3f}"})
        if outcome == "failed":
            ET.SubElement(case, "failure", {"message": message,
                                            "type": "CertifiedAccuracyBelowThreshold"}
                          ).text = message
        elif outcome == "error":
            ET.SubElement(case, "error", {"message": message,
                                          "type": "RobustnessError"}).text = message
        ET.SubElement(case, "system-out").text = message
    for s in samples:
        case = ET.SubElement(suite, "testcase", {
            "classname": "lsa.robustness.inputs",
            "name": f"input {s['index']} (label {s['label']})",
            "time": f"{float(s.get('seconds') or 0.0):.3f}"})
        note = sample_note(s)
        if s["status"] != "certified":
            ET.SubElement(case, "skipped", {"message": note})
        ET.SubElement(case, "system-out").text = note
    return junit_bytes(root)


def set_summary_markdown(model: Path, norm: str, radius: float | None, gate: float | None,
                         out: Mapping[str, Any] | None, message: str) -> str:
    outcome = set_outcome(out)
    lines = [f"### {ICONS[outcome]} lsa robustness {outcome}: `{md_cell(model)}`", "",
             md_cell(message), "", "| | |", "|---|---|", f"| norm | {norm} |"]
    if radius is not None:
        lines.append(f"| radius | {radius:g} |")
    if gate is not None:
        lines.append(f"| min certified accuracy | {gate:g} |")
    if out is not None:
        k = out["counts"]
        verdicts = " / ".join(str(k[s]) for s in ("certified", "attacked", "unknown",
                                                  "misclassified"))
        lines += [f"| inputs | {out['n']} |",
                  f"| certified / attacked / unknown / misclassified | {verdicts} |",
                  f"| certified accuracy | {out['certified_accuracy']:.4f} |"]
        if out.get("attack_accuracy") is not None:
            lines.append(f"| robust accuracy at most (attack) | {out['attack_accuracy']:.4f} |")
        if out.get("clean_accuracy") is not None:
            lines.append(f"| clean accuracy | {out['clean_accuracy']:.4f} |")
        lines.append(f"| model sha256 | `{out['model_sha256']}` |")
        if out.get("certificate_id"):
            lines.append(f"| certificate | `{out['certificate_id']}` (signed by the server) |")
        lines += ["", "<details><summary>Per-input verdicts</summary>", "",
                  "| input | label | verdict | s |", "|---:|---:|---|---:|"]
        for s in out["samples"]:
            sec = "-" if s.get("seconds") is None else f"{s['seconds']:.2f}"
            lines.append(f"| {s['index']} | {s['label']} | {md_cell(sample_note(s))} | {sec} |")
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n\n"


def counterexamples_npz(flips: Sequence[tuple[int, int, int, float, np.ndarray]]) -> bytes:
    """The attacked inputs' label flips as a .npz (no pickles: `numpy.load(path)` reads it):
    `index` (K,) which input, `label` (K,), `flip_class` (K,) the class at the flip,
    `distance` (K,) its distance from the input in the gate's norm (<= the radius), and
    `inputs` (K, ...) the flipped points in the layout the inputs were given in, float64 (a
    float32 copy may round back across the decision boundary or out of the ball)."""
    import io

    buf = io.BytesIO()
    if flips:
        inputs = np.stack([f[4] for f in flips]).astype(np.float64)
    else:
        inputs = np.zeros((0,), dtype=np.float64)
    np.savez(buf, index=np.array([f[0] for f in flips], dtype=np.int64),
             label=np.array([f[1] for f in flips], dtype=np.int64),
             flip_class=np.array([f[2] for f in flips], dtype=np.int64),
             distance=np.array([f[3] for f in flips], dtype=np.float64), inputs=inputs)
    return buf.getvalue()
