"""Every combination a user can type: each script's settings drawn from its LIMITS (hypothesis) and run in process
through main(argv). Valid draws are each list setting's subsets and orders, each choice, each bool and small
in-range numbers, over a tiny model and tiny data; an invalid draw adds one of None, a wrong type, a number out of
range, an unknown key or an empty list. The property: exit 0, or exit 2 with exactly one `error:` line (an
invalid draw: exit 2); no other exception; nothing written outside the run's own out_dir. A fixed seed; a handful
of examples per script in the fast tier, many in the slow one. A failure names the smallest command line found."""

import contextlib
import io
import itertools
import json
import logging
import math
import random
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import bench
import export_hf
import sample
import train
from benchmarks import time_to_loss
from conftest import REPO
from model import IMPLEMENTATIONS
from core import errors
from core.configurator import _INTERVAL, PATH, Choice

FAST, SLOW = 2, 10  # random examples per script and tier; the slow tier adds every pair (PAIRS)


# -- drawing settings from LIMITS ----------------------------------------------------------------------------

def in_range(spec: str, default, small: int = 3):
    """Small numbers inside an interval spec: whole ones for whole settings, else floats."""
    left, lo, hi, right, whole, _ = _INTERVAL.match(spec).groups()
    lo, hi = float(lo), float(hi)
    if whole or isinstance(default, int) and not isinstance(default, bool):
        first = math.floor(lo) + 1 if left == "(" else math.ceil(lo)
        last = min(first + small, math.ceil(hi) - 1 if right == ")" and math.isfinite(hi) else hi)
        return st.integers(first, int(last))
    return st.floats(lo, min(hi, lo + 2.0), exclude_min=left == "(", exclude_max=right == ")" or hi > lo + 2.0,
                     allow_nan=False)


def valid_value(spec, default):
    if isinstance(spec, Choice):
        if spec.many:  # a subset, in any order
            return st.lists(st.sampled_from(spec.words), min_size=1, max_size=3, unique=True).map(",".join)
        return st.sampled_from(spec.words)
    if spec is None:
        return st.booleans()
    return in_range(spec, default)


def invalid_value(spec, default):
    """Something the setting cannot be: None (where None means nothing), a word for a number, a number out of its
    range, an empty list."""
    options = []
    if default is not None and not (isinstance(spec, str) and spec.endswith("or None")):
        options.append(st.just("None"))
    if isinstance(spec, Choice):
        options += [st.just("nonsense")] + ([st.just("")] if spec.many else [])
    elif spec == PATH:  # a name longer than a filesystem takes
        options.append(st.just("x" * 256))
    elif isinstance(spec, str):
        left, lo, hi, right, _, _ = _INTERVAL.match(spec).groups()
        options.append(st.just("abc"))
        if math.isfinite(float(lo)):
            options.append(st.just(str(float(lo) - 1)))
        if math.isfinite(float(hi)):
            options.append(st.just(str(float(hi) + 1)))
    elif isinstance(default, bool):
        options.append(st.just("maybe"))
    return st.one_of(options)


def command_lines(script, fuzzed: dict, base: list[str], always: tuple = ()):
    """argv = base + the `always` settings (the list settings, the main axes) + a few more of `fuzzed` ({key:
    strategy}), and maybe one invalid setting or an unknown key. Draws (argv, whether it is valid)."""
    @st.composite
    def draw(data):
        keys = list(always) + data(st.lists(st.sampled_from(sorted(set(fuzzed) - set(always))), max_size=6,
                                            unique=True))
        args = [f"--{k}={data(fuzzed[k])}" for k in keys]
        bad = data(st.sampled_from(["none", "setting", "unknown"]))
        if bad == "setting":
            key = data(st.sampled_from(sorted(set(script.LIMITS) | {k for k, v in vars(script).items()
                                                                      if isinstance(v, bool) and k[0].islower()})))
            args.append(f"--{key}={data(invalid_value(script.LIMITS.get(key), getattr(script, key)))}")
        elif bad == "unknown":
            args.append("--no_such_setting=1")
        return base + args, bad == "none"
    return draw()


def limits_strategies(script, sizes: dict, skip: set) -> dict:
    """Each of the script's LIMITS and bools drawn as valid_value does, `sizes` overriding (tiny sizes), `skip`
    left out (slow or outside a test: compile, a device, a dataset to download)."""
    keys = [k for k in script.LIMITS] + [k for k, v in vars(script).items()
                                         if isinstance(v, bool) and k[0].islower() and k not in script.LIMITS]
    return {k: sizes.get(k, valid_value(script.LIMITS.get(k), getattr(script, k))) for k in keys
            if k not in skip and script.LIMITS.get(k) != PATH}  # paths: the test's own folders


