"""
Settings for every script: module globals with a comment each, LIMITS for the allowed numbers and words, then
`cfg = configure(globals(), argv, LIMITS)`. Config files (Python assignments) apply in order, then --key=value
overrides (read with ast.literal_eval; a bare word stays a string); --help prints every setting (settings_help.py).

    python train.py config/train_shakespeare_char.py --batch_size=32 --attn=flash
"""

import ast
import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from core.errors import UserError, refuse_all

PLAIN_TYPES = (bool, int, float, str, tuple, list, type(None))


def settings(namespace: dict) -> dict:
    """The script's settings: public lower-case module globals holding plain values (UPPER_CASE names are
    constants, and modules, functions and classes are not settings)."""
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not k.isupper() and isinstance(v, PLAIN_TYPES)}


def assigned(scope: dict) -> dict:
    """What a config file assigns: every public lower-case name but modules, functions and classes, a Path as its
    text (what a user means by out_dir = Path("runs") / "a"); any other value is kept for coerce to name."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in scope.items() if not k.startswith("_")
            and not k.isupper() and not callable(v) and not isinstance(v, type(ast))}


def coerce(key: str, value, default, current):
    """`value` as the type of `default`: an int is a fine float, anything goes for a None default. `current`: the
    value so far (a config file's, else the default), what an error line shows."""
    if value is not None and not isinstance(value, PLAIN_TYPES[:-1]):  # a dict, a set, an object
        raise UserError(f"{key} takes a plain value (a number, a word, a list), got {value!r} "
                        f"({type(value).__name__}).")
    if default is None or value is None or type(value) is type(default):
        return value
    if isinstance(default, float) and type(value) is int:
        return float(value)
    if isinstance(default, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(default)(value)
    kind = type(default).__name__
    raise UserError(f"{key} expects {'an' if kind[0] in 'aeiou' else 'a'} {kind} (like {current!r}), "
                    f"got {value!r} ({type(value).__name__}).")


SAME_MEANING = (("block_size", "seq_len"),)  # one quantity under two scripts' names: train's and bench's


def _check_key(key: str, known: dict) -> None:
    if key not in known:
        close = [name for pair in SAME_MEANING if key in pair for name in pair if name != key and name in known] or \
            difflib.get_close_matches(key, list(known), n=3, cutoff=0.6) or [  # or its initials: lr, wd
                name for name in known if "".join(word[0] for word in name.split("_")) == key and len(key) > 1]
        hint = f"; did you mean {' or '.join(close)}?" if close else "; --help lists the settings."
        raise UserError(f"unknown setting '{key}'{hint}")


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # e.g. --attn=flash or --out_dir=out/run-1


# an interval, then "int" (whole numbers only) and "or None" (None too, though the default is not None)
_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])(\s+int)?(\s+or None)?$")


def interval_text(spec: str) -> str:
    """'[1, inf)' -> 'at least 1', '(0, inf)' -> 'greater than 0', '[0, 1)' -> 'at least 0 and less than 1';
    '[1, inf) int or None' -> 'a whole number at least 1, or None'."""
    left, lo, hi, right, whole, none = _INTERVAL.match(spec).groups()

    def number(text: str) -> str:  # whole bounds as written out: 9223372036854775808 is 2**63, never 9.22337e+18
        value = float(text)
        return f"2**{int(value).bit_length() - 1}" if value == 2 ** 63 else f"{int(value):,}" if value.is_integer() \
            else f"{value:g}"
    words = [f"{'at least' if left == '[' else 'greater than'} {number(lo)}"] if float(lo) > -math.inf else []
    words += [f"{'at most' if right == ']' else 'less than'} {number(hi)}"] if float(hi) < math.inf else []
    text = ("a whole number " if whole else "") + " and ".join(words)
    return text + (", or None" if none else "")


def none_allowed(spec) -> bool:
    return isinstance(spec, str) and spec.endswith(" or None")


def allowed_text(spec) -> str:
    """A LIMITS entry in words: 'at least 1', 'greater than 0 and less than 1', 'one of tanh, none'."""
    if isinstance(spec, Choice):
        return f"{spec.text()} {', '.join(word or repr(word) for word in spec.words)}"
    if spec == PATH:
        return "a path, each name at most 255 bytes"
    return interval_text(spec) or "any number"


