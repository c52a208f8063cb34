"""Step 5 (precision and FP8): its tables and its section of the index page."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab import plots
from mfu_lab.report.templating import environment, macros
from mfu_lab.steps.fp8.step import Fp8Result

TEMPLATE = "tables_fp8.html.j2"

# The precision ladder's table, rendered by the report's own (autoescaping) environment.
PRECISION = """\
<table><tr><th>precision</th><th>dtype</th><th>float32 matmuls</th><th>status</th>\
<th>step median {{ badge('measured') }}</th><th>p10-p90</th><th>speedup over {{ ref }} [95% interval]</th>\
<th>final loss gap</th><th>steps run</th><th>matmul probe {{ badge('measured') }}</th><th>why</th></tr>
{% for g in p.rungs %}
<tr><td>{{ g.name }}{% if g.own %} <small>(the job's)</small>{% endif %}</td><td>{{ g.dtype }}</td>\
<td>{{ g.matmul_precision }}</td><td>{{ g.status }}</td><td>{{ g.step_median_s|ms }}</td>\
<td>{{ g.step_p10_s|ms }}{% if g.step_p10_s is not none %} - {% endif %}{{ g.step_p90_s|ms }}</td>\
<td>{% if g.speedup_low is not none %}{{ g.speedup|num('.2f') }}x [{{ g.speedup_low|num('.2f') }}, \
{{ g.speedup_high|num('.2f') }}]{% elif g.status == 'reference' %}1.00x{% endif %}</td>\
<td>{{ g.final_gap|num('+.2%') }}</td><td>{{ g.loss|length }}</td>\
<td>{% set pb = g.get('probe') or {} %}{% if pb.get('flops_per_s') is not none %}\
{{ (pb.flops_per_s / 1e9)|num('.3g') }} GFLOP/s <small>({{ (pb.p10 / 1e9)|num('.3g') }}-\
{{ (pb.p90 / 1e9)|num('.3g') }}){% if pb.get('cannot_be_faster') %}, {{ pb.get('reference') or 'float32' }} \
{{ (pb.float32_flops_per_s / 1e9)|num('.3g') }} ({{ (pb.float32_p10 / 1e9)|num('.3g') }}-\
{{ (pb.float32_p90 / 1e9)|num('.3g') }}){% endif %}</small>{% endif %}</td>\
<td><small>{{ g.reason }}</small></td></tr>
{% endfor %}
</table>
<p><small>Speed: {{ rounds }} interleaved rounds (every precision once per round, in the order recorded), speedup \
= {{ ref }}'s median step / this precision's, its interval a percentile bootstrap. A precision is adopted only when \
the interval lies entirely above 1.0 and its loss stays within loss_tolerance ({{ tol|num('.0%') }}) of {{ ref }}'s \
without the divergence watch stopping it; among those, the fastest. Before any of that, each precision's matmul \
rate is probed beside {{ ref }}'s (median and p10-p90 of short probes, GFLOP/s): one whose probes cannot reach \
{{ ref }}'s within their noise is "cannot be faster here", neither trained nor timed (--thorough times it).\
{% if ref != 'float32' %} Under the budget the reference is the job's own precision, and each other precision's \
step was probed once first: one whose rounds and loss curve at that step did not fit step 5's share is skipped, \
with the seconds.{% endif %}\
{% if p.native_bf16 %} This CPU's native-bf16 \
flags: {{ p.native_bf16.flags|join(', ') or 'none' }}.{% endif %}</small></p>
<p><b>{{ p.choice.text }}</b></p>
"""


def precision_table(r) -> Markup:
    """Each precision rung: its step time, speedup over the reference (float32, or the job's own under a budget)
    with its interval, loss gap and status (measured), then the choice."""
    p = r.precision if hasattr(r, "precision") else r.get("precision", {})
    job = r.job if hasattr(r, "job") else r["job"]
    if not p.get("rungs"):
        return Markup(f"<p>{Markup.escape(p.get('choice', {}).get('text', 'No precision ladder in this result.'))}"
                      "</p>")
    return Markup(environment().from_string(PRECISION).render(p=p, rounds=job.get("precision_rounds", ""),
                                                              tol=job.get("loss_tolerance"),
                                                              ref=p.get("reference") or "float32"))


def sensitivity_table(r) -> Markup:
    """Each layer group's worst FP8 signal-to-noise and under/overflow, per scaling recipe (emulated)."""
    return macros(TEMPLATE).sensitivity_table(r)


def policies_table(r) -> Markup:
    """Each FP8 policy: its groups, recipe, FLOPs share, and its loss against bf16's (emulated)."""
    return macros(TEMPLATE).policies_table(r)


def fp8_section(d: dict[str, Any]) -> Markup:
    """Step 5's section of the index page, from its result dict: the FP8 section, with the precision ladder
    (table and plot) ahead of the FP8 sensitivity."""
    r = Fp8Result.from_dict(d)
    uris = {"sensitivity": plots.to_data_uri(plots.fp8_sensitivity(r)),
            "losses": plots.to_data_uri(plots.fp8_losses(r))}
    section = str(macros(TEMPLATE).section(r, d["metrics"], uris))
    if not r.precision.get("rungs"):
        return Markup(section)
    ladder = (f'<h3>Precision ladder</h3><img alt="precision ladder" src="{plots.to_data_uri(plots.precision(r))}">'
              + str(precision_table(r)))
    at = section.find("<h3>Sensitivity</h3>")
    return Markup(section[:at] + ladder + section[at:] if at >= 0 else section + ladder)