# -- running one command line -------------------------------------------------------------------------------

def snapshot(*roots: Path, skip: Path) -> dict:
    found = {}
    for root in roots:
        for path in root.rglob("*"):
            if skip in path.parents or path == skip or ".git" in path.parts or "__pycache__" in path.parts or \
                    ".pytest_cache" in path.parts or ".hypothesis" in path.parts:
                continue
            if path.is_file():
                found[path] = path.stat().st_mtime_ns
    return found


# Where a script could write besides the out_dir it is given: its default out_dirs and the data folders (the
# checkout's other files may change while the test runs, from the user's own runs in the same checkout)
DEFAULT_WRITES = [REPO / "out", REPO / "bench_results", REPO / "data"]


def holds(main, argv: list[str], valid: bool, out: Path, watch: Path, say=note) -> None:
    """The property, for one command line; a failure's report is the command line and its output (`say`:
    hypothesis's note inside a drawn example, nothing in an enumerated one, whose assertions carry both)."""
    line = " ".join(argv)
    say(f"command line: {line}")
    before = snapshot(*DEFAULT_WRITES, watch, skip=out)
    err, threads = io.StringIO(), torch.get_num_threads()
    logging.disable(logging.INFO)  # torch's debug and info records: not the command's output
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = errors.exit_code(lambda: main(argv))
    finally:
        logging.disable(logging.NOTSET)
        torch.set_num_threads(threads)
    lines = [text for text in err.getvalue().splitlines() if text.startswith("error:")]
    said = f"exit {code}; stderr: {err.getvalue()[-600:]}"
    say(said)
    assert code in (0, 2) and (code == 0 or len(lines) == 1), f"{line}\n{said}"
    assert valid or code == 2, f"an invalid setting was not refused: {line}"
    after = snapshot(*DEFAULT_WRITES, watch, skip=out)
    changed = sorted(str(p) for p in set(after) ^ set(before) | {p for p in after if before.get(p) != after[p]})
    assert not changed, f"{line}\nwrote outside the run's out_dir: {changed}"


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def explore(script, examples: int, fuzzed: dict, base, always: tuple = (), watch: Path = None) -> None:
    """`examples` command lines of `script`: base(out) + drawn settings, each run with an out_dir of its own; the
    property held for each (`watch`: a folder besides the repository that nothing may be written to)."""
    @fuzz(examples)
    @given(st.data())
    def run(data):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            argv, valid = data.draw(command_lines(script, fuzzed, base(out), always))
            holds(script.main, argv, valid, out, watch or Path(tmp))
    run()


# -- the scripts ------------------------------------------------------------------------------------------------

TRAIN_SIZES = {
    "n_layer": st.integers(1, 2), "n_head": st.sampled_from([1, 2]), "n_embd": st.sampled_from([16, 32]),
    "block_size": st.sampled_from([16, 32]), "batch_size": st.integers(1, 3), "max_iters": st.integers(0, 2),
    "eval_iters": st.integers(1, 2), "eval_interval": st.integers(1, 3), "log_interval": st.integers(1, 3),
    "gradient_accumulation_steps": st.integers(1, 3), "window": st.integers(0, 8), "warmup_iters": st.integers(0, 3),
    "lr_decay_iters": st.integers(0, 5), "early_decay_iters": st.integers(0, 5), "keep_checkpoints": st.integers(1, 2),
    "max_seconds": st.sampled_from([0.0, 0.05]), "attn_auto_budget": st.sampled_from([0.05, 0.2]),
    "learning_rate": st.sampled_from([1e-3, 3e-3]), "muon_lr": st.sampled_from([1e-2, 2e-2]),
    "dtype": st.sampled_from(["auto", "float32", "bfloat16"]),
}
TRAIN_SKIP = {"compile", "wandb_log", "eval_only", "overwrite", "attn_auto_refresh"}


def tiny_train(data: Path, out: Path) -> list[str]:
    return ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2", "--compile=False",
            "--device=cpu", "--dtype=float32", "--gradient_accumulation_steps=1", "--eval_iters=1", "--max_iters=2",
            "--eval_interval=2", "--warmup_iters=1", "--lr_decay_iters=4", f"--data_dir={data}", f"--out_dir={out}"]


@pytest.fixture(scope="module")
def char_documents(char_data_session, tmp_path_factory) -> Path:
    """The tiny character data with its newline as the end-of-text token: doc_mask trains on it."""
    folder = tmp_path_factory.mktemp("documents")
    for name in ("train.bin", "val.bin"):
        shutil.copyfile(char_data_session / name, folder / name)
    meta = json.loads((char_data_session / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "eot_token": meta["chars"].index("\n")}))
    return folder


