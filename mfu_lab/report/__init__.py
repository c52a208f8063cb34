"""Reports: each executed notebook as offline HTML, and the job's index page across steps.

Both open with no network: the notebook export uses a template with every
external script removed, and the index embeds its plots as PNG data URIs with
inline CSS. Everything taken from results or job files is HTML-escaped.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from mfu_lab.core.files import RESULT_FILE, read_json
from mfu_lab.core.registry import BY_KEY, STEPS
from mfu_lab.report.format import badge, fmt

TEMPLATES = Path(__file__).parent / "templates"
e = html.escape


def export_html(notebook: Path, html_path: Path) -> Path:
    """Executed notebook -> self-contained HTML (no script or style fetched from the network)."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook), as_version=4)
    # The offline template embeds no widget manager, so a widget view could not render: every output
    # that also carries HTML (the explorers' static fallback) shows that instead.
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/html" in data:
                data.pop("application/vnd.jupyter.widget-view+json", None)
    exporter = HTMLExporter(template_name="offline", extra_template_basedirs=[str(TEMPLATES)])
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    body, _ = exporter.from_notebook_node(nb)
    tmp = html_path.with_suffix(".html.tmp")
    tmp.write_text(body, encoding="utf-8")
    tmp.replace(html_path)
    return html_path


