"""The time calibrations step 6's node layouts give the cluster predictions (issue 29, item 2): the pipeline bubble's
overhead over (p-1)/(v*m), and an effective intra-node link (bus bandwidth, and a latency where the points allow)
from the tensor-parallel layouts. Both are ``measured``; they calibrate the cluster predictions only when timed over
NCCL on GPUs. Over gloo on a CPU they are computed and shown beside the model, and not used: gloo's times on a CPU
do not transfer to GPUs. Pure: it reads step 6's ``layouts`` entries and ``layouts_run`` dict, never files.
"""

from __future__ import annotations

import dataclasses
import re
import statistics

from mfu_lab.analysis.placement import collectives
from mfu_lab.analysis.placement import model as pl

GLOO_WHY = "gloo's times on a CPU do not transfer to GPUs"
PURE_TP = re.compile(r"^tp(\d+)(-sp)?$")  # TP over every rank, no FSDP or pipeline beside it


def _term(entry: dict, name: str) -> dict | None:
    return next((t for t in entry.get("terms", []) if t["term"] == name), None)


def usable(layouts_run: dict, device_type: str) -> tuple[bool, str]:
    """Whether the node's times may calibrate the cluster predictions, and why (not)."""
    backend = (layouts_run or {}).get("backend")
    if backend == "nccl" and device_type == "cuda":
        return True, "timed over NCCL on this node's GPUs"
    if backend == "gloo" or device_type != "cuda":
        return False, f"{GLOO_WHY} (timed over {backend or 'no backend'} on {device_type})"
    return False, f"timed over {backend} on {device_type}, not NCCL: not used"


def bubble_factor(layouts: list[dict]) -> dict:
    """The pipeline bubble's overhead over (p-1)/(v*m): the median over the PP layouts of measured / modelled bubble,
    each as idle time over busy time. The ``bubble_fraction`` term holds the fraction of the step (model
    bub/(1+bub), bub = (p-1)/(v*m)); a measured fraction f is f/(1-f) of the busy time, so each layout's factor is
    (f/(1-f)) / bub. Returns ``{value, points, reason}`` (value None when no PP layout measured its bubble)."""
    points = []
    for e in layouts:
        t = _term(e, "bubble_fraction") if e.get("status") == "ok" else None
        if not t or not t.get("model") or t.get("observed") is None or not 0 <= t["observed"] < 1:
            continue
        bub, got = t["model"] / (1 - t["model"]), t["observed"] / (1 - t["observed"])
        points.append({"layout": e["layout"], "model_bubble": bub, "measured_bubble": got, "factor": got / bub})
    if not points:
        return {"value": None, "points": [], "reason": "no pipeline layout measured its bubble"}
    return {"value": statistics.median(p["factor"] for p in points), "points": points, "reason": ""}


def tp_points(layouts: list[dict]) -> tuple[list[dict], list[str]]:
    """One point per pure-TP layout (``tp{t}``, ``tp{t}-sp``): its TP collectives' time per step, measured step time
    minus the model's compute-only step, against its counted bus bytes per step (ring: an all-reduce moves
    2(t-1)/t of its buffer, an all-gather or reduce-scatter (t-1)/t) and its ring steps (2(t-1) per all-reduce, t-1
    per all-gather or reduce-scatter). Layouts with FSDP or a pipeline beside TP are left out: their step carries
    other traffic, partly hidden by prefetch. Returns (points, reasons for the layouts left out)."""
    points, why = [], []
    for e in layouts:
        m = PURE_TP.match(e.get("layout", ""))
        if not m or e.get("status") != "ok":
            continue
        t, sp = int(m.group(1)), bool(m.group(2))
        step, tpb = _term(e, "step_time_s"), _term(e, "tp_bytes_per_layer")
        if not step or not step.get("model") or step.get("observed") is None:
            why.append(f"{e['layout']}: no compute-only model of its step (the co-location run did not run)")
            continue
        if not tpb or not tpb.get("observed") or not tpb.get("layers"):
            why.append(f"{e['layout']}: no counted TP bytes per step")
            continue
        comm_s = step["observed"] - step["model"]
        if comm_s <= 0:
            why.append(f"{e['layout']}: measured step {step['observed']:.4g} s not above the compute-only model "
                       f"{step['model']:.4g} s")
            continue
        nbytes = tpb["observed"] * tpb["layers"]
        bus = (1 if sp else 2) * (t - 1) / t * nbytes  # SP's bytes are its all-gathers' and reduce-scatters' both
        calls = tpb.get("calls")
        steps = calls * tpb["layers"] * (1 if sp else 2) * (t - 1) if calls else None
        points.append({"layout": e["layout"], "tp": t, "sp": sp, "comm_s": comm_s, "bus_bytes": bus,
                       "ring_steps": steps, "message_bytes": nbytes / (calls * tpb["layers"]) if calls else None})
    return points, why