@pytest.fixture(scope="module")
def checkpoint(char_data_session, tmp_path_factory) -> Path:
    """A tiny trained run, for the scripts that read one (sample.py, export_hf.py)."""
    out = tmp_path_factory.mktemp("fuzz_run")
    assert train.main(tiny_train(char_data_session, out)) == 0
    return out


def check_train(char_data_session, examples):
    explore(train, examples, limits_strategies(train, TRAIN_SIZES, TRAIN_SKIP),
            lambda out: tiny_train(char_data_session, out), ("attn", "optimizer"), char_data_session)


SAMPLE_SIZES = {"num_samples": st.integers(1, 2), "max_new_tokens": st.integers(1, 4),
                "top_k": st.sampled_from([1, 5, None]), "attn_auto_budget": st.sampled_from([0.05, 0.2]),
                "dtype": st.sampled_from(["auto", "float32", "bfloat16"]),
                "compare": st.sampled_from(["", "all", "manual,sdpa", "sdpa,manual", "flash"])}


def check_sample(checkpoint, examples):
    fuzzed = {**limits_strategies(sample, SAMPLE_SIZES, {"compile", "attn_auto_refresh"}),
              "compare": SAMPLE_SIZES["compare"]}
    explore(sample, examples, fuzzed, lambda out: [f"--out_dir={checkpoint}", "--device=cpu", "--max_new_tokens=3",
                                                   "--num_samples=1", f"--json={out / 'compare.json'}"],
            ("attn", "compare"), checkpoint)


BENCH_SIZES = {
    "n_layer": st.just(1), "n_head": st.sampled_from([1, 2]), "n_embd": st.sampled_from([16, 32]),
    "vocab_size": st.sampled_from([61, 64]), "batch_size": st.integers(1, 2), "seq_len": st.sampled_from([16, 32]),
    "iters": st.integers(1, 2), "warmup": st.integers(0, 1), "attn_batch": st.just(1), "attn_heads": st.integers(1, 2),
    "window": st.sampled_from([4, 8]), "doc_len": st.sampled_from([4, 8]), "new_tokens": st.integers(1, 3),
    "prompt_len": st.integers(1, 3), "gen_batch": st.integers(1, 2), "threads": st.just(1),
    "max_batch_limit": st.integers(1, 3), "mem_budget_gb": st.just(0.5), "attn_auto_budget": st.just(0.05),
    "dtype": st.sampled_from(["auto", "float32", "bfloat16"]),
    "cache": st.lists(st.sampled_from(["none", "cache"]), min_size=1, unique=True).map(",".join),  # compiled: ~10 s
}
BENCH_SKIP = {"compile", "attn_auto_refresh", "mode"}


BENCH_BASE = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--vocab_size=61", "--seq_len=32", "--batch_size=1",
              "--iters=1", "--warmup=0", "--threads=1", "--attn_seq_lens=16,32", "--attn_head_sizes=16",
              "--attn_batch=1", "--attn_heads=2", "--new_tokens=2", "--doc_len=8", "--weights=float32",
              "--cache=none,cache", "--attn_auto_budget=0.05", "--device=cpu"]


def check_bench(mode, examples):
    base = BENCH_BASE
    lists = {"train": ("attn", "padding", "mask", "loss"), "attention": ("attn", "mask"),
             "generate": ("attn", "padding", "weights", "cache")}[mode]
    explore(bench, examples, limits_strategies(bench, BENCH_SIZES, BENCH_SKIP),
            lambda out: [f"--mode={mode}", *base, f"--out_dir={out}"], lists)


def check_export(checkpoint, examples):
    explore(export_hf, examples, {"temperature": st.sampled_from([0.0, 0.8]), "top_k": st.sampled_from([1, 200])},
            lambda out: [f"--out_dir={checkpoint}", f"--hf_dir={out / 'hf'}"], (), checkpoint)


# time_to_loss launches train.py: here a stand-in that logs a falling val loss for whatever it is given
FAKE_TRAIN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    out = Path(args["out_dir"])
    out.mkdir(parents=True)
    with open(out / "metrics.jsonl", "w") as f:
        for i, loss in enumerate([3.0, 2.0, 1.5]):
            f.write(json.dumps({"iter": 10 * i, "val/loss": loss}) + "\\n")
