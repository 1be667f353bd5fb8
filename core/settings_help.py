"""
`--help` for every script: its docstring summary, how to start it, and each setting with its default, comment and
allowed values, grouped under the comment headers of the script's source (read with tokenize and ast).

    # I/O
      out_dir = 'out'                   checkpoint (ckpt.pt) and metrics.jsonl go here
"""

import ast
import io
import os
import sys
import textwrap
import tokenize
from pathlib import Path

HELP_WIDTH = 120  # help lines wrap here
NO_BREAK = "\xa0"  # joins the words of an [allowed values] bracket so that it wraps whole (textwrap keeps it one word)


def help_text(namespace: dict, defaults: dict, allowed: dict[str, str]) -> str:
    """The script's docstring summary, how to start it, then every setting as `name = default` with its comment and
    allowed values, under its group's header."""
    path = Path(namespace.get("__file__") or "")
    documented = _documented(path.read_text(encoding="utf-8")) if path.is_file() else {}
    order = [k for k in documented if k in defaults] + [k for k in defaults if k not in documented]
    rows = []
    for key in order:
        header, comment = documented.get(key, ("", ""))
        rows.append((header, f"{key} = {defaults[key]!r}", _described(comment, allowed.get(key))))
    summary = " ".join((namespace.get("__doc__") or "").strip().split("\n\n")[0].split())  # the first paragraph
    out = [*textwrap.wrap(summary, HELP_WIDTH), "", f"usage: {_command(path)} [CONFIG_FILE ...] [--key=value ...]",
           "The settings as this command line sets them (the defaults, unless config files or --key=value come "
           "before --help) and their [allowed values]; set them in a config file (Python assignments) or with "
           "--key=value."]
    column = min(36, max((len(setting) for _, setting, _ in rows), default=0) + 4)
    group = None
    for header, setting, text in rows:
        if header != group:
            out += ["", f"# {header}"] if header else [""]
            group = header
        lines = textwrap.wrap(text, HELP_WIDTH, initial_indent=f"  {setting}  ".ljust(column),
                              subsequent_indent=" " * column, break_on_hyphens=False, break_long_words=False)
        out += [line.replace(NO_BREAK, " ") for line in lines] or [f"  {setting}"]
    return "\n".join(out)


def _documented(source: str) -> dict[str, tuple[str, str]]:
    """Each top-level `name = value` of a script's source, in order: (its group's header, its comment). A header is a
    comment alone at the left margin; a setting's comment is the one beside it, continued on indented lines."""
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    assigned: dict[int, list[tuple[str, int]]] = {}
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        assigned.setdefault(node.lineno, []).extend((t.id, node.end_lineno) for t in targets if isinstance(t, ast.Name))
    found: dict[str, tuple[str, str]] = {}
    header, in_header, last = "", False, None  # last: the setting an indented comment line goes on describing
    for number, line in enumerate(source.splitlines(), 1):
        alone = number in comments and line.lstrip().startswith("#")
        if alone and not line[0].isspace():
            if comments[number].strip("-= "):  # not a ruler
                header = f"{header} {comments[number]}" if in_header else comments[number]
            in_header, last = bool(comments[number].strip("-= ")), None
            continue
        in_header = False
        if alone and last is not None:
            found[last] = (found[last][0], f"{found[last][1]} {comments[number]}".strip())
            continue
        last = None
        for name, end in assigned.get(number, []):
            if name not in found:
                found[name] = (header, next((comments[n] for n in range(number, end + 1) if n in comments), ""))
                last = name
    return found


def _described(comment: str, allowed: str | None) -> str:
    """A setting's comment, then its allowed values in brackets: [at least 1], [one of tanh, none]."""
    if allowed is None:
        return comment
    return f"{comment} [{allowed.replace(' ', NO_BREAK)}]".strip()


def print_help(namespace: dict, defaults: dict, allowed: dict[str, str]) -> None:
    """Print help_text() to stdout; a reader that stops early (python train.py --help | head) is no error."""
    try:
        print(help_text(namespace, defaults, allowed), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's own flush finds no pipe


def _command(path: Path) -> str:
    """How the script is started: `python train.py`, or `python -m benchmarks.time_to_loss` for a package's module."""
    root = Path(__file__).resolve().parent.parent
    try:
        relative = path.resolve().relative_to(root)
    except ValueError:
        return f"python {path}"
    if (path.resolve().parent / "__init__.py").is_file():
        return f"python -m {'.'.join(relative.with_suffix('').parts)}"
    return f"python {relative.as_posix()}"
