"""
attn='auto': time every implementation that can run this run's own attention (its shapes, dtype, mask, dropout,
compile; training or sampling), drop any whose output is off the reference, and pick the fastest. Decisions are
cached, keyed by everything measured.

    workload = Workload.of(model.config, rt, batch_size=12, seq_len=1024, training=True, compiled=True)
    decision = choose(workload, rt, IMPLEMENTATIONS)   # model.IMPLEMENTATIONS: the candidates
    model.set_attention(decision.pick, training=True, dtype=rt.torch_dtype)
"""

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from core.errors import UserError
from core import files, writing
from core.runtime import Runtime, compile_isolated, time_call
from attention.kernels import AttnCall, attention_pass, attention_problem, decodes_with_mask

FALLBACK = "sdpa"  # what runs when measuring fails: PyTorch's own choice
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 1e-2}  # max |y - ref| / max |ref| (fp32: TF32 on CUDA)
MAX_ROUNDS = 25


@dataclass(frozen=True)
class Workload:
    """Everything that decides which implementation is fastest, as measured: the decision cache's key."""
    device_name: str      # the CPU with its capability, or the GPU (Runtime.name)
    torch_version: str
    batch_size: int
    seq_len: int          # training: block_size; sample.py: the keys a decode step sees midway through its text
    block_size: int
    n_head: int
    head_size: int
    dtype: str            # what attention computes in (autocast's dtype, or the weights')
    documents: bool
    window: int
    dropout: float
    compiled: bool
    training: bool        # forward and backward; else a prefill and decode steps
    new_tokens: int = 0   # sampling: the decode steps timed with the prefill (at least one)

    @classmethod
    def of(cls, config, rt: Runtime, batch_size: int, seq_len: int, training: bool, compiled: bool,
           new_tokens: int = 0) -> "Workload":
        return cls(rt.name, torch.__version__, batch_size, seq_len, config.block_size, config.n_head,
                   config.head_size, rt.dtype, config.doc_mask, config.window,
                   config.dropout if training else 0.0, compiled, training, new_tokens)

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def describe(self) -> str:
        mask = " and ".join(["documents"] * self.documents + [f"window {self.window}"] * bool(self.window))
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        steps = f" ({self.new_tokens} decode steps)" if self.new_tokens else ""
        return (f"B={self.batch_size} T={self.seq_len} hs={self.head_size} {dtype}, {mask or 'causal'}"
                f"{', compiled' if self.compiled else ''}, {'training' if self.training else 'sampling'}{steps}")


@dataclass
class Decision:
    pick: str
    rows: list[dict]      # per implementation: attn, status (ok, refused, wrong, failed), ms, ratio, reason
    workload: Workload
    cached: bool = False
    seconds: float = 0.0  # spent measuring

    def line(self) -> str:
        """One console line: the ranking as ratios to the fastest, the workload, and where the answer came from."""
        ranked = sorted((r for r in self.rows if r["status"] == "ok"), key=lambda r: r["ms"])
        order = " < ".join(f"{r['attn']} ({r['ratio']:.2f})" for r in ranked) or f"nothing ran: {self.pick}"
        source = "cached" if self.cached else f"measured in {self.seconds:.1f} s"
        return f"attn=auto: {order}; {self.workload.describe()}; {source}"

    def metrics(self) -> dict:
        """The whole table, flat, for metrics.jsonl and wandb."""
        out = {"attn_auto/pick": self.pick, "attn_auto/cached": self.cached}
        for r in self.rows:
            out[f"attn_auto/{r['attn']}"] = r["ms"] if r["status"] == "ok" else r["status"]
        return out


# -- what is timed --------------------------------------------------------------------------------------------