""")


def check_time_to_loss(monkeypatch, examples):
    root = Path(tempfile.mkdtemp())
    (root / "train.py").write_text(FAKE_TRAIN)
    monkeypatch.setattr(time_to_loss, "ROOT", root)
    monkeypatch.setattr(time_to_loss, "prepare_data", lambda recipes: None)
    monkeypatch.setattr(time_to_loss, "POLL_S", 0.01)
    extra = st.lists(st.sampled_from(["--max_iters=2", "--dropout=0.0", "--n_layer=1", "--attn=manual"]),
                     max_size=2).map(" ".join)

    fuzzed = {"compare": st.sampled_from(["quickstart", "doc_mask", "attn", "gpu"]),
              "target": st.sampled_from([1.0, 2.5]), "runs": st.integers(1, 2), "full": st.booleans(), "extra": extra}
    explore(time_to_loss, examples, fuzzed, lambda out: [f"--out_dir={out}"])


# -- every pair, by enumeration (the slow tier) ------------------------------------------------------------

def covering_rows(axes: dict[str, list], lists: tuple = (), most: int = 3) -> list[dict[str, list]]:
    """Rows of settings in which every two values of one list setting (`lists`, up to `most` values a row) share a
    row, and every value of each axis shares a row with every value of every other: random draws leave pairs out.
    Greedy: a pair still missing seeds each row, then each axis takes what covers most of what is missing."""
    missing = {frozenset({(a, v), (b, w)}) for a, b in itertools.combinations(axes, 2) for v in axes[a] for w in axes[b]}
    missing |= {frozenset({(a, v), (a, w)}) for a in lists for v, w in itertools.combinations(axes[a], 2)}
    rows = []
    while missing:
        chosen = set(min(missing, key=lambda pair: sorted(map(str, pair))))
        for a in axes:
            for _ in range((most if a in lists else 1) - sum(1 for b, _ in chosen if b == a)):
                def gain(v):
                    return sum(1 for pair in missing if (a, v) in pair and pair <= chosen | {(a, v)})
                left = [v for v in axes[a] if (a, v) not in chosen]
                best = max(left, key=gain, default=None)
                if best is None or (any(b == a for b, _ in chosen) and gain(best) == 0):
                    break
                chosen.add((a, best))
        missing = {pair for pair in missing if not pair <= chosen}
        rows.append({a: [v for b, v in sorted(chosen, key=str) if b == a] for a in axes})
    return rows


DTYPES = ["auto", "float32", "bfloat16", "float16"]
MASK_SETTINGS = {"none": [], "window": ["--window=8"], "doc_mask": ["--doc_mask=True"]}  # train's masks, as typed


def pairs_of(script: str) -> tuple[dict, tuple]:
    """A script's axes (its list settings and main choices, each value) and which of them are lists."""
    words = lambda spec: list(spec.words)  # noqa: E731
    if script == "train":
        return dict(attn=words(train.LIMITS["attn"]), optimizer=words(train.LIMITS["optimizer"]), dtype=DTYPES,
                    masks=list(MASK_SETTINGS), checkpoint_format=words(train.LIMITS["checkpoint_format"])), ()
    if script == "sample --compare":  # "all" stands alone (the random draws type it): the names pair up
        return dict(attn=words(sample.LIMITS["attn"]), compare=list(IMPLEMENTATIONS), dtype=DTYPES), ("compare",)
    mode = script.split()[-1]
    lists = {"train": ("attn", "mask", "loss", "padding"), "attention": ("attn", "mask"),
             "generate": ("attn", "padding", "weights", "cache")}[mode]
    axes = {k: [w for w in words(bench.LIMITS[k]) if w != "all"] for k in lists}
    if "cache" in axes:
        axes["cache"] = ["none", "cache"]  # compiled: ~10 s a row, its pairs are the whole suite's GPU and CPU tests
    return {**axes, "dtype": DTYPES}, lists


def argv_of(row: dict) -> list[str]:
    return [arg for key, values in row.items() for arg in (
        MASK_SETTINGS[values[0]] if key == "masks" else [f"--{key}={','.join(values)}"])]


def enumerate_pairs(script: str, request) -> None:
    """Every row of covering_rows for `script`, each through the property."""
    fixture = request.getfixturevalue
    axes, lists = pairs_of(script)
    if script == "train":
        main, watch = "train", fixture("char_documents")
        base = lambda out: [*tiny_train(watch, out), "--attn_auto_budget=0.05"]  # noqa: E731
    elif script == "sample --compare":
        main, watch = "sample", fixture("checkpoint")
        base = lambda out: [f"--out_dir={watch}", "--device=cpu", "--max_new_tokens=2",  # noqa: E731
                            "--num_samples=1", "--attn_auto_budget=0.05", f"--json={out / 'compare.json'}"]
    else:
        main, watch = "bench", None
        base = lambda out: [f"--mode={script.split()[-1]}", *BENCH_BASE, f"--out_dir={out}"]  # noqa: E731
    for row in covering_rows(axes, lists):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            module = {"train": train, "sample": sample, "bench": bench}[main]
            holds(module.main, base(out) + argv_of(row), True, out, watch or Path(tmp), say=lambda text: None)


