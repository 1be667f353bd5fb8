"""
bench.py's `auto` rows: what attn='auto' (attn_auto.py) picks for each padding and mask of the train sweep,
beside the fastest row the sweep itself measured. The pick should be that row, or within the round-robin's noise
of it (the two rows' interquartile ranges overlap).
"""

from benchmarks.measure import paired_speedup
from attn_auto import Workload, choose
from core.runtime import Runtime


def auto_rows(rows: dict, trainers: dict, cfg, rt: Runtime) -> list[dict]:
    """One row per (padding, mask, loss) with a measured row: the pick's measurements, labelled auto, with `auto_pick`,
    `fastest`, `pick_vs_fastest` (the pick's time over the fastest's, paired) and `within_noise`."""
    out = []
    for (pad, mask, loss), trainer in trainers.items():
        ran = {r["attn"]: r for r in rows.values()
               if (r["pad_vocab"], r["mask"], r["loss"]) == (pad, mask, loss) and r["status"] == "ok"}
        if not ran:
            continue
        workload = Workload.of(trainer.model.config, rt, cfg.batch_size, cfg.seq_len, training=True,
                               compiled=cfg.compile)
        decision = choose(workload, rt, cfg.attn_auto_budget, cfg.attn_auto_refresh)
        fastest = min(ran.values(), key=lambda r: r["ms_per_iter"])
        if decision.pick not in ran:  # picked one the sweep did not run (--attn named others)
            out.append(dict(attn="auto", pad_vocab=pad, mask=mask, loss=loss, status="skipped", auto_pick=decision.pick,
                            reason=f"auto picked {decision.pick}, which this sweep did not run"))
            continue
        pick = ran[decision.pick]
        overlap = pick["ms_p25"] <= fastest["ms_p75"] and fastest["ms_p25"] <= pick["ms_p75"]
        out.append({**pick, "attn": "auto", "auto_pick": decision.pick, "auto_line": decision.line(),
                    "fastest": fastest["attn"], "pick_vs_fastest": 1 / paired_speedup(fastest, pick),
                    "within_noise": decision.pick == fastest["attn"] or overlap})
    return out
