"""The commands for a production training job, outside the workbook's steps: ``mfu-lab gate`` (the pre-launch GPU
health gate on this node) and ``mfu-lab monitor report`` (read what the production monitor recorded)."""

from __future__ import annotations

from mfu_lab.commands.common import EXIT_OK, EXIT_STEP_FAILED
from mfu_lab.core.measure.health import gate
from mfu_lab.core.store.files import read_json
from mfu_lab.runner import monitor_report


def cmd_monitor_report(args) -> int:
    report, summary_file = monitor_report(args.dir, args.out, quiet=args.quiet)
    s = read_json(summary_file)
    print(f"mfu-lab: {s['read']['ranks']} rank(s) on {s['read']['nodes']} node(s), {s['read']['steps']:,} timed "
          f"steps, {s['span']['launches']} launch(es)" + (f"; {s['read']['skipped_lines']} unreadable line(s) "
                                                          "skipped" if s["read"]["skipped_lines"] else ""))
    for note in s.get("notes") or []:  # what was skipped or left out, and the clocks: never silent
        print(f"note: {note}")
    print(f"verdict: {s['verdict']}")
    print(f"wrote {summary_file}" + (f" and {report}" if report else " (papermill is not installed here: no "
                                     "report.html; run mfu-lab monitor report on a machine with the workbook)"))
    return EXIT_OK


def cmd_gate(args) -> int:
    ok, lines = gate(args.max_temp_c)
    for line in lines:
        print(line)
    print("health gate: " + ("passed" if ok else "FAILED"))
    return EXIT_OK if ok else EXIT_STEP_FAILED