# -- the test: a handful per script in the fast tier, many in the slow one -------------------------------

SCRIPTS = ["train", "sample --compare", "bench train", "bench attention", "bench generate", "export_hf",
           "time_to_loss --extra"]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("examples", [FAST, pytest.param(SLOW, marks=pytest.mark.slow)])
def test_every_combination_of_a_scripts_settings_ends_in_its_output_or_one_sentence(script, examples, request):
    fixture = request.getfixturevalue
    {"train": lambda: check_train(fixture("char_data_session"), examples),
     "sample --compare": lambda: check_sample(fixture("checkpoint"), examples),
     "export_hf": lambda: check_export(fixture("checkpoint"), examples),
     "time_to_loss --extra": lambda: check_time_to_loss(fixture("monkeypatch"), examples),
     }.get(script, lambda: check_bench(script.split()[-1], examples))()


@pytest.mark.slow
def test_the_property_finds_a_crash_planted_in_a_combination(char_data_session, monkeypatch, request):
    """It can fail: bench's auto row for a pick an --attn list left out, without its vocab column (the crash the
    random draws found first), and a training step that breaks under Muon alone (the pairs find it)."""
    from benchmarks import bench_train
    real_rows, real_step = bench_train.auto_rows, train.Trainer.step

    def rows_without_vocab(*args):
        return [{k: v for k, v in row.items() if k != "vocab" or row["status"] == "ok"} for row in real_rows(*args)]
    monkeypatch.setattr(bench, "auto_rows", rows_without_vocab)
    with pytest.raises(Exception, match="vocab"):
        check_bench("train", 30)

    def breaks_under_muon(self, batches):
        if len(self.optimizers) > 1:
            raise RuntimeError("planted")
        return real_step(self, batches)
    monkeypatch.setattr(train.Trainer, "step", breaks_under_muon)
    with pytest.raises(Exception, match="planted"):
        enumerate_pairs("train", request)


PAIRED = ["train", "sample --compare", "bench train", "bench attention", "bench generate"]


@pytest.mark.slow
@pytest.mark.parametrize("script", PAIRED)
def test_every_pair_of_values_a_user_can_type_ends_in_its_output_or_one_sentence(script, request):
    enumerate_pairs(script, request)


def test_the_rows_cover_every_pair_of_a_list_and_every_value_of_each_axis_with_every_other():
    """The enumeration's own promise, checked apart from the greedy that makes it."""
    for script in PAIRED:
        axes, lists = pairs_of(script)
        rows = covering_rows(axes, lists)
        seen = {frozenset({(a, v), (b, w)}) for row in rows for a, b in itertools.combinations_with_replacement(row, 2)
                for v in row[a] for w in row[b] if (a, v) != (b, w)}
        needed = {frozenset({(a, v), (b, w)}) for a, b in itertools.combinations(axes, 2) for v in axes[a]
                  for w in axes[b]} | {frozenset({(a, v), (a, w)}) for a in lists
                                       for v, w in itertools.combinations(axes[a], 2)}
        assert needed <= seen, script
        assert all(len(row[a]) == 1 for row in rows for a in axes if a not in lists)


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in PAIRED if pairs_of(s)[1]])
def test_the_pairs_find_a_crash_planted_in_a_pair_they_were_not_told(script, request, monkeypatch):
    """A crash planted in the script's main that fires only when one list setting names two values together,
    the setting and the pair drawn at random (seeded): the enumeration finds it."""
    axes, lists = pairs_of(script)
    draw = random.Random(f"planted {script}")
    key = draw.choice(lists)
    pair = set(draw.sample(axes[key], 2))
    module = {"sample": sample, "train": train}.get(script.split()[0], bench)
    real = module.main

    def planted(argv):
        given = [a.split("=", 1)[1].split(",") for a in argv if a.startswith(f"--{key}=")]
        if given and pair <= set(given[-1]):
            raise RuntimeError(f"planted: --{key} with {sorted(pair)}")
        return real(argv)
    monkeypatch.setattr(module, "main", planted)
    with pytest.raises(Exception, match="planted"):
        enumerate_pairs(script, request)