@dataclass(frozen=True)
class Choice:
    """The words a setting may hold: one of them, or (`many`) a comma list of them."""
    words: tuple[str, ...]
    many: bool = False

    def check(self, key: str, value) -> None:
        given = as_list(value) if self.many else [value]
        if not given or any(word not in self.words for word in given):
            raise UserError(f"{key} must be {self.text()} {', '.join(map(repr, self.words))}, got {value!r}"
                            f"{self.suggestion(given)}")

    def text(self) -> str:
        return "a comma list of" if self.many else "one of"

    def suggestion(self, given: list) -> str:
        """'; did you mean 'flash'?' when every word not allowed is close to one that is, else the words that are
        not ('; 'foo' is not one of them.')."""
        fixed = [word if word in self.words else next(iter(difflib.get_close_matches(str(word), self.words, n=1)),
                                                      None) for word in given]
        if None in fixed:
            unknown = [repr(word) for word, close in zip(given, fixed) if close is None]
            return f"; {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not one of them." if self.many \
                else "."
        return f"; did you mean {','.join(fixed)!r}?" if fixed else "."


def one_of(*words: str) -> Choice:
    return Choice(tuple(words))


def comma_list_of(*words: str) -> Choice:
    return Choice(tuple(words), many=True)


SEED = "[0, 9223372036854775808) int"  # a LIMITS entry: seeds below 2**63 (torch's generators take up to 2**64 - 1;
                                        # numpy's and JSON readers' signed 64-bit integers do not)
PATH = "a path"  # a LIMITS entry: a file or folder name, each part short enough for the filesystem
NAME_MAX = 255    # bytes in one file or folder name on Linux and macOS filesystems


def check_path(key: str, value: str) -> None:
    long = next((part for part in str(value).split("/") if len(part.encode()) > NAME_MAX), None)
    if long is not None:
        raise UserError(f"{key} has a name of {len(long.encode())} bytes ({long[:20]}...), more than the {NAME_MAX} a "
                        f"file or folder name may have; pass --{key}= a shorter one.")


def check_limits(values: dict, limits: dict, defaults: dict) -> dict[str, UserError]:
    """Each setting outside its interval or among no allowed words, with its problem (every one, not the first); None
    passes where the default is None or LIMITS says "or None". A numeric setting without an interval is a bug."""
    undeclared = [k for k, v in defaults.items() if type(v) in (int, float) and k not in limits]
    if undeclared:
        raise RuntimeError(f"no LIMITS entry for numeric setting(s) {', '.join(undeclared)}")
    problems = {}
    for key, value in values.items():  # None means "pick for me" only where the default is None or LIMITS says so
        if value is None and defaults.get(key) is not None and not none_allowed(limits.get(key)):
            kind = type(defaults[key]).__name__
            problems[key] = UserError(f"{key} cannot be None; pass --{key}= {'an' if kind[0] in 'aeiou' else 'a'} "
                                      f"{kind} like its default, {defaults[key]!r}, or leave it out.")
    for key, spec in limits.items():
        value = values.get(key)
        if value is None or key in problems:
            continue
        try:
            check_one(key, value, spec)
        except UserError as e:
            problems[key] = e
    return problems


def check_one(key: str, value, spec) -> None:
    """One setting against its LIMITS entry: a path, a choice of words, or an interval."""
    if spec == PATH:
        return check_path(key, value)
    if isinstance(spec, Choice):
        return spec.check(key, value)
    if type(value) not in (int, float):
        raise UserError(f"{key} must be a number, got {value!r}.")
    match = _INTERVAL.match(spec)
    left, lo, hi, right, whole, _ = match.groups()
    if not math.isfinite(value):  # inf passes a bound of inf's side: it is named as what it is
        raise UserError(f"{key} must be a finite number, got {value!r}; pass --{key}= a value in "
                        f"{spec[:match.end(4)]}.")
    if whole and type(value) is not int:
        raise UserError(f"{key} must be a whole number, got {value!r}; pass --{key}= an integer in "
                        f"{spec[:match.end(4)]}.")
    lo, hi = float(lo), float(hi)
    lo_ok = lo <= value if left == "[" else lo < value
    hi_ok = value <= hi if right == "]" else value < hi
    if not (lo_ok and hi_ok):  # written so that NaN fails too
        raise UserError(f"{key} must be {interval_text(spec)}, got {value!r}; "
                        f"pass --{key}= a value in {spec[:match.end(4)]}.")


class Settings(SimpleNamespace):
    """A script's settings, read as attributes: cfg.batch_size; `set_by`: where each setting not left at its default
    was set ("the command line", or a config file's path)."""

    def __init__(self, set_by: dict | None = None, **values):
        super().__init__(**values)
        object.__setattr__(self, "_set_by", dict(set_by or {}))

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "_set_by"}

    @property
    def set_by(self) -> dict:
        return dict(self._set_by)

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"


