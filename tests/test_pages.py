"""Issue 21: what the reader meets: impossible figures flagged, empty outputs explained."""

from __future__ import annotations

from mfu_lab.report.format import flagged, impossible
from mfu_lab.report.templating import macros


def test_a_share_outside_0_to_100_percent_is_flagged_and_explained():
    assert impossible("attention_share", 1.279, "fraction").startswith("127.9% cannot be a share of a whole")
    assert impossible("mfu", -0.01, "fraction")
    assert impossible("attention_share", 0.42, "fraction") == ""
    assert impossible("profiler_overhead", 1.5, "fraction") == ""  # a relative change, not a share
    assert impossible("flops_disagreement", -0.3, "fraction") == ""
    html = str(flagged("attention_share", 1.279, "fraction"))
    assert "127.9%" in html and "⚠" in html and "not used for any recommendation" in html
    assert "⚠" not in str(flagged("mfu", 0.5, "fraction"))


def test_the_metrics_table_and_the_cards_carry_the_flag():
    metrics = {"attention_share": {"value": 1.279, "unit": "fraction", "source": "measured", "note": ""},
               "mfu": {"value": 0.4, "unit": "fraction", "source": "measured", "note": ""}}
    table = str(macros("parts.html.j2").metrics_table(metrics))
    assert table.count("⚠") == 1 and "cannot be a share" in table
    cards = str(macros("parts.html.j2").cards(metrics, [("share", "attention_share"), ("MFU", "mfu")]))
    assert cards.count("⚠") == 1
