"""
What bench.py prints and draws: the plain-text table of a sweep's rows and the mode's chart (the PyTorch blog post's figure).
"""

from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.bench_generate import CACHES, generate_chart
from core.configurator import Settings
from core.writing import staged_outputs


def format_table(rows: list[dict], columns: dict[str, Callable[[dict], str]]) -> str:
    """A plain-text table; a skipped or out-of-memory row shows a numbered reason instead of its numbers, each reason
    written once below (an implementation's rows that share one are one line)."""
    formats = list(columns.values())
    labels = 3 if "mask" in columns else 2
    why = lambda row: f"{row['status']}: {row['reason']}"  # noqa: E731
    reasons = list(dict.fromkeys(why(row) for row in rows if row["status"] != "ok"))
    skipped = {}  # (attn cell, reason) -> how many rows
    for row in rows:
        if row["status"] != "ok":
            key = (formats[0](row), why(row))
            skipped[key] = skipped.get(key, 0) + 1
    cells, listed = [], set()
    for row in rows:
        if row["status"] == "ok":
            cells.append([f(row) for f in formats])
            continue
        key = (formats[0](row), why(row))
        if key in listed:
            continue
        listed.add(key)
        names = [f(row) for f in formats[:labels]] if skipped[key] == 1 else \
            [key[0], f"{skipped[key]} rows"] + [""] * (labels - 2)
        cells.append(names + [f"{row['status']} ({reasons.index(why(row)) + 1})"])
    widths = [max([len(h)] + [len(c[i]) for c in cells if len(c) == len(formats) or i < labels])
              for i, h in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    notes = [f"({i}) {reason}" for i, reason in enumerate(reasons, 1)]
    if "paired speedup" in columns:  # what the column is, beside the medians it is not the ratio of
        notes.append("paired speedup: the median over timed rounds of manual's ms / the row's in the same round "
                     "(back to back, so drift cancels); not the ratio of the two ms medians shown")
    if any(unreliable(row) or row.get("speedup_vs_manual", 0) is None for row in rows if row["status"] == "ok"):
        notes.append("unreliable: the row's spread (IQR) exceeds its median, or its baseline's does, so its speedup "
                     "says nothing; time it again on a quieter machine, or with more --iters")
    return "\n".join([line(list(columns)), line(["-" * w for w in widths])] + [line(c) for c in cells] + notes)


def unreliable(row: dict) -> bool:
    return "ms_per_iter" in row and "ms_p75" in row and row["ms_p75"] - row["ms_p25"] > row["ms_per_iter"]


def kernel_cell(row: dict) -> str:
    """The kernel that ran, and what was expected when it differs: a silent fallback shows."""
    return row["kernel"] + ("" if row["kernel_ok"] else f"  ! expected {'/'.join(row['kernel_expected'])}")


def compile_cell(row: dict) -> str:
    """What dynamo did during the row: graphs compiled, graph breaks, and a recompile limit hit (the row then ran
    eagerly). '-' for a row dynamo never saw."""
    graphs, breaks, hits = (row.get(k, 0) for k in ("graphs_compiled", "graph_breaks", "recompile_limit_hits"))
    if not (graphs or breaks or hits):
        return "-"
    own = " (the eager call's own trace)" if row.get("eager_reference") else ""  # eager flex traces its mask
    return f"{graphs} graphs{own}" + (f", {breaks} breaks" if breaks else "") + (", LIMIT HIT: eager" if hits else "")


def speedup_cell(row: dict) -> str:  # None: the baseline was unreliable
    speedup = row.get("speedup_vs_manual", float("nan"))
    return "unreliable" if unreliable(row) or speedup is None else f"{speedup:.2f}x"


def padding_note(rows: list[dict]) -> str:
    """What this run's own rows say of padding: in how many (attn, mask, loss) pairs the padded row was faster, and
    the median ratio of their times."""
    ok = {(r["attn"], r["mask"], r["loss"], r["pad_vocab"]): r for r in rows if r["status"] == "ok" and
          "ms_per_iter" in r and r["attn"] != "auto"}
    ratios = [ok[a, m, loss, True]["ms_per_iter"] / row["ms_per_iter"] for (a, m, loss, padded), row in ok.items()
              if not padded and (a, m, loss, True) in ok]
    if not ratios:
        return "no implementation ran both padded and unpadded, so this run says nothing of padding"
    faster = sum(ratio < 1 for ratio in ratios)
    return (f"padded vocabulary faster in {faster} of {len(ratios)} pairs of rows here (median time ratio "
            f"{float(np.median(ratios)):.2f}x the unpadded row's); why PyTorch's post expects it on a GPU: "
            f"docs/bench.md")


def computed_cell(row: dict) -> str:
    """The share of the score matrix the kernel computes (bench_masks.fractions)."""
    return f"{row['computed']:.2f}"


def attn_cell(row: dict) -> str:
    if row.get("auto_pick"):  # attn=auto's row: what it picked, and how that compares with the fastest row
        verdict = "" if row.get("within_noise", True) else f", {row['pick_vs_fastest']:.2f}x {row['fastest']}'s time, paired by round"
        timing = " (its row's timing)" if row.get("same_as") else ""
        return f"auto -> {row['auto_pick']}{timing}{verdict}"
    return row["attn"] + (" (eager reference)" if row.get("eager_reference") else "")


TRAIN_COLUMNS = {
    "attn": attn_cell,
    "vocab": lambda r: f"{r['vocab']} {'padded' if r['pad_vocab'] else 'unpadded'}" + (
        ", whole logits" if r.get("loss") == "whole" else ""),
    "mask": lambda r: r["mask"],
    "ms/iter": lambda r: f"{r['ms_per_iter']:.1f}",
    "IQR ms": lambda r: f"{r['ms_p75'] - r['ms_p25']:.1f}",
    "tokens/s": lambda r: f"{r['tokens_per_s']:,.0f}",
    "MFU": lambda r: "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
    "peak GB": lambda r: f"{r['mem/peak_gb']:.3f}",
    "paired speedup": speedup_cell,
    "max batch": lambda r: str(r.get("max_batch", "-")),
    "computed": computed_cell,
    "kernel": kernel_cell,
    "compile": compile_cell,
}
ATTENTION_COLUMNS = {
    "attn": attn_cell,
    "case": lambda r: f"hs={r['head_size']} T={r['seq_len']} {'fwd+bwd' if r['backward'] else 'fwd'}",
    "mask": lambda r: r["mask"],
    "ms": lambda r: f"{r['ms_per_iter']:.2f}",
    "IQR ms": lambda r: f"{r['ms_p75'] - r['ms_p25']:.2f}",
    "added GB": lambda r: f"{r['mem/peak_gb']:.3f}",
    "paired speedup": speedup_cell,
    "computed": computed_cell,
    "kernel": kernel_cell,
    "compile": compile_cell,
}


GENERATE_COLUMNS = {
    "attn": lambda r: r["attn"],
    "weights": lambda r: r["weights"],
    "cache": lambda r: CACHES[r["cache"]],
    "tokens/s": lambda r: f"{r['tokens_per_s']:,.1f}",
    "prefill ms": lambda r: f"{r['prefill_ms']:.1f}",
    "ms/token": lambda r: f"{r['ms_per_token']:.2f}",
    "GB/s": lambda r: f"{r['gb_per_s']:,.1f}" if "gb_per_s" in r else "-",
    "% of bandwidth": lambda r: (f"{100 * r['bandwidth_share']:.0f}% of {r['bandwidth_gb_s']:,.0f} GB/s"
                                 if "bandwidth_share" in r else "-"),
    "vs nanoGPT (sdpa, no cache)": lambda r: f"{r.get('speedup_vs_nanogpt', float('nan')):.1f}x",
    "= no cache": lambda r: {True: "yes", False: "NO", None: "-"}[r["same_tokens_as_no_cache"]],
    "compile s": lambda r: "-" if r["compile_s"] is None else f"{r['compile_s']:.0f}",
    "weights MB": lambda r: f"{r['weight_bytes'] / 1e6:.1f}",
    "KV MB": lambda r: f"{r['kv_cache_bytes'] / 1e6:.2f}",
    "peak MB": lambda r: f"{r['mem/peak_gb'] * 1e3:.1f}",
    "kernel": kernel_cell,
    "compile": compile_cell,
}


def chart(path: Path, rows: list[dict], cfg: Settings, env: dict) -> None:
    """The mode's figure, with the machine and dtype in its title."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    title = generate_chart(ax, rows, cfg) if cfg.mode == "generate" else ms_chart(ax, rows, cfg)
    precision = f"weights {', '.join(cfg.weights)}" if cfg.mode == "generate" else cfg.dtype  # a bar per weights
    ax.set_title(f"{env['device_name']}, {precision}\n{title}", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    legend = fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=3, frameon=False)  # never over a bar
    fig.tight_layout(rect=(0, legend.get_window_extent(fig.canvas.get_renderer()).height / fig.bbox.height, 1, 1))
    with staged_outputs(path.parent, [path.name], what=f"the chart to {path}") as tmp:  # complete or not at all
        fig.savefig(tmp[path.name], dpi=120, format="png")
    plt.close(fig)


def ms_label(ms: float) -> str:
    """A bar's milliseconds as people write them: 3,130 and 41.7 and 0.512, never 3.13e+03; '' for a gap."""
    return "" if ms != ms else f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def ms_chart(ax, rows: list[dict], cfg: Settings) -> str:
    """The figure of PyTorch's post: ms per step per attn, unpadded and padded side by side, IQR whiskers (attention
    mode: one bar per sequence length)."""
    name_masks = len(cfg.mask) > 1 or cfg.mask != ["causal"]  # the series say which mask
    if cfg.mode == "train":
        series = {f"vocab {'padded' if p else 'unpadded'}" + (f", {m}" if name_masks else "") +
                  (f", {loss} loss" if len(cfg.loss) > 1 else ""): {"pad_vocab": p, "mask": m, "loss": loss}
                  for p in cfg.padding for m in cfg.mask for loss in cfg.loss}
        dropout = f", dropout {cfg.dropout:g}" if cfg.dropout else ""
        title = (f"{cfg.n_layer} layers, n_embd {cfg.n_embd}, B={cfg.batch_size}, T={cfg.seq_len}{dropout}: ms per "
                 f"training step (lower is better)")
    elif name_masks:  # one bar per mask, at the longest sequence
        hs, T = cfg.attn_head_sizes[0], max(cfg.attn_seq_lens)
        series = {m: {"seq_len": T, "head_size": hs, "backward": True, "mask": m} for m in cfg.mask}
        title = f"attention forward+backward, hs={hs}, T={T}, by mask (lower is better)"
    else:
        hs = cfg.attn_head_sizes[0]
        series = {f"T={T}": {"seq_len": T, "head_size": hs, "backward": True} for T in cfg.attn_seq_lens}
        title = f"attention forward+backward, hs={hs} (lower is better)"
    # several lengths, ms 100x apart (a linear axis hid the short bars, a log one distorted the ratios): each length
    # is drawn as its speedup over its own manual row
    speedups = cfg.mode == "attention" and not name_masks and len(cfg.attn_seq_lens) > 1 and "manual" in cfg.attn
    if speedups:
        title = (f"attention forward+backward, hs={hs}: speedup over manual at each length\n(higher is better; "
                 f"ms, other head sizes and forward only: the table)")
    ok = [r for r in rows if r["status"] == "ok"]
    bars = {label: {r["attn"]: r for r in ok if all(r[k] == v for k, v in match.items())}
            for label, match in series.items()}
    empty = [label for label, by_attn in bars.items() if not by_attn]  # every row failed or was left out
    if empty and len(empty) < len(bars):  # no legend entry without bars: the title says why it is missing
        bars = {label: by_attn for label, by_attn in bars.items() if by_attn}
        title += f"\n{', '.join(empty)}: no row measured (the table says why)"
    groups = [a for a in cfg.attn if any(a in by_attn for by_attn in bars.values())]
    # one row per implementation, top to bottom in the sweep's order: names of any length stay legible side by
    # side (nine under each other, where columns ran into each other), each bar labelled with its value
    ax.figure.set_size_inches(7.0, 1.2 + 0.28 * max(1, len(groups) * len(bars)))
    height = 0.8 / len(bars)
    for i, (label, by_attn) in enumerate(bars.items()):
        found = [by_attn.get(a) for a in groups]  # None: skipped, a gap in the chart
        ys = np.arange(len(groups)) + (i - (len(bars) - 1) / 2) * height
        doubtful = [r is not None and speedup_cell(r) == "unreliable" for r in found]  # as the table calls them
        if speedups:  # no bar where the table shows no speedup: the word instead
            values = [0.0 if bad else r.get("speedup_vs_manual") or np.nan if r else np.nan
                      for r, bad in zip(found, doubtful)]
            drawn = ax.barh(ys, values, height, label=label)
            labels = ["unreliable" if bad else "" if x != x else f"{x:.2f}x" for x, bad in zip(values, doubtful)]
        else:
            values = [r["ms_per_iter"] if r else np.nan for r in found]
            whiskers = [(r["ms_per_iter"] - r["ms_p25"], r["ms_p75"] - r["ms_per_iter"]) if r else (0, 0)
                        for r in found]
            drawn = ax.barh(ys, values, height, xerr=np.array(whiskers, dtype=float).T, capsize=2, label=label)
            labels = [ms_label(m) + (" unreliable" if bad else "") for m, bad in zip(values, doubtful)]
        fallback = ["" if r is None or r.get("kernel_ok", True) else f"  ! ran {r['kernel']}" for r in found]
        ax.bar_label(drawn, labels=[text + flag for text, flag in zip(labels, fallback)], padding=3, fontsize=7)
    ax.set_yticks(np.arange(len(groups)), groups)
    ax.invert_yaxis()  # the sweep's first implementation on top, as in the table
    if speedups:
        ax.axvline(1.0, color="grey", linewidth=0.8)  # manual itself
    ax.set_xlabel("speedup over manual (median of manual's ms / the row's, round by round)" if speedups
                  else "ms (median, IQR whiskers)")
    # linear from zero: a bar's length is its time (or speedup), so 2x reads as 2x; every bar carries its value
    ax.set_xlim(left=0, right=ax.get_xlim()[1] * 1.25)  # room for the value labels
    return title
