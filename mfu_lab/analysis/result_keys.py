"""What a result may change in the tuned job: the one table of each reader's keys with their types
(:data:`MAY_SET`), the keys that name code and never come from a result (:data:`CODE_KEYS`), and the check every
change read from a result passes (:func:`admitted`). A result on disk is data, never configuration: a planted
``result.json`` naming ``model: evilmod:make`` or ``factory_paths`` is refused here, its value withheld, before
:mod:`mfu_lab.analysis.tuning` builds the tuned job. A new reader (a new rung) adds its row to :data:`MAY_SET`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mfu_lab.core.job.rules import rule_problem, type_problem
from mfu_lab.core.job.schema import FIELDS

# keys that name code, or where code comes from: never taken from a result, whatever reader or table says so
CODE_KEYS = ("model", "model_kwargs", "data", "loss", "tokenizer", "factory_paths", "trust", "compile_options",
             "compile_backend")


class Owns(NamedTuple):
    """What one reader of a step's result is, in words, and the job keys its rung may set, with their types."""

    what: str
    keys: dict[str, type]


_FSDP_PICK = {"dp_mode": str, "fsdp_reshard_after_forward": bool, "fsdp_prefetch": int, "fsdp_reduce_dtype": str}
_LAYOUT = {"dp_mode": str, "fsdp_reshard_after_forward": bool, "tp": int, "sp": bool, "pp": int, "pp_schedule": str,
           "pp_microbatches": int, "pp_virtual_stages": int, "micro_batch": int}
# The one table of what a result may change: reader (READERS' names) -> the keys its rung owns. A new reader (a new
# rung) adds its row here; a key not in its row, a value of another type and any of CODE_KEYS are not adopted.
MAY_SET: dict[str, Owns] = {
    "attention": Owns("step 2's attention race", {"attention": str}),
    "communication": Owns("step 2's DDP and FSDP2 race", {"ddp_hook": str, "ddp_bucket_mb": float,
                                                          "ddp_grad_as_bucket_view": bool} | _FSDP_PICK),
    "layout": Owns("step 6's layouts measured on this node", _LAYOUT),
    "data": Owns("step 1's data check and loader race", {"num_workers": int, "prefetch_factor": int,
                                                         "pin_memory": bool, "persistent_workers": bool}),
    "optimizer": Owns("step 3's optimizer race", {"adamw_impl": str}),
    "batch": Owns("step 3's batch race", {"micro_batch": int, "grad_accum": int, "activation_checkpointing": bool,
                                          "checkpoint_policy": str}),
    "compile": Owns("step 4's compile trials", {"compile_mode": str, "seq_policy": str}),
    "loss": Owns("step 4's loss race", {"loss_impl": str}),
    "precision": Owns("step 5's precision ladder", {"dtype": str, "matmul_precision": str}),
    "fp8": Owns("step 5's FP8 policy trials", {"fp8_layers": list, "fp8_recipe": str}),
    "rechecked": Owns("step 7's own re-checks", {"attention": str}),
}
# step 7 withdraws what it did not measure faster (or could not time): each key back to the job's own value, so it may
# touch any key a rung sets (analysis.tuning._withdrawn; a withdrawal re-read from step 7's result must hold)
MAY_SET["withdrawn"] = Owns("step 7's withdrawals",
                            {k: t for o in MAY_SET.values() for k, t in o.keys.items()})
_TYPE_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "text", list: "a list"}
WITHHELD = "(withheld)"


def refusal(reader: str, key: Any, value: Any) -> str | None:
    """Why ``reader`` may not set ``key`` to ``value`` from a result (:data:`MAY_SET`), None when it may."""
    owns = MAY_SET[reader]
    why = None
    if key in CODE_KEYS:
        why = (f"{key} names code: a key that names code ({', '.join(CODE_KEYS)}) never comes from a result, only "
               "from the job file; no step writes such a change, so look at who wrote this result")
    elif not isinstance(key, str) or key not in FIELDS:
        why = f"not a job key (it sets only {', '.join(owns.keys)})"
    elif key not in owns.keys:
        why = f"not a key it may set (it sets only: {', '.join(owns.keys)}); a result is data, never configuration"
    elif isinstance(value, bool) != (owns.keys[key] is bool) or not isinstance(
            value, (int, float) if owns.keys[key] is float else owns.keys[key]):
        why = f"must be {_TYPE_WORDS[owns.keys[key]]} ({owns.keys[key].__name__})"
    else:
        value, why = type_problem(FIELDS[key], value, FIELDS)
        why = why or rule_problem(key, FIELDS[key].metadata, value)
    return f"refused from {owns.what}: {why}" if why else None


def admitted(reader: str, found: list[Any]) -> tuple[list[Any], list[Any]]:
    """(the changes ``reader`` may make, those it may not), of :class:`mfu_lab.analysis.tuning.Change` rows: each of
    the latter not adopted, with why; the value of a key that names code is withheld (never copied into tuned.yaml)."""
    ok, refused = [], []
    for c in found:
        why = refusal(reader, c.key, c.new)
        if why is None:
            ok.append(c)
            continue
        if c.key in CODE_KEYS:
            c.new = WITHHELD
        c.adopted, c.reason = False, why
        refused.append(c)
    return ok, refused