def inputs(w: Workload, device: str, seed: int = 0) -> dict:
    """q, k, v at the run's shapes, (B, nh, T, hs), and documents (B, T) cut every block_size / 8 tokens when it has
    them (the real lengths are the data's, unknown here)."""
    g = torch.Generator().manual_seed(seed)
    shape = (w.batch_size, w.n_head, w.seq_len, w.head_size)
    q, k, v = (torch.randn(shape, generator=g).to(device, getattr(torch, w.dtype)) for _ in range(3))
    docs = (torch.arange(w.seq_len) // max(1, w.block_size // 8)).expand(w.batch_size, -1).to(device) \
        if w.documents else None
    return dict(q=q, k=k, v=v, docs=docs)


def attention_call(fn: Callable, layout: str, w: Workload, data: dict, takes_mask: bool = False
                   ) -> Callable[[], torch.Tensor]:
    """One timed call of `fn` (an implementation's, maybe compiled; `layout`: its mask's): forward and backward for
    training; for sampling a prefill and as many decode steps at position T as the text has new tokens, each handed
    what an eager decode step passes it (attention/masks.py's decode_step; `takes_mask`: whether it takes a mask row).
    Returns the prefill's or the forward's output."""
    q, k, v, docs = data["q"], data["k"], data["v"], data["docs"]
    mask = None
    if w.documents or w.window:
        from attention.masks import build_mask  # a masked run's
        mask = build_mask(layout, docs, w.window, w.batch_size, w.seq_len, q.device)
    if w.training:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        return attention_pass(fn, q, k, v, mask, w.dropout, backward=True)
    prefill = attention_pass(fn, q, k, v, mask, 0.0, backward=False)
    from attention.masks import decode_step
    B, nh, T, hs = k.shape
    cache = torch.zeros(2, B, nh, max(T, w.block_size), hs, dtype=k.dtype, device=k.device)  # k|v, a KV cache
    cache[0, :, :, :T], cache[1, :, :, :T] = k, v
    keys, row = decode_step(layout, T, w.window, max(T, w.block_size), takes_mask, q.device, q.dtype)
    decode = attention_pass(fn, q[:, :, -1:], cache[0, :, :, keys], cache[1, :, :, keys], row, 0.0, backward=False)

    def sample_step() -> torch.Tensor:
        y = prefill()
        for _ in range(max(1, w.new_tokens)):
            decode()
        return y
    return sample_step


def numerics_problem(output: torch.Tensor, data: dict, w: Workload, reference_fn: Callable) -> Optional[str]:
    """None if `output` is causal attention under the run's mask within the dtype's tolerance (against the plain
    math in float64), else why not."""
    q, k, v, docs = (data[n] for n in ("q", "k", "v", "docs"))
    dense = None  # causal
    if w.documents or w.window:
        from attention.masks import dense_mask
        dense = dense_mask(docs, w.window, w.seq_len, q.device)  # (1 or B, 1, T, T)
    reference = reference_fn(q.double(), k.double(), v.double(), dense, 0.0)  # the plain math: manual
    error = ((output.double() - reference).abs().max() / reference.abs().max()).item()
    if not error <= TOLERANCE[w.dtype]:  # NaN fails too
        return f"output differs from the reference by {error:.2g} of its largest value (tolerance {TOLERANCE[w.dtype]})"
    return None


# -- measuring and choosing -----------------------------------------------------------------------------------

def time_candidate(attn: str, call: Callable[[], object], rt: Runtime) -> float:
    """One timed call of candidate `attn`, its device work included."""
    return time_call(call, rt)[1]


def measure(w: Workload, rt: Runtime, implementations: dict, budget_s: float) -> Decision:
    """Time every implementation (model.IMPLEMENTATIONS) that can run `w`, round-robin within about budget_s seconds,
    drop the numerically wrong ones and pick the lowest median."""
    started = time.perf_counter()
    compiled = compile_isolated if w.compiled else (lambda fn: fn)
    data, rows, calls = inputs(w, rt.device), {}, {}
    for attn, fn in implementations.items():
        call = AttnCall(rt.device_type, getattr(torch, w.dtype), w.head_size, needs_grad=w.training,
                        dropout_p=w.dropout, seq_len=w.seq_len, masked=w.documents or bool(w.window))
        problem = attention_problem(attn, call, fn)
        rows[attn] = dict(attn=attn, status="refused" if problem else "ok", ms=None, ratio=None, reason=problem)
        if problem is None:
            takes_mask = not w.training and decodes_with_mask(attn, fn, rt.device_type, getattr(torch, w.dtype),
                                                              w.head_size)
            calls[attn] = attention_call(compiled(fn.fn), fn.mask, w, data, takes_mask)
    spent = {}
    for attn, call in list(calls.items()):  # warm-up (compiles) and the numerics check, untimed by the rounds
        try:
            output = call()
            t0 = time.perf_counter()
            call()  # warm: what a round will cost, for the budget
            spent[attn] = time.perf_counter() - t0
            wrong = numerics_problem(output, data, w, implementations["manual"]) if w.dropout == 0 else None
        except Exception as e:  # a kernel refusing at these shapes: not a candidate
            wrong = f"failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        if wrong is not None:
            rows[attn].update(status="wrong" if "differs" in wrong else "failed", reason=wrong)
            del calls[attn]
    # as many rounds as the budget left holds (by the warm-up's times), at least one and at most MAX_ROUNDS
    per_round = sum(spent.get(a, 0.0) for a in calls) or 1e-3
    rounds = max(1, min(MAX_ROUNDS, int((budget_s - (time.perf_counter() - started)) / per_round)))
    times = round_robin(list(calls), rounds, lambda attn: 1e3 * time_candidate(attn, calls[attn], rt))
    for attn, ms in times.items():
        rows[attn]["ms"] = sorted(ms)[len(ms) // 2]
    ran = [r for r in rows.values() if r["status"] == "ok"]
    if not ran:
        raise UserError(f"no attention implementation runs {w.describe()}: "
                        + "; ".join(f"{r['attn']}: {r['reason']}" for r in rows.values()))
    best = min(ran, key=lambda r: r["ms"])
    for r in ran:
        r["ratio"] = r["ms"] / best["ms"]
    return Decision(best["attn"], list(rows.values()), w, seconds=time.perf_counter() - started)


def is_decision(entry, implementations: dict) -> bool:
    """An entry of the decision cache as choose() writes it, naming an implementation this code has."""
    def row_ok(row) -> bool:  # every row names its status; one that ran, its timings (Decision.line reads them)
        timed = all(type(row.get(k)) in (int, float) for k in ("ms", "ratio")) if isinstance(row, dict) else False
        return isinstance(row, dict) and isinstance(row.get("attn"), str) and (row.get("status") != "ok" or timed)
    return (isinstance(entry, dict) and entry.get("pick") in implementations
            and isinstance(entry.get("rows"), list) and all(row_ok(row) for row in entry["rows"]))


def cache_file() -> Path:
    return files.cache_folder() / "attn_auto.json"


def choose(w: Workload, rt: Runtime, implementations: dict, budget_s: float = 20.0, refresh: bool = False) -> Decision:
    """The decision for `w`: from the cache when an earlier run measured this very workload (unless refresh), else
    measured now and added to the cache."""
    path = cache_file()
    known = files.read_cache(path, lambda entry: is_decision(entry, implementations), "decisions attn=auto wrote")
    if not refresh and w.key() in known:
        hit = known[w.key()]
        return Decision(hit["pick"], hit["rows"], w, cached=True)
    decision = measure(w, rt, implementations, budget_s)
    known[w.key()] = {"pick": decision.pick, "rows": decision.rows}
    writing.write_cache(path, known)
    return decision


def choose_across_ranks(w: Workload, rt: Runtime, implementations: dict, budget_s: float = 20.0,
                        refresh: bool = False) -> Decision:
    """choose() on rank 0 and its answer on every rank (all must run the same kernel); if measuring fails, one line
    and FALLBACK everywhere; a UserError stops every rank with the same error line."""
    decision, problem = None, None
    if rt.is_master:
        try:
            decision = choose(w, rt, implementations, budget_s, refresh)
        except UserError as e:
            problem = str(e)
        except Exception as e:
            print(f"attn=auto: measuring failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                  f"running {FALLBACK}")
            decision = Decision(FALLBACK, [], w)
    if rt.is_distributed:
        box = [decision, problem]
        torch.distributed.broadcast_object_list(box, src=0)
        decision, problem = box
    if problem is not None:
        raise UserError(problem)
    return decision


def choose_for_training(model, implementations: dict, cfg, rt: Runtime, saved: Optional[dict] = None) -> dict:
    """attn='auto' for train.py: this run's workload decided on rank 0, printed in one line, and returned as the table with
    the workload; a resume whose checkpoint decided the same workload runs the same implementation unmeasured."""
    w = Workload.of(model.config, rt, cfg.batch_size, cfg.block_size, training=not cfg.eval_only,
                    compiled=cfg.compile)
    saved = saved or {}  # a resume's decision (the checkpoint's attn_decision)
    if saved.get("attn_auto/workload") == w.key() and saved.get("attn_auto/pick") in implementations:
        if rt.is_master:
            print(f"attn=auto: {saved['attn_auto/pick']}, as the checkpoint decided for {w.describe()}")
        return {**saved, "attn_auto/cached": True}
    decision = choose_across_ranks(w, rt, implementations, cfg.attn_auto_budget, cfg.attn_auto_refresh)
    if rt.is_master and decision.rows:  # a fallback (no rows) printed its own line
        print(decision.line())
    return {**decision.metrics(), "attn_auto/workload": w.key()}


def choose_for_model(model, implementations: dict, training: bool = False, dtype: Optional[torch.dtype] = None,
                     batch_size: int = 1) -> str:
    """GPT.set_attention('auto'): the fastest implementation for `model` where it is, at its block_size, in `dtype`."""
    weight = model.lm_head.weight
    dtype_name = str(dtype or weight.dtype).removeprefix("torch.")
    rt = Runtime(str(weight.device), dtype_name)
    w = Workload.of(model.config, rt, batch_size, model.config.block_size, training=training, compiled=False)
    decision = choose(w, rt, implementations)
    print(decision.line())
    return decision.pick


def round_robin(keys: list, rounds: int, time_one: Callable[[object], Optional[float]],
                after_round: Optional[Callable[[dict], None]] = None) -> dict[object, list[float]]:
    """Round-robin timing (bench's rows, attn=auto's candidates): each round times every key once, starting one
    further along each time, so drift hits them alike. `time_one(key)` returns seconds, or None to drop the key."""
    times, dropped = {key: [] for key in keys}, set()
    for i in range(rounds):
        live = [key for key in times if key not in dropped]
        for key in live[i % len(live):] + live[:i % len(live)] if live else []:
            seconds = time_one(key)
            if seconds is None:
                dropped.add(key)
            else:
                times[key].append(seconds)
        if after_round is not None:
            after_round({key: v for key, v in times.items() if key not in dropped})
    return {key: v for key, v in times.items() if key not in dropped}