PAGE_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#212529;line-height:1.45}
h1{margin-bottom:.2em} .sub{color:#666;margin-top:0}
"""
# Scoped enough to embed in a notebook output without restyling the notebook itself.
PART_CSS = """
.mfu table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.92em}
.mfu td,.mfu th{border-bottom:1px solid #ddd;padding:.3em .7em;text-align:left !important;vertical-align:top}
.mfu td{overflow-wrap:anywhere}
.mfu th{background:#f3f4f6}
.mfu .cards{display:flex;flex-wrap:wrap;gap:.8em;margin:1em 0}
.mfu .card{border:1px solid #ddd;border-radius:8px;padding:.6em 1em;min-width:150px}
.mfu .card .v{font-size:1.5em;font-weight:600} .mfu .card .k{color:#555;font-size:.85em}
.mfu .src{font-size:.72em;border-radius:4px;white-space:nowrap;overflow-wrap:normal;padding:.05em .4em;
margin-left:.3em;color:#fff;background:#868e96}
.mfu .src-measured{background:#2f9e44}.mfu .src-counted{background:#1971c2}.mfu .src-analytic{background:#5f3dc4}
.mfu .src-datasheet{background:#495057}.mfu .src-emulated{background:#e8590c}.mfu .src-modelled{background:#c2255c}
.mfu .act{color:#c92a2a;font-weight:600}.mfu .look{color:#e67700;font-weight:600}
.mfu .info{color:#1971c2;font-weight:600}
.mfu .failed{color:#c92a2a;font-weight:600}.mfu .ok{color:#2f9e44;font-weight:600}.mfu .notrun{color:#888}
.mfu img{max-width:100%}
"""
CSS = PAGE_CSS + PART_CSS


def _step_row(job_root: Path, info, result: dict | None) -> str:
    folder = job_root / info.folder
    links = []
    for name, label in (("report.html", "report"), (info.notebook, "notebook"), (RESULT_FILE, "result.json"),
                        ("trace.json.gz", "trace")):
        if (folder / name).exists():
            links.append(f'<a href="{e(info.folder)}/{e(name)}">{label}</a>')
    from mfu_lab.core.runstate import step_state

    st = step_state(folder, result)
    css = {"ok": "ok", "not run": "notrun", "running": "info"}.get(st.status, "failed")
    status = f'<span class="{css}">{e(st.status)}</span>' + (f"<br><small>{e(st.detail)}</small>" if st.detail else "")
    m = (result or {}).get("metrics", {})

    def cell(name):
        x = m.get(name)
        return f"{fmt(x['value'], x['unit'])}{badge(x['source'])}" if x else ""

    return (f"<tr><td>{info.number}</td><td>{e(info.title)}</td><td>{status}</td><td>{cell('mfu')}</td>"
            f"<td>{cell('tokens_per_s')}</td><td>{cell('step_time_median_s')}</td><td>{' · '.join(links)}</td></tr>")


def _metrics_table(metrics: dict[str, dict]) -> str:
    rows = "".join(f"<tr><td>{e(k)}</td><td>{fmt(v['value'], v['unit'])}</td><td>{badge(v['source'])}</td>"
                   f"<td><small>{e(v.get('note', ''))}</small></td></tr>" for k, v in metrics.items())
    return f"<table><tr><th>metric</th><th>value</th><th>source</th><th>how</th></tr>{rows}</table>"


def _cards(metrics: dict[str, dict], pairs) -> str:
    """Headline figures as cards: (label, metric name) pairs, each with its source label."""
    return "".join(
        f'<div class="card"><div class="k">{e(label)}</div><div class="v">'
        f'{fmt(metrics[k]["value"], metrics[k]["unit"])}</div>{badge(metrics[k]["source"])}</div>'
        for label, k in pairs)


def _advice_items(advice) -> str:
    return "".join(f'<li><span class="{e(a.severity)}">{e(a.severity)}</span> {e(a.message)} '
                   f"<small>({e(a.because)})</small></li>" for a in advice)


def _baseline_section(d: dict[str, Any]) -> str:
    from mfu_lab import plots
    from mfu_lab.steps.baseline import BaselineResult

    r = BaselineResult.from_dict(d)
    m = d["metrics"]
    cards = _cards(m, (("MFU", "mfu"), ("HFU", "hfu"), ("tokens/s", "tokens_per_s"),
                       ("median step", "step_time_median_s"), ("peak", "peak_flops_per_s")))
    advice = _advice_items(r.advice)
    skipped = "".join(f"<li>{e(s['what'])}: {e(s['reason'])}</li>" for s in r.skipped) or "<li>nothing</li>"
    ledger = "".join(f"<tr><td>{e(i.name)}</td><td>{i.fraction:.1%}</td><td>{badge(i.source)}</td>"
                     f"<td><small>{e(i.explanation)}</small></td></tr>" for i in r.ledger.items)
    env = "".join(f"<tr><td>{e(str(k))}</td><td>{e(str(v))}</td></tr>" for k, v in d["environment"].items())
    h = r.health
    health = (f"<p>{h.samples} NVML samples: max {h.temperature_c_max:.0f} C, SM clock {h.sm_clock_mhz_mean:.0f} of "
              f"{h.sm_clock_mhz_max_supported:.0f} MHz, {h.power_w_mean:.0f} W; reasons seen: "
              f"{e(', '.join(h.reasons_seen) or 'none')}</p>" if h.sampled
              else f"<p>Skipped: {e(h.skipped_reason)}</p>")
    return f"""
<h2>Step 1 · baseline</h2>
<div class="cards">{cards}</div>
<img alt="MFU ledger waterfall" src="{plots.to_data_uri(plots.ledger_waterfall(r.ledger))}">
<table><tr><th>ledger</th><th>share of peak</th><th>source</th><th>how</th></tr>{ledger}
<tr><th>total</th><th>{r.ledger.total:.1%}</th><th></th><th></th></tr></table>
<img alt="step times" src="{plots.to_data_uri(plots.step_times(r))}">
<h3>What to do next</h3><ul>{advice or '<li>nothing stands out</li>'}</ul>
<h3>All figures</h3>{_metrics_table(m)}
<h3>Device health</h3>{health}
<h3>Skipped, and why</h3><ul>{skipped}</ul>
<h3>Environment</h3><table>{env}</table>"""


def _num(v, f):
    return "" if v is None else f(v)


def attention_table(rows) -> str:
    body = "".join(
        f"<tr><td>{e(r.name)}</td><td>{e(r.status)}</td><td>{_num(r.rel_error, lambda v: f'{v:.1e}')}</td>"
        f"<td>{_num(r.attn_median_s, lambda v: f'{v * 1e3:.2f} ms')}</td>"
        f"<td>{_num(r.step_median_s, lambda v: f'{v * 1e3:.1f} ms')}</td>"
        f"<td>{_num(r.attention_share, lambda v: f'{v:.1%}')}</td><td>{_num(r.speedup, lambda v: f'{v:.2f}x')}</td>"
        f"<td>{_num(r.mfu, lambda v: f'{v:.1%}')}</td><td><small>{e(r.kernel)}</small></td>"
        f"<td><small>{e(r.reason)}</small></td></tr>" for r in rows)
    return ("<table><tr><th>implementation</th><th>status</th><th>rel. error</th><th>attention fwd+bwd</th>"
            "<th>step (median)</th><th>attention share</th><th>speedup vs job's</th><th>MFU</th><th>kernel</th>"
            "<th>note</th></tr>"
            f"{body}</table>")


def comm_table(rows) -> str:
    body = "".join(
        f"<tr><td>{e(r.hook)}</td><td>{r.bucket_mb:g}</td><td>{r.grad_as_bucket_view}</td><td>{e(r.status)}</td>"
        f"<td>{_num(r.step_median_s, lambda v: f'{v * 1e3:.1f} ms')}</td>"
        f"<td>{_num(r.step_p10_s, lambda v: f'{v * 1e3:.1f}')}–{_num(r.step_p90_s, lambda v: f'{v * 1e3:.1f}')}</td>"
        f"<td>{_num(r.comm_share, lambda v: f'{v:.1%}')}</td><td>{_num(r.exposed_share, lambda v: f'{v:.1%}')}</td>"
        f"<td>{_num(r.mfu, lambda v: f'{v:.1%}')}</td><td>{_num(r.param_diff, lambda v: f'{v:.0e}')}</td>"
        f"<td><small>{e(r.error[:300])}</small>"
        + (f"<details><summary>ranks' stderr</summary><pre>{e(r.stderr)}</pre></details>" if r.stderr else "")
        + "</td></tr>" for r in rows)
    return ("<table><tr><th>hook</th><th>bucket MB</th><th>bucket view</th><th>status</th><th>step</th>"
            "<th>p10–p90 ms</th><th>comm share</th><th>exposed share</th><th>DDP MFU</th><th>param diff</th>"
            f"<th>error</th></tr>{body}</table>")


def _attention_comm_section(d: dict[str, Any]) -> str:
    from mfu_lab import plots
    from mfu_lab.steps.attention_comm import AttentionCommResult

    r = AttentionCommResult.from_dict(d)
    m = d["metrics"]
    cards = _cards(m, (("MFU (recommended attention)", "mfu"), ("baseline MFU", "baseline_mfu"),
                       ("DDP MFU (recommended config)", "ddp_mfu"), ("exposed comm", "exposed_comm_share"),
                       ("all-reduce busbw", "allreduce_busbw_max_gbps")))
    advice = _advice_items(r.advice)
    att_plot = (f'<img alt="attention times" src="{plots.to_data_uri(plots.attention_times(r))}">'
                if any(a.status == "ok" for a in r.attention) else "")
    comm_plot = (f'<img alt="communication sweep" src="{plots.to_data_uri(plots.comm_sweep(r))}">'
                 if any(c.status == "ok" for c in r.comm) else "")
    bw_plot = (f'<img alt="all-reduce bandwidth" src="{plots.to_data_uri(plots.allreduce_bandwidth(r))}">'
               if r.allreduce else "")
    ledger = ""
    if r.ledger:
        fig = plots.ledger_waterfall(r.ledger, "MFU ledger, data-parallel with the recommended configuration")
        ledger = f'<img alt="DDP ledger" src="{plots.to_data_uri(fig)}">'

    return f"""
<h2>Step 2 · attention and communication</h2>
<p>Compared against: {e(r.baseline.get('source', ''))}</p>
<div class="cards">{cards}</div>
<h3>What to do next</h3><ul>{advice}</ul>
<h3>Attention</h3>{att_plot}{attention_table(r.attention)}
<h3>Communication: {e(str(r.comm_layout.get('world_size')))} ranks over {e(str(r.comm_layout.get('backend')))}</h3>
{comm_plot}{comm_table(r.comm)}{ledger}{bw_plot}
<h3>All figures</h3>{_metrics_table(m)}"""


def _ms(v: float | None) -> str:
    return "" if v is None else fmt(v, "s")


def top_table(a) -> str:
    """The top-N kernels/operators, with what the rest and the idle time add up to."""
    per = lambda s: s / a.steps  # noqa: E731 - per profiled step
    body = "".join(
        f"<tr><td>{i}</td><td title=\"{e(r.name)}\"><code>{e(r.name[:90])}</code>"
        + (f"<br><small>launched by {e(r.launched_by)}</small>" if r.launched_by else "")
        + f"</td><td>{e(r.category)}</td><td>{r.calls}</td><td>{_ms(r.total_s)}</td><td>{_ms(per(r.total_s))}</td>"
        f"<td>{_ms(r.mean_s)}</td><td>{r.share:.1%}</td><td><small>{e(r.shapes[:120])}"
        + (f" (+{r.shape_variants - 1} more)" if r.shape_variants > 1 else "") + "</small></td></tr>"
        for i, r in enumerate(a.top, 1))
    what = "kernels" if a.kind == "gpu" else "operators"
    return (f"<table><tr><th>#</th><th>{what[:-1]}</th><th>category</th><th>calls</th><th>total</th><th>per step</th>"
            f"<th>mean</th><th>share of step</th><th>input shapes (most frequent)</th></tr>{body}"
            f"<tr><th></th><th>these {len(a.top)} {what}</th><th></th><th></th><th></th><th></th><th></th>"
            f"<th>{a.top_share:.1%}</th><th></th></tr>"
            f"<tr><td></td><td>the other {a.rest_count} {what}</td><td></td><td></td><td></td><td></td><td></td>"
            f"<td>{a.rest_share:.1%}</td><td></td></tr></table>")


def breakdown_table(a) -> str:
    b = a.breakdown
    terms = {"computing": "MFU + hardware loss", "communicating (exposed)": "structure loss",
             "copying memory": "hardware loss", "waiting for data": "software loss", "idle": "software loss"}
    rows = "".join(f"<tr><td>{e(k)}</td><td>{v:.1%}</td><td>{_ms(v * b.window_s / b.steps)}</td><td>{terms[k]}</td>"
                   "</tr>" for k, v in b.parts().items())
    comm = (f"<p>Communication in all: {b.comm_total:.1%} of the window, {b.comm_overlapped:.1%} of it hidden "
            "under compute.</p>" if b.comm_total else "")
    return (f"<table><tr><th>part of the profiled step</th><th>share</th><th>per step</th><th>ledger term</th></tr>"
            f"{rows}<tr><th>total</th><th>{sum(b.parts().values()):.1%}</th><th>{_ms(b.window_s / b.steps)}</th>"
            f"<th></th></tr></table>{comm}")


def ranks_table(result, prefix: str = "") -> str:
    """The data-parallel profile: one row per rank's trace, or why there is none."""
    d = result.ddp
    if d.get("status") != "ok":
        why = d.get("reason") or d.get("error") or "not run"
        err = f"<details><summary>ranks' stderr</summary><pre>{e(d['stderr'])}</pre></details>" if d.get(
            "stderr") else ""
        return f"<p>Per-rank profile {e(d.get('status', 'not run'))}: {e(why)}</p>{err}"
    rows = "".join(
        f"<tr><td>{r.rank}</td><td>{_ms(r.step_time_s)}</td><td>{r.breakdown.computing:.1%}</td>"
        f"<td>{r.breakdown.comm_total:.1%}</td><td>{r.breakdown.comm_overlapped:.1%}</td>"
        f"<td>{r.breakdown.communicating:.1%}</td><td>{r.breakdown.copying:.1%}</td>"
        f"<td>{r.breakdown.waiting_for_data:.1%}</td><td>{r.breakdown.idle:.1%}</td>"
        f"<td>{r.matmul_attention_share:.1%}</td><td><a href=\"{e(prefix + r.trace_file)}\">{e(r.trace_file)}</a>"
        "</td></tr>" for r in d["ranks"])
    cfg = d["config"]
    return (f"<p>{d['world_size']} ranks over {e(d['backend'])}, hook <code>{e(cfg['hook'])}</code>, bucket "
            f"{cfg['bucket_mb']:g} MB, gradient_as_bucket_view {cfg['grad_as_bucket_view']} "
            f"({e(d['config_source'])}). {e(d.get('note', ''))}</p>"
            "<table><tr><th>rank</th><th>profiled step</th><th>computing</th><th>communication</th>"
            "<th>of it under compute</th><th>exposed</th><th>copying</th><th>waiting for data</th><th>idle</th>"
            f"<th>matmul + attention</th><th>trace</th></tr>{rows}</table>")


def fusion_table(a) -> str:
    if not a.fusion:
        return "<p>No run of two or more adjacent memory-bound operations in the trace.</p>"
    body = "".join(
        f"<tr><td>{i}</td><td><code>{e(c.pattern)}</code><br><small>{e(', '.join(c.categories))}</small></td>"
        f"<td>{c.per_step:g}</td><td>{_ms(c.time_per_step_s)}</td><td>{c.share_of_step:.1%}</td>"
        f"<td>{fmt(c.saved_bytes_per_step, 'bytes')}</td><td>{_ms(c.est_saving_per_step_s)}</td>"
        f"<td><small>{e(c.remedy)}</small></td><td><small>{e(c.example_shapes)}</small></td></tr>"
        for i, c in enumerate(a.fusion, 1))
    return ("<table><tr><th>#</th><th>adjacent operations</th><th>per step</th><th>measured time / step</th>"
            f"<th>share of step</th><th>traffic saved / step {badge('analytic')}</th><th>est. saving / step "
            f"{badge('analytic')}</th><th>remedy</th><th>shapes (first run)</th></tr>{body}</table>")


def compare_line(result) -> str:
    """Step 3's step time against step 1's, in one sentence."""
    c = result.compare
    mine = (f"this run {_ms(c['this_median_s'])} without the profiler, {_ms(c['profiled_median_s'])} with it "
            f"(median step)")
    if "median_s" not in c:
        return f"Step 1 has not run on this device; {mine}."
    verdict = ("the same as step 1 within its spread" if c["consistent"]
               else f"{c['difference']:+.1%} against step 1, outside its spread")
    return (f"Step 1 median {_ms(c['median_s'])} (p10–p90 {_ms(c['p10_s'])}–{_ms(c['p90_s'])}); {mine}: "
            f"{verdict}.")


def _kernels_section(d: dict[str, Any]) -> str:
    from mfu_lab import plots
    from mfu_lab.steps.kernels import OPEN_TRACE, KernelsResult

    r = KernelsResult.from_dict(d)
    a, m = r.analysis, d["metrics"]
    cards = _cards(m, (("MFU (this run)", "mfu"), ("profiler overhead", "profiler_overhead"),
                       ("top-N share", "top_n_share"), ("idle", "idle_share"),
                       ("memory-bound share", "memory_bound_share"),
                       ("fusion saving / step", "fusion_saving_per_step_s")))
    compared = compare_line(r)
    notes = "".join(f"<li>{e(n)}</li>" for n in a.notes)
    opt = a.optimizer
    opt_line = (f"<p>Optimizer step: {_ms(opt['time_per_step_s'])} per step ({opt['share_of_step']:.1%}), "
                f"{opt['ops_per_step']:.0f} {e(opt['what'])} per step, "
                f"{'multi-tensor (foreach/fused)' if opt['multi_tensor'] else 'one parameter at a time'}.</p>"
                if opt.get("found") else "")
    folder = next(s.folder for s in STEPS if s.key == "kernels")
    return f"""
<h2>Step 3 · kernels</h2>
<p>{e(compared)}</p>
<div class="cards">{cards}</div>
<h3>What to do next</h3><ul>{_advice_items(r.advice)}</ul>
<p>Trace: <a href="{e(folder)}/{e(r.trace_file)}">{e(r.trace_file)}</a> ({a.steps} steps, shapes recorded);
{e(OPEN_TRACE)}.</p>
<h3>Top {len(a.top)} {'kernels' if a.kind == 'gpu' else 'operators'}</h3>
<img alt="top kernels" src="{plots.to_data_uri(plots.top_kernels(r))}">{top_table(a)}
<h3>Time breakdown</h3>
<img alt="time breakdown" src="{plots.to_data_uri(plots.time_breakdown(r))}">{breakdown_table(a)}
<img alt="ledger" src="{plots.to_data_uri(plots.ledger_waterfall(r.ledger, "MFU ledger of the profiled steps"))}">
<h3>Data-parallel: one trace per rank</h3>
{f'<img alt="per-rank breakdown" src="{plots.to_data_uri(plots.time_breakdown(r, per_rank=True))}">'
 if r.ddp.get("ranks") else ''}{ranks_table(r, folder + "/")}
<h3>Fusion candidates</h3>
{f'<img alt="fusion candidates" src="{plots.to_data_uri(plots.fusion_candidates(r))}">' if a.fusion else ''}
{fusion_table(a)}{opt_line}<ul>{notes}</ul>
<h3>All figures</h3>{_metrics_table(m)}"""


def audit_table(r) -> str:
    a = r.audit
    rows = "".join(f"<tr><td>{e(k)}</td><td>{v}</td></tr>" for k, v in a.shapes.items())
    verdict = ('<span class="look">shapes vary</span>' if a.varies else '<span class="ok">one shape</span>')
    return (f"<p>{verdict}: {a.batches} batches, {a.epoch_samples} samples ({e(a.policy)}); batch sizes "
            f"{e(str(a.batch_sizes))}, lengths {e(str(a.seq_lens[:12]))}{'…' if len(a.seq_lens) > 12 else ''}; "
            f"padding {a.padding_fraction:.1%} of target positions.</p>"
            f"<table><tr><th>batch shape</th><th>batches</th></tr>{rows}</table>")


def recompile_table(r) -> str:
    rows = "".join(
        f"<tr><td>{e(x.label)}</td><td>{e(x.dynamic)}</td><td><small>{e(', '.join(x.shapes[:8]))}"
        f"{' …' if len(x.shapes) > 8 else ''}</small></td><td>{x.recompiles}</td><td>{x.graphs}</td>"
        f"<td><small>{'<br>'.join(e(m) for m in x.messages[:6]) or 'none'}</small></td></tr>" for x in r.recompiles)
    b = r.breaks
    breaks = (f"<p>Graph breaks in one forward (<code>torch._dynamo.explain</code>): {b.breaks} ({b.graphs} "
              f"graph{'s' if b.graphs != 1 else ''}){': ' + e('; '.join(b.reasons)) if b.reasons else ''}.</p>")
    return ("<table><tr><th>inputs</th><th>dynamic</th><th>shapes fed, in order</th><th>recompiles "
            f"{badge('counted')}</th><th>graphs</th><th>guard failure that caused each</th></tr>{rows}</table>"
            + breaks)


def _compile_s(v: float) -> str:
    """A compile time; at or below zero the first steps were no slower than eager's: within the noise."""
    return f"{v:.1f} s" if v > 0 else f"≈0 ({v:+.1f} s, within noise)"


def trials_table(r) -> str:
    def row(t):
        if t.status != "ok":
            detail = e(t.reason or t.error)
            tb = (f"<details><summary>traceback</summary><pre>{e(t.traceback)}</pre></details>"
                  if t.traceback else "")
            return f"<tr><td>{e(t.mode)}</td><td>{e(t.status)}</td><td colspan=9><small>{detail}</small>{tb}</td></tr>"
        be = lambda v: "never" if v is None else f"{v:.0f}"  # noqa: E731
        return (f"<tr><td>{e(t.mode)}</td><td>ok</td><td>{_ms(t.step_median_s)}</td>"
                f"<td>{_ms(t.step_p10_s)}–{_ms(t.step_p90_s)}</td>"
                f"<td>{'' if t.speedup is None else f'{t.speedup:.2f}x'}{' ✓' if t.faster_beyond_noise else ''}</td>"
                f"<td>{_num(t.mfu, lambda v: f'{v:.1%}')}</td><td>{_num(t.compile_cold_s, _compile_s)}"
                f"</td><td>{_num(t.compile_warm_s, _compile_s)}</td>"
                f"<td>{'' if t.mode == 'eager' else be(t.break_even_cold) + ' / ' + be(t.break_even_warm)}</td>"
                f"<td>{'' if t.drift is None else f'{t.drift:.1e}'}{' ✗' if t.drift_ok is False else ''}</td>"
                f"<td>{t.recompiles}</td></tr>")

    return (f"<table><tr><th>mode</th><th>status</th><th>step (median) {badge('measured')}</th><th>p10–p90</th>"
            "<th>speedup</th><th>MFU</th><th>compile, cold</th><th>compile, warm</th>"
            f"<th>break-even steps (cold / warm) {badge('analytic')}</th>"
            f"<th>loss drift</th><th>recompiles</th></tr>{row(r.eager)}{''.join(row(t) for t in r.trials)}</table>"
            "<p><small>✓: p90 below eager's p10 (faster beyond the noise). Loss drift: largest relative per-step "
            "difference from eager's loss, same seed and data; ✗ above the tolerance for the dtype.</small></p>")


def step3_table(r) -> str:
    s3 = r.step3
    if "patterns" not in s3:
        return f"<p>{e(s3['source'])}.</p>"
    what = "kernels" if s3["kind"] == "gpu" else "operators"
    rows = "".join(
        f"<tr><td>{e(mode)}</td><td>{_num(s3['ops_per_step'], lambda v: f'{v:.0f}')}</td>"
        f"<td>{_num(v['ops_per_step'], lambda x: f'{x:.0f}')}</td><td><small>{e('; '.join(v['removed'])) or '-'}"
        f"</small></td><td><small>{e('; '.join(v['left'])) or '-'}</small></td></tr>"
        for mode, v in s3.items() if isinstance(v, dict))
    return (f"<p>Against {e(s3['source'])}:</p><table><tr><th>mode</th><th>{what} per step, eager (step 3)</th>"
            f"<th>compiled</th><th>fusion candidates gone</th><th>still there</th></tr>{rows}</table>")


def _compile_section(d: dict[str, Any]) -> str:
    from mfu_lab import plots
    from mfu_lab.steps.compile import CompileResult

    r = CompileResult.from_dict(d)
    m = d["metrics"]
    cards = _cards(m, (("MFU (recommended)", "mfu"), ("eager MFU", "eager_mfu"), ("speedup", "speedup"),
                       ("compile, cold", "compile_cold_s"), ("break-even", "break_even_steps"),
                       ("recompiles on the data", "recompiles_on_data")))
    ok = [t for t in r.trials if t.status == "ok"]
    figs = (f'<img alt="compile modes" src="{plots.to_data_uri(plots.compile_modes(r))}">'
            f'<img alt="break-even" src="{plots.to_data_uri(plots.break_even(r))}">' if ok else "")
    return f"""
<h2>Step 4 · compile</h2>
<div class="cards">{cards}</div>
<h3>What to do next</h3><ul>{_advice_items(r.advice)}</ul>
<h3>Shapes of the data</h3>{audit_table(r)}
<h3>Recompiles</h3>{recompile_table(r)}
<h3>Modes against eager</h3>{figs}{trials_table(r)}
<h3>Kernels after compiling</h3>{step3_table(r)}
<h3>All figures</h3>{_metrics_table(m)}"""


def sensitivity_table(r) -> str:
    rows = ""
    for sc, groups in r.sensitivity.items():
        for g in groups:
            rows += (f"<tr><td>{e(sc)}</td><td>{e(g.group)}</td><td>{g.layers}</td><td>{g.flops_share:.1%}</td>"
                     f"<td>{g.output_snr_db:.1f}</td><td>{g.grad_input_snr_db:.1f}</td><td>{g.grad_weight_snr_db:.1f}</td>"
                     f"<td>{g.input_underflow:.2%}</td><td>{g.input_saturated:.2%}</td><td>{g.grad_underflow:.2%}</td>"
                     f"<td>{g.grad_saturated:.2%}</td></tr>")
    return (f"<table><tr><th>scaling</th><th>group</th><th>layers</th><th>FLOPs share</th><th>output SNR dB "
            f"{badge('emulated')}</th><th>grad-input SNR dB</th><th>grad-weight SNR dB</th><th>input underflow</th>"
            "<th>input saturated</th><th>grad underflow</th><th>grad saturated</th></tr>"
            f"{rows}</table><p><small>Worst layer of each group, over the sensitivity batches. Underflow: nonzero "
            "values cast to zero; saturated: values beyond the format's largest (e4m3 448 forward, e5m2 57344 "
            "backward).</small></p>")


def policies_table(r) -> str:
    rows = "".join(
        f"<tr><td>{e(t.name)}{' <small>(scaling study)</small>' if t.study else ''}</td>"
        f"<td><small>{e(', '.join(t.groups)) or 'none'}</small></td><td>{e(t.recipe)}</td>"
        f"<td>{t.flops_share:.0%}</td><td>{e(t.status)}</td><td>{len(t.loss)}</td>"
        f"<td>{t.loss[-1]:.4f}</td><td>{'' if t.final_gap is None else f'{t.final_gap:+.2%}'}</td>"
        f"<td><small>{e(t.reason)}</small></td></tr>" for t in r.trials)
    return (f"<table><tr><th>policy</th><th>FP8 groups</th><th>scaling</th><th>FP8 FLOPs share {badge('analytic')}"
            f"</th><th>status</th><th>steps run</th><th>last loss {badge('emulated')}</th><th>final gap</th>"
            "<th>why</th></tr>" + rows + "</table>")


def _fp8_section(d: dict[str, Any]) -> str:
    from mfu_lab import plots
    from mfu_lab.steps.fp8 import Fp8Result

    r = Fp8Result.from_dict(d)
    m = d["metrics"]
    cards = _cards(m, (("FP8 FLOPs share (chosen)", "fp8_flops_share"), ("policies kept", "policies_kept"),
                       ("worst group SNR", "worst_group_snr_db"),
                       ("grad underflow, no scaling", "no_scaling_grad_underflow")))
    frag = f"<pre>{e(r.choice['fragment'])}</pre>" if r.choice.get("fragment") else ""
    return f"""
<h2>Step 5 · FP8</h2>
<p>Path: <b>{e(r.path)}</b>. {e(r.speed.get('reason', ''))}</p>
<div class="cards">{cards}</div>
<h3>What to do next</h3><ul>{_advice_items(r.advice)}</ul>{frag}
<h3>Sensitivity</h3><img alt="sensitivity" src="{plots.to_data_uri(plots.fp8_sensitivity(r))}">{sensitivity_table(r)}
<h3>Loss curves</h3><img alt="loss curves" src="{plots.to_data_uri(plots.fp8_losses(r))}">{policies_table(r)}
<h3>All figures</h3>{_metrics_table(m)}"""


def calibration_table(r) -> str:
    rows = "".join(f"<tr><td>{e(c['input'])}</td><td>{e(fmt(c['value'], c['unit']))}</td><td>{badge(c['source'])}"
                   f"</td><td><small>{e(c['from'])}</small></td></tr>" for c in r.calibration)
    return f"<table><tr><th>model input</th><th>value</th><th>source</th><th>from</th></tr>{rows}</table>"


def _ms0(v: float) -> str:
    return "-" if not v else _ms(v)


def _pred_cells(x: dict) -> str:
    links = x["links"]
    return (f"<td>{e(x['label'])}</td><td>{x['nodes']} / {x['switches']}</td><td>{_ms(x['step_s'])}</td>"
            f"<td>{x['mfu']:.1%}</td><td>{fmt(x['tokens_per_s'], 'tokens/s')}</td>"
            f"<td>{_ms0(x['tp_s'])}</td><td>{_ms0(x['pp_s'])}</td><td>{_ms0(x['bubble_s'])}</td>"
            f"<td>{_ms0(x['dp_exposed_s'])} of {_ms0(x['dp_s'])}</td>"
            f"<td><small>TP {e(links['tp'])}; DP {e(links['dp'])}; PP {e(links['pp'])}</small></td>")


PRED_HEAD = ("<th>layout</th><th>nodes / switches</th><th>step</th><th>MFU</th><th>tokens/s</th><th>TP comm</th>"
             "<th>PP comm</th><th>bubble</th><th>DP exposed</th><th>slowest links</th>")


def strategies_table(r) -> str:
    rows = []
    for x in r.strategies:
        if x.get("status") != "ok":
            rows.append(f"<tr><td>{e(x['strategy'])}</td><td colspan=11>{e(x['status'])}</td></tr>")
            continue
        rows.append(f"<tr><td>{e(x['strategy'])}</td>{_pred_cells(x)}<td>{x['vs_aware']:.2f}x</td></tr>")
    return (f"<p>Every figure is {badge('modelled')}.</p><table><tr><th>strategy</th>{PRED_HEAD}"
            f"<th>vs topology-aware</th></tr>{''.join(rows)}</table>")


def shared_table(r) -> str:
    if not r.shared:
        return "<p>Not compared (see the skipped list).</p>"
    rows = "".join(f"<tr><td>{e(x['partition'])}</td><td>{x.get('job', '')}</td>"
                   + (_pred_cells(x) if x.get("status") == "ok" else f"<td colspan=10>{e(x['status'])}</td>")
                   + "</tr>" for x in r.shared)
    good = {}
    for x in r.shared:
        if x.get("status") == "ok":
            good.setdefault(x["partition"], []).append(x)
    total = ""
    for k, v in good.items():
        n = sum(y["layout"]["tp"] * y["layout"]["pp"] * y["layout"]["dp"] for y in v)
        flops = sum(y["mfu"] * y["layout"]["tp"] * y["layout"]["pp"] * y["layout"]["dp"] for y in v)
        total += (f"<li>{e(k)}: cluster goodput {fmt(sum(y['tokens_per_s'] for y in v), 'tokens/s')}, "
                  f"{flops / n:.1%} MFU over the {n} GPUs in use</li>")
    return (f"<p>Every figure is {badge('modelled')}; jobs whose groups cross the same uplink share its bandwidth.</p>"
            f"<table><tr><th>partition</th><th>job</th>{PRED_HEAD}</tr>{rows}</table><ul>{total}</ul>")


def sweep_table(r) -> str:
    rows = []
    for x in r.sweep:
        if x["status"] != "ok":
            rows.append(f"<tr><td>{x['gpus_n']}</td><td colspan=12>{e(x['reason'])}</td></tr>")
            continue
        me = x.get("marginal_efficiency")
        star = " ★" if x["gpus_n"] == r.efficient_size else ""
        per_hour = fmt(x["tokens_per_gpu_hour"], "tokens/s").replace("tokens/s", "tokens")
        rows.append(f"<tr><td>{x['gpus_n']}{star}</td>{_pred_cells(x)}<td>{per_hour}"
                    f"</td><td>{'-' if me is None else f'{me:.0%}'}</td><td>{x['memory_gb']:.1f} GB</td></tr>")
    return (f"<p>Every figure is {badge('modelled')}. ★ the efficient size (marginal efficiency threshold "
            f"{r.job['min_marginal_efficiency']:.0%}).</p><table><tr><th>GPUs</th>{PRED_HEAD}<th>per GPU-hour</th>"
            f"<th>marginal efficiency</th><th>memory / GPU</th></tr>{''.join(rows)}</table>")


def check_table(r) -> str:
    ch, co = r.check, r.coloc
    out = []
    if co.status == "ok":
        out.append(f"<p>Co-location {badge('measured')}: the job alone {_ms(co.alone_median_s)} per step (p10-p90 "
                   f"{_ms(co.alone_p10_s)}-{_ms(co.alone_p90_s)}); two copies at once {_ms(co.pair_median_s)} "
                   f"({_ms(co.pair_p10_s)}-{_ms(co.pair_p90_s)}): <b>{co.slowdown:.2f}x</b> slower, on "
                   f"{e(co.device)} with {co.threads} thread(s) per copy.</p>")
    else:
        out.append(f"<p>Co-location experiment failed: {e(co.reason)}</p>")
    if not ch.available:
        out.append(f"<p>No model check: {e(ch.reason)}</p>")
        return "".join(out)
    out.append(f"<p>Step 2 measured {_ms(ch.measured_s)} per data-parallel step ({ch.world} ranks, {e(ch.backend)}, "
               f"{e(ch.config)}; p10-p90 {_ms(ch.measured_p10_s)}-{_ms(ch.measured_p90_s)}). The model adds "
               f"{ch.buckets} bucket all-reduce(s) of {fmt(ch.grad_bytes, 'bytes')} of gradients, "
               f"{_ms(ch.allreduce_s)} at the bandwidth {ch.busbw_gbps:.3g} GB/s and latency "
               f"{ch.alpha_s * 1e6:.0f} µs fitted to step 2's all-reduce benchmark, to each measured compute time:</p>")
    rows = "".join(f"<tr><td>{e(x['name'])}</td><td>{_ms(x['compute_s'])} <small>{e(x['compute_from'])}</small></td>"
                   f"<td>{_ms(x['comm_s'])}</td><td>{_ms(x['predicted_s'])}</td><td>{x['error']:+.1%}</td></tr>"
                   for x in ch.rows)
    out.append(f"<table><tr><th>prediction</th><th>compute {badge('measured')}</th><th>all-reduce "
               f"{badge('modelled')}</th><th>predicted</th><th>error</th></tr>{rows}</table>")
    return "".join(out)


def gang_table(r) -> str:
    def opt(v, f):
        return "-" if v is None else f(v)

    rows = "".join(f"<tr><td>{e(g['policy'])}</td><td>{g['idle_gpu_hours']:.0f}</td>"
                   f"<td>{opt(g['makespan_h'], lambda v: f'{v:g} h')}</td>"
                   f"<td>{opt(g['mean_completion_h'], lambda v: f'{v:.2f} h')}</td>"
                   f"<td>{opt(g['deadlock_h'], lambda v: f'from hour {v:g}')}</td>"
                   f"<td>{sum(1 for j in g['jobs'] if j['end_h'] is not None)} / {len(g['jobs'])}</td></tr>"
                   for g in r.gang)
    if not r.gang:
        return ""
    return (f"<p>Simulated ({badge('modelled')}) on {e(r.gang[0]['queue_from'])}, over the "
            f"{r.gang[0]['horizon_h']:g} h the gang policy takes to finish it.</p>"
            f"<table><tr><th>policy</th><th>idle GPU-hours</th><th>makespan</th><th>mean completion (finished jobs)"
            f"</th><th>deadlock</th><th>jobs finished</th></tr>{rows}</table>")


def hints_html(r) -> str:
    if not r.hints:
        return "<p>No hints: no layout was chosen.</p>"
    return (f"<h4>Slurm</h4><pre>{e(r.hints['slurm'])}</pre><h4>Kubernetes (Kueue)</h4><pre>{e(r.hints['kueue'])}</pre>"
            f"<h4>Health gate</h4><p>{e(r.hints['gate'])}</p>")


def _placement_section(d: dict[str, Any]) -> str:
    from mfu_lab import plots
    from mfu_lab.steps.placement import PlacementResult

    r = PlacementResult.from_dict(d)
    m = d["metrics"]
    cards = _cards(m, (("predicted MFU", "predicted_mfu"), ("efficient size", "efficient_size"),
                       ("worst placement", "worst_placement_slowdown"), ("co-location slowdown", "coloc_slowdown"),
                       ("model check error", "check_error")))

    def img(fig, alt):
        return f'<img alt="{alt}" src="{plots.to_data_uri(fig)}">' if fig is not None else ""

    return f"""
<h2>Step 6 · Placement</h2>
<p>Cluster <b>{e(r.cluster['name'])}</b>: {r.cluster['gpus']} {e(r.cluster['gpu'])} in {r.cluster['nodes']} nodes
under {len(r.cluster['switches'])} leaf switches. Cluster figures are {badge('modelled')}; what each input came from
is below.</p>
<div class="cards">{cards}</div>
<h3>What to do next</h3><ul>{_advice_items(r.advice)}</ul>
<h3>Model inputs</h3>{calibration_table(r)}
<h3>The model against this machine</h3>{img(plots.model_check(r), "model check")}{check_table(r)}
<h3>Size sweep</h3>{img(plots.size_sweep(r), "size sweep")}{sweep_table(r)}
<h3>Placement strategies</h3>{img(plots.placement_strategies(r) if r.chosen else None, "strategies")}
{img(plots.placement_map(r), "placement map")}{strategies_table(r)}
<h3>Several jobs on the cluster</h3>{shared_table(r)}
<h3>Gang scheduling</h3>{img(plots.gang_timeline(r) if r.gang else None, "gang")}{gang_table(r)}
<h3>Scheduler hints</h3>{hints_html(r)}
<h3>All figures</h3>{_metrics_table(m)}"""


SECTIONS = {"baseline": _baseline_section, "attention_comm": _attention_comm_section, "kernels": _kernels_section,
            "compile": _compile_section, "fp8": _fp8_section, "placement": _placement_section}


def load_results(job_root: Path) -> dict[str, dict]:
    """Every step's result.json under a job's output folder, by step key."""
    out = {}
    for info in STEPS:
        p = job_root / info.folder / RESULT_FILE
        if p.is_file():
            out[info.key] = read_json(p)
    return out


def _ledger_obj(d: dict):
    from mfu_lab.core.ledger import Ledger, LedgerItem

    return Ledger([LedgerItem(**i) for i in d["items"]])


def changes_table(results: dict[str, dict]) -> str:
    from mfu_lab.report.summary import changes

    rows = changes(results)
    if not rows:
        return "<p>No step that measures a change (2, 4, 5, 6) has run yet.</p>"
    cls = {"adopt": "act", "in the job": "ok", "keep as is": "notrun", "not measured": "notrun"}
    body = "".join(
        f"<tr><td>{e(c.step[:2].lstrip('0'))}</td><td>{e(c.change)}</td><td>{fmt(c.gain, c.unit)}{badge(c.source)}</td>"
        f'<td><span class="{cls.get(c.status, "")}">{e(c.status)}</span></td><td><small>{e(c.how)}</small></td></tr>'
        for c in rows)
    return ("<table><tr><th>#</th><th>change</th><th>gain</th><th>status</th><th>how it was measured / how to "
            f"adopt it</th></tr>{body}</table>")


def recommendations_list(results: dict[str, dict]) -> str:
    from mfu_lab.report.summary import recommendations

    items = recommendations(results)
    return "<ol>" + "".join(
        f'<li><span class="{e(a.get("severity", ""))}">{e(a.get("severity", ""))}</span> <small>{e(folder)}</small> '
        f'{e(a.get("message", ""))} <small>({e(a.get("because", ""))})</small></li>' for folder, a in items
    ) + "</ol>" if items else "<p>No recommendation yet.</p>"


def environment_html(results: dict[str, dict]) -> str:
    """The environment of the latest step to run, and step 1's device health (NVML)."""
    if not results:
        return "<p>No step has run yet.</p>"
    latest = max(results.values(), key=lambda d: d.get("environment", {}).get("created_at") or "")
    env = "".join(f"<tr><td>{e(str(k))}</td><td>{e(str(v))}</td></tr>" for k, v in latest["environment"].items())
    h = results.get("baseline", {}).get("health")
    if h is None:
        health = "<p>Device health is read in step 1 (NVML), which has not run.</p>"
    elif h.get("sampled"):
        health = (f"<p>Step 1 read {h['samples']} NVML samples: max {h['temperature_c_max']:.0f} C, SM clock "
                  f"{h['sm_clock_mhz_mean']:.0f} of {h['sm_clock_mhz_max_supported']:.0f} MHz, "
                  f"{h['power_w_mean']:.0f} W of {h.get('power_limit_w') or 0:.0f} W; clock reasons seen: "
                  f"{e(', '.join(h.get('reasons_seen') or []) or 'none')}.</p>")
    else:
        health = f"<p>Device health not read: {e(h.get('skipped_reason', ''))}.</p>"
    return f"{health}<table>{env}</table>"


def history_html(job_root: Path) -> str:
    """The job's MFU across runs (a trend once two runs exist) and its runs, newest first."""
    from mfu_lab import plots
    from mfu_lab.core.history import mfu_trend, runs

    table = runs(job_root)
    if not table:
        return "<p>No run recorded yet.</p>"
    trend = mfu_trend(job_root, table)
    img = (f'<img alt="MFU across runs" src="{plots.to_data_uri(plots.mfu_trend(trend))}">' if trend else "")
    by_run = dict(trend)
    rows = []
    for rid, steps in list(table.items())[::-1][:20]:
        first = next(iter(steps.values()))
        mfus = ", ".join(f"{k[:2]}: {v:.1%}" for k, v in by_run.get(rid, {}).items())
        link = (f'<a href="runs/{e(rid)}/">{e(rid)}</a>' if (job_root / "runs" / rid).is_dir() else e(rid))
        rows.append(f"<tr><td>{link}</td><td>{e(', '.join(steps))}</td><td>{e(mfus)}</td>"
                    f"<td><code>{e(str(first.get('job_digest')))}</code></td>"
                    f"<td><code>{e(str(first.get('git_commit'))[:12])}</code></td></tr>")
    more = f"<p><small>{len(table) - 20} older runs not listed.</small></p>" if len(table) > 20 else ""
    return (f"{img}<table><tr><th>run (UTC)</th><th>steps</th><th>MFU (measured)</th><th>job parameters</th>"
            f"<th>workbook commit</th></tr>{''.join(rows)}</table>{more}"
            f"<p>What changed between two runs, beyond the noise: <code>mfu-lab compare previous latest --job-dir "
            f"{e(str(job_root))}</code>. A different <i>job parameters</i> digest means the job file changed.</p>")


def _section(key: str, d: dict[str, Any]) -> str:
    """One step's detailed section; a result this version cannot read (an older or damaged file) is named,
    not allowed to take the whole page down."""
    try:
        return SECTIONS[key](d)
    except Exception as exc:  # noqa: BLE001 - any shape problem in a stored result
        info = BY_KEY[key]
        return (f"<h2>Step {info.number} · {e(key)}</h2><p class=\"failed\">This step's result.json could not be "
                f"shown by this version of mfu-lab ({e(type(exc).__name__)}: {e(str(exc))}); rerun the step.</p>")


def write_index(job_root: Path) -> Path:
    """(Re)write ``<job_root>/index.html`` from whatever step results exist."""
    from mfu_lab import plots
    from mfu_lab.report.summary import headline, ledger_before_after, mfu_points

    job_root = Path(job_root)
    results = load_results(job_root)
    rows = "".join(_step_row(job_root, info, results.get(info.key)) for info in STEPS)
    points = mfu_points(results)
    progression = (f'<img alt="MFU progression" src="{plots.to_data_uri(plots.mfu_progression(points))}">'
                   if points else "<p>No step has produced an MFU yet.</p>")
    before, after = ledger_before_after(results)
    if before and after:
        fig = plots.ledger_before_after(_ledger_obj(before[1]), _ledger_obj(after[1]), (before[0], after[0]))
        ledgers = (f'<img alt="ledger before and after" src="{plots.to_data_uri(fig)}">'
                   "<p><small>Before: step 1's ledger of the measured steps (one process). After: step 3's rule "
                   "(the trace's computing, communication, copies, data wait and idle) over the profiled steps of "
                   "step 4's run. Both are measured; the two methods split the same time slightly differently, so "
                   "compare the MFU bars first.</small></p>")
    elif before:
        fig = plots.ledger_waterfall(_ledger_obj(before[1]), before[0])
        ledgers = (f'<img alt="ledger before" src="{plots.to_data_uri(fig)}">'
                   "<p>After: no step has measured a changed configuration's ledger yet (step 4 does).</p>")
    else:
        ledgers = "<p>Step 1 measures the ledger; it has not run.</p>"
    sections = "".join(_section(k, results[k]) for k in SECTIONS if k in results)
    any_result = next(iter(results.values()), None)
    env = any_result["environment"] if any_result else {}
    summary = "".join(f"<li>{e(line)}</li>" for line in headline(results))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mfu-lab · {e(job_root.name)}</title>
<style>{CSS}</style></head><body class="mfu">
<h1>mfu-lab · job <code>{e(job_root.name)}</code></h1>
<p class="sub">{e(env.get('device_name', ''))} · torch {e(str(env.get('torch', '')))} · workbook commit
{e(str(env.get('git_commit', '')))} · labels say where each number comes from:
{''.join(badge(s) for s in ('measured', 'counted', 'analytic', 'datasheet', 'emulated', 'modelled'))}</p>
<h2>Summary</h2><ul>{summary}</ul>
<h2>MFU, step by step</h2>
{progression}
<table><tr><th>#</th><th>step</th><th>status</th><th>MFU</th><th>tokens/s</th><th>median step</th><th>files</th></tr>
{rows}</table>
<h2>The ledger, before and after</h2>{ledgers}
<h2>Changes measured</h2>{changes_table(results)}
<h2>Recommendations, all steps</h2>{recommendations_list(results)}
<h2>Runs of this job</h2>{history_html(job_root)}
<h2>Environment and device health</h2>{environment_html(results)}
<h2>Step by step, in detail</h2>
{sections}
</body></html>
"""
    path = job_root / "index.html"
    job_root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


# ------------------------------------------------------------------ notebook and terminal views
class Html(str):
    """HTML that Jupyter renders (``_repr_html_``) and a terminal prints as markup."""

    def _repr_html_(self) -> str:
        return str(self)


def _as_dict(result) -> dict[str, Any]:
    from mfu_lab.core.results import jsonable

    return result if isinstance(result, dict) else jsonable(result)


def metrics_view(result) -> Html:
    """Every metric of a result with its value, source label and how it was obtained."""
    return _part(_metrics_table(_as_dict(result)["metrics"]))


def ledger_view(result) -> Html:
    """The ledger as a table: each part, its share of peak, its source and how it was computed."""
    items = _as_dict(result)["ledger"]["items"]
    rows = "".join(f"<tr><td>{e(i['name'])}</td><td>{i['fraction']:.1%}</td><td>{badge(i['source'])}</td>"
                   f"<td><small>{e(i['explanation'])}</small></td></tr>" for i in items)
    total = sum(i["fraction"] for i in items)
    return Html(f'<style>{PART_CSS}</style><div class="mfu"><table><tr><th>part</th><th>share of peak</th>'
                f"<th>source</th><th>how</th></tr>{rows}<tr><th>total</th><th>{total:.1%}</th><th></th><th></th>"
                "</tr></table></div>")


def advice_view(result) -> Html:
    d = _as_dict(result)
    items = "".join(f'<li><b>{e(a["severity"])}</b>: {e(a["message"])} <small>({e(a["because"])})</small></li>'
                    for a in d.get("advice", []))
    skipped = "".join(f"<li>{e(s['what'])}: {e(s['reason'])}</li>" for s in d.get("skipped", []))
    return Html(f"<ul>{items or '<li>nothing stands out</li>'}</ul>"
                + (f"<p>Skipped, and why:</p><ul>{skipped}</ul>" if skipped else ""))


def text_summary(result) -> str:
    """A plain-text table of a result's metrics, for the terminal."""
    d = _as_dict(result)
    rows = [(k, fmt(v["value"], v["unit"]), v["source"]) for k, v in d["metrics"].items()]
    w = max(len(r[0]) for r in rows)
    lines = [f"{k:<{w}}  {v:>14}  [{s}]" for k, v, s in rows]
    for a in d.get("advice", []):
        lines.append(f"- {a['severity']}: {a['message']} ({a['because']})")
    for s in d.get("skipped", []):
        lines.append(f"- skipped {s['what']}: {s['reason']}")
    return "\n".join(lines)


def attention_view(result) -> Html:
    return _part(attention_table(result.attention))


def comm_view(result) -> Html:
    return _part(comm_table(result.comm))


def _part(inner: str) -> Html:
    return Html(f'<style>{PART_CSS}</style><div class="mfu">{inner}</div>')


def top_view(result) -> Html:
    return _part(top_table(result.analysis))


def breakdown_view(result) -> Html:
    return _part(breakdown_table(result.analysis))


def fusion_view(result) -> Html:
    return _part(fusion_table(result.analysis))


def ranks_view(result) -> Html:
    return _part(ranks_table(result))


def audit_view(result) -> Html:
    return _part(audit_table(result))


def recompile_view(result) -> Html:
    return _part(recompile_table(result))


def trials_view(result) -> Html:
    return _part(trials_table(result))


def step3_view(result) -> Html:
    return _part(step3_table(result))


def sensitivity_view(result) -> Html:
    return _part(sensitivity_table(result))


def policies_view(result) -> Html:
    return _part(policies_table(result))


def calibration_view(result) -> Html:
    return _part(calibration_table(result))


def check_view(result) -> Html:
    return _part(check_table(result))


def sweep_view(result) -> Html:
    return _part(sweep_table(result))


def strategies_view(result) -> Html:
    return _part(strategies_table(result))


def shared_view(result) -> Html:
    return _part(shared_table(result))


def gang_view(result) -> Html:
    return _part(gang_table(result))


def hints_view(result) -> Html:
    return _part(hints_html(result))