def closest_config(path: Path) -> str:
    """The next step for a config file that is not there: the closest name in its folder, else what is there."""
    folder = path.parent if path.parent != Path(".") and path.parent.is_dir() else Path("config")
    there = sorted(p.name for p in folder.glob("*.py")) if folder.is_dir() else []
    close = difflib.get_close_matches(path.name, there, n=1, cutoff=0.6)
    if close:
        return f"did you mean {folder / close[0]}?"
    if there:
        return f"pass the path of an existing one ({folder}/ holds {', '.join(there)})."
    return "pass the path of an existing config file, like config/train_shakespeare_char.py."


def configure(namespace: dict, argv: list[str], limits: dict | None = None,
              problems: dict | None = None) -> Settings:
    """A script's settings: the plain globals of `namespace` (left untouched, so main() can run again), with config
    files and --key=value overrides applied and checked against `limits`: every setting out of range is one error
    together, or, given a `problems` dict, added to it for the caller's start-up checks. --help prints them and
    exits 0."""
    if "--help" in argv or "-h" in argv:
        from core import settings_help  # only when asked for: the scripts' start-up does not carry it
        allowed = {key: allowed_text(spec) for key, spec in (limits or {}).items()}
        try:
            values = configure(namespace, [a for a in argv if a not in ("--help", "-h")], limits).as_dict()
        except UserError:
            values = settings(namespace)
        settings_help.print_help(namespace, values, allowed)
        raise SystemExit(0)
    namespace = dict(namespace)
    defaults = settings(namespace)  # types are checked against these, whatever a config file set before
    set_by = {}  # key -> where it was set last
    found: dict = {}  # every problem, by the setting (or argument) it is about: the range checks add theirs

    def apply(key: str, value, where: str) -> None:
        try:
            _check_key(key, defaults)
            namespace[key] = coerce(key, value, defaults[key], namespace[key])
            set_by[key] = where
        except UserError as e:  # a config file's line names the file, and how to keep a helper variable
            helper = " (a helper variable? start its name with _)" if key not in defaults else ""
            found.setdefault(key, e if where == "the command line" else UserError(f"{where}: {e}{helper}"))
    for arg in argv:
        try:
            scope = read_argument(arg, defaults)
        except UserError as e:
            found.setdefault(arg.lstrip("-").partition("=")[0] or arg, e)
            continue
        for key, value in scope.items():
            apply(key, value, "the command line" if arg.startswith("--") else arg)
    values = settings({k: namespace[k] for k in defaults})
    if limits is not None:
        found.update({k: e for k, e in check_limits(values, limits, defaults).items() if k not in found})
    if problems is None:
        refuse_all(list(found.values()))
    else:
        problems.update(found)
    return Settings(set_by, **values)


def read_argument(arg: str, defaults: dict) -> dict:
    """The settings one argument gives: {key: value} for --key=value, or a config file's plain assignments."""
    if arg.startswith("--"):
        key, sep, text = arg[2:].partition("=")
        if not sep:
            raise UserError(f"'{arg}' has no value; write --{key}=VALUE.")
        value = _parse_value(text)
        if isinstance(defaults.get(key), str) and isinstance(value, (int, float)):  # --start=2024 is the text "2024"
            value = text
        return {key: value}
    path = Path(arg)
    key, _, text = arg.lstrip("-").partition("=")
    meant = [key] if key in defaults else difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.6)
    if not path.is_file() and "=" in arg and meant:  # a setting typed without its dashes
        raise UserError(f"'{arg}' is not a config file; a setting takes two dashes: pass --{meant[0]}={text}.")
    if not path.is_file():
        raise UserError(f"config file '{arg}' not found; {closest_config(path)}")
    if path.suffix != ".py":
        raise UserError(f"config file '{arg}' is not a Python file: a config file is Python assignments, as "
                        f"nanoGPT's (batch_size = 32), in a .py file; write it as one, or pass --key=value.")
    scope: dict = {}
    try:
        exec(compile(path.read_text(), str(path), "exec"), scope)
    except SystemExit:
        raise UserError(f"config file '{arg}' calls sys.exit(), and nothing ran; a config file only assigns "
                        f"settings - remove the exit.") from None
    except Exception as e:
        raise UserError(f"config file '{arg}' failed to run: {type(e).__name__}: {e}.") from None
    return assigned(scope)


def as_list(value, cast=str) -> list:
    """A comma list from the command line: 'a,b', (512, 1024) (what --x=512,1024 parses to) or one value."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    try:
        return [cast(str(item).strip()) for item in items if str(item).strip()]
    except ValueError:
        raise UserError(f"cannot read {value!r} as a comma-separated list of {cast.__name__}.") from None