def fit_link(points: list[dict]) -> dict:
    """comm_s = alpha * ring_steps + bus_bytes / B over the points, least squares through the origin. Two points
    that are not proportional (different TP degrees or message sizes) give alpha and B; otherwise B alone from all
    the points' bytes over all their time (alpha then counted in it), and the reason."""
    if not points:
        return {"busbw_gbps": None, "latency_s": None, "kind": None, "reason": "no tensor-parallel layout timed"}
    xs = [(p["ring_steps"], p["bus_bytes"], p["comm_s"]) for p in points if p["ring_steps"]]
    if len(xs) >= 2:
        saa = sum(a * a for a, _, _ in xs)
        sbb = sum(b * b for _, b, _ in xs)
        sab = sum(a * b for a, b, _ in xs)
        sar = sum(a * r for a, _, r in xs)
        sbr = sum(b * r for _, b, r in xs)
        det = saa * sbb - sab * sab
        if det > 1e-9 * saa * sbb:
            alpha = (sar * sbb - sab * sbr) / det
            inv_b = (saa * sbr - sab * sar) / det
            if alpha >= 0 and inv_b > 0:
                return {"busbw_gbps": 1 / inv_b / collectives.GB, "latency_s": alpha, "kind": "alpha-beta",
                        "reason": f"least-squares alpha-beta fit over {len(xs)} points"}
            why = "the alpha-beta fit gave a negative latency or bandwidth"
        else:
            why = "the TP layouts share one degree and message size: alpha and beta are not separable"
    else:
        why = "one TP degree and message size (or no collective counts): alpha and beta are not separable"
    total = sum(p["comm_s"] for p in points)
    busbw = sum(p["bus_bytes"] for p in points) / total / collectives.GB
    return {"busbw_gbps": busbw, "latency_s": None, "kind": "beta",
            "reason": f"beta only ({why}): bus bytes over the TP time, latency included in it"}


@dataclasses.dataclass
class LayoutCalibration:
    """The node's time calibrations: each figure with what it was computed from, and whether it is used."""

    used: bool
    why: str  # why used or not (the backend and device)
    bubble: dict  # {value, points, reason}
    link: dict  # {busbw_gbps, latency_s, kind, reason, points, left_out}
    link_kind: str  # "NVLink" on a GPU node, else the CPU's shared memory

    def bubble_used(self) -> bool:
        return self.used and self.bubble["value"] is not None

    def link_used(self) -> bool:
        return self.used and self.link["busbw_gbps"] is not None

    def apply(self, cal: pl.Calibration) -> pl.Calibration:
        """The calibration with the used figures in (unchanged when none is used)."""
        changes = {}
        if self.bubble_used():
            changes["bubble_factor"] = self.bubble["value"]
        if self.link_used():
            changes["tp_link_gbps"] = self.link["busbw_gbps"]
            if self.link["latency_s"] is not None:
                changes["tp_link_latency_s"] = self.link["latency_s"]
        if not changes:
            return cal
        tag = "measured (node layouts, NCCL)"
        src = {k: tag for k in (["pipeline bubble overhead"] if self.bubble_used() else [])
               + (["intra-node TP link"] if self.link_used() else [])}
        return dataclasses.replace(cal, **changes, sources={**cal.sources, **src})

    def rows(self) -> list[dict]:
        """Rows of step 6's calibration table, used or not, each with its reason."""
        use = "used: " + self.why if self.used else "not used: " + self.why
        b = self.bubble
        pts = ", ".join(f"{p['layout']} {p['factor']:.3g}" for p in b["points"])
        rows = [{"input": "pipeline bubble overhead over (p-1)/(v*m)", "value": b["value"], "unit": "x",
                 "source": "measured", "used": self.bubble_used(),
                 "from": (f"median over the PP layouts of measured / modelled idle-over-busy time ({pts}); "
                          f"{use if b['value'] is not None else 'not used: ' + b['reason']}")}]
        k = self.link
        left = ("; left out: " + "; ".join(k.get("left_out", []))) if k.get("left_out") else ""
        src = ", ".join(p["layout"] for p in k.get("points", []))
        head = f"{self.link_kind}, effective, from the TP layouts' measured step minus the compute-only model ({src})"
        state = use if k["busbw_gbps"] is not None else "not used: " + k["reason"]
        rows.append({"input": f"intra-node TP link bus bandwidth ({self.link_kind})", "value": k["busbw_gbps"],
                     "unit": "GB/s", "source": "measured", "used": self.link_used(),
                     "from": f"{head}; {k['reason']}; {state}{left}"})
        rows.append({"input": f"intra-node TP link latency ({self.link_kind})",
                     "value": k["latency_s"] * 1e6 if k["latency_s"] is not None else None, "unit": "µs",
                     "source": "measured", "used": self.link_used() and k["latency_s"] is not None,
                     "from": (f"{head}; {state}" if k["latency_s"] is not None else
                              f"not fitted: {k['reason'] or 'no TP layout timed'}; the cluster's figure stays")})
        return rows

    def statement(self) -> str:
        """Which time terms the cluster predictions took from this node, and which they did not."""
        names = {"pipeline bubble overhead": self.bubble_used(), "intra-node TP link": self.link_used()}
        here = [n for n, u in names.items() if u]
        not_here = [n for n, u in names.items() if not u]
        out = "calibrated here: " + (", ".join(here) if here else "none of the node's times")
        if not_here:
            out += f"; not calibrated here: {', '.join(not_here)} ({self.why if not self.used else 'not measured'})"
        return out


def layout_calibration(layouts: list[dict], layouts_run: dict, device_type: str) -> LayoutCalibration:
    """Step 6's ``layouts`` and ``layouts_run`` (and the device type it ran on) -> the time calibrations."""
    used, why = usable(layouts_run, device_type)
    points, left = tp_points(layouts)
    link = fit_link(points) | {"points": points, "left_out": left}
    kind = "NVLink" if device_type == "cuda" else f"{device_type} shared memory over {layouts_run.get('backend')}"
    return LayoutCalibration(used, why, bubble_factor(layouts), link, kind)
