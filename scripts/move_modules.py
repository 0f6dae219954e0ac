#!/usr/bin/env python3
"""Pure module moves (issue 40 items 3 and 5): `git mv` each module, then rewrite every name that points at it.

Why a script and not commits: several branches change toolkit/train/ at once; a move committed on one of them turns
every merge into a conflict. The lead runs this once, last, on the merged tree, and commits the result as one
commit that changes no behaviour (the suite is the proof).

Usage (from the repository's top, on a clean work tree; `.venv` made by scripts/install.sh):

    .venv/bin/python scripts/move_modules.py            # moves, rewrites, sorts the touched imports (ruff I)
    .venv/bin/python scripts/move_modules.py --check    # exit 1 and list what still names an old module

Idempotent: a move already made is skipped, and a second run changes nothing. It refuses (one line, nothing done)
when both the old and the new file exist, when neither does, or when the work tree has uncommitted changes (unless
--allow-dirty).

What it rewrites, in every file git tracks (.py, .md, .txt, .toml, .yml, .yaml, .ini, .cfg, .sh, .j2):
- dotted names, in code, strings, docstrings and docs: `toolkit.train.checkpoint` -> `toolkit.train.ckpt.manager`,
  and their tails of two or more parts (`jobhosts.stopping.stop_job`), except a tail that reads as a file name
  (`agent.log` is the agent's log file, not the module);
- paths: `toolkit/train/checkpoint.py`, `train/checkpoint.py`, and a bare `ckptparts.py` where that file name is
  the repository's only one; a path that starts a fixed-width table row keeps the row's columns;
- `from toolkit.train import checkpoint, log` (any layout, aliases kept): the moved names are imported from their
  new package, and the code's uses of a bare module name follow its new name (tokens only: strings and comments are
  prose). Where the new name is already used in that file (a variable `manager`), the import keeps the old local
  name (`from toolkit.train.ckpt import manager as checkpoint`) and the script says so.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# (old module, new module): pure moves, nothing else changes in the files.
MOVES: tuple[tuple[str, str], ...] = (
    # issue 40 item 3: the checkpoint modules in one package
    ("toolkit.train.checkpoint", "toolkit.train.ckpt.manager"),
    ("toolkit.train.checkpointing", "toolkit.train.ckpt.schedule"),
    ("toolkit.train.ckptdir", "toolkit.train.ckpt.hostdir"),
    ("toolkit.train.ckptfile", "toolkit.train.ckpt.partfile"),
    ("toolkit.train.ckptparts", "toolkit.train.ckpt.parts"),
    ("toolkit.train.interval", "toolkit.train.ckpt.interval"),
    # issue 40 item 5: one name per file (each of these had a namesake in another folder)
    ("toolkit.agent.log", "toolkit.agent.agentlog"),  # train/log.py: the worker's lines
    ("toolkit.launcher.remote.progress", "toolkit.launcher.remote.progressbar"),  # train/progress.py: report()
    ("toolkit.launcher.remote.settings", "toolkit.launcher.remote.sshsettings"),  # launcher/settings.py: flags
    ("toolkit.launcher.remote.transfer", "toolkit.launcher.remote.projectsync"),  # train/transfer.py: the state
    ("toolkit.launcher.report", "toolkit.launcher.runreport"),  # tasks/report.py: the `report` task
    ("toolkit.launcher.jobhosts.stopping", "toolkit.launcher.jobhosts.stopjob"),  # train/stopping.py: a worker's
    # one meaning of "spare" a module name: a spare host (the scheduler's) is not the warm spare process (the agent's)
    ("toolkit.agent.spare", "toolkit.agent.warmprocess"),  # the warm spare process's life (warmspare.py: pure)
    ("toolkit.scheduler.spares", "toolkit.scheduler.sparehosts"),  # lost hosts and the spare host that takes over
    ("tests.test_agent_spare", "tests.test_agent_warmprocess"),
)

# (old module, the module it only re-exports): the old one is removed and every name of it points at the other.
FOLDS: tuple[tuple[str, str], ...] = (
    ("toolkit.testing.ports", "toolkit.freeports"),  # `from toolkit.freeports import free_port, free_port_pair`, only
)

# New packages and their docstrings (written when the package has no __init__.py yet).
PACKAGES: dict[str, str] = {
    "toolkit.train.ckpt": '''"""Checkpoints: the copies on disk for when no survivor holds the state.

- manager.py: CheckpointManager (one copy per host, async staging, the restart agreement: Placement, choose).
- schedule.py: when the Trainer checkpoints and what it costs (fixed interval or "auto", agreed every step).
- interval.py: the "auto" interval from the job's own data (Young's formula).
- parts.py: a state cut into the parts a host's ranks write, and put together again (pure).
- hostdir.py: one host's checkpoint directory through one fd: list, write, read, refuse, tidy.
- partfile.py: one checkpoint file: its name, its MAC'd format, the key.
"""
''',
}

# Bare file names the rules cannot place (a name used in two folders), in one file's lists: (file, old, new).
BY_HAND: tuple[tuple[str, str, str], ...] = (
    ("docs/architecture.md", "  timers.py, log.py               ", "  timers.py, agentlog.py          "),
    ("docs/architecture.md", "  stopping.py                     stop", "  stopjob.py                      stop"),
    ("docs/architecture.md", "  transfer.py, hostkeys.py        ", "  projectsync.py, hostkeys.py     "),
    ("docs/architecture.md", "  settings.py, results.py         ", "  sshsettings.py, results.py      "),
    ("docs/architecture.md", "  progress.py                     the", "  progressbar.py                  the"),
)

SELF = Path(__file__).resolve()  # this script names the old modules on purpose: never rewritten
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".yml", ".yaml", ".ini", ".cfg", ".sh", ".j2"}
LINE_LIMIT = 120  # pyproject.toml's ruff line-length
FILE_WORDS = {"log", "json", "jsonl", "py", "txt", "md", "sh", "yaml", "yml", "key", "png", "lock", "j2"}


@dataclass(frozen=True)
class Move:
    old: str
    new: str
    fold: bool = False  # the new module exists already: the old one is removed, not moved

    @property
    def old_path(self) -> Path:
        return Path(*self.old.split(".")).with_suffix(".py")

    @property
    def new_path(self) -> Path:
        return Path(*self.new.split(".")).with_suffix(".py")

    @property
    def old_parent(self) -> str:
        return self.old.rpartition(".")[0]

    @property
    def old_base(self) -> str:
        return self.old.rpartition(".")[2]

    @property
    def new_parent(self) -> str:
        return self.new.rpartition(".")[0]

    @property
    def new_base(self) -> str:
        return self.new.rpartition(".")[2]


class Refused(Exception):
    """One line for the user: why nothing was done."""


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def move_files(root: Path, moves: list[Move]) -> list[str]:
    """`git mv` each module not yet moved; make the new packages. Refused (nothing moved) if any move is ambiguous."""
    todo = []
    for m in moves:
        old, new = root / m.old_path, root / m.new_path
        if m.fold:
            if not new.exists():
                raise Refused(f"{m.new_path} does not exist: {m.old_path} cannot fold into it")
            if old.exists():
                todo.append(m)
            continue
        if old.exists() and new.exists():
            raise Refused(f"both {m.old_path} and {m.new_path} exist: merge them by hand, then run again")
        if not old.exists() and not new.exists():
            raise Refused(f"neither {m.old_path} nor {m.new_path} exists: is this the repository's top?")
        if old.exists():
            todo.append(m)
    done = []
    for package, doc in PACKAGES.items():
        init = root / Path(*package.split(".")) / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(doc)
            git("add", str(init.relative_to(root)), cwd=root)
            done.append(f"made {init.relative_to(root)}")
    for m in todo:
        if m.fold:
            git("rm", "-q", str(m.old_path), cwd=root)
            done.append(f"removed {m.old_path}: its names are {m.new}'s")
            continue
        (root / m.new_path).parent.mkdir(parents=True, exist_ok=True)
        git("mv", str(m.old_path), str(m.new_path), cwd=root)
        done.append(f"moved {m.old_path} -> {m.new_path}")
    return done


def text_rules(moves: list[Move], basenames: Counter[str]) -> list[tuple[re.Pattern[str], str, str]]:
    """(pattern, replacement, old text) for the dotted names and the paths, longest first."""
    rules: list[tuple[str, str]] = []
    for m in moves:
        old, new = m.old.split("."), m.new.split(".")
        for k in range(len(old), 1, -1):  # toolkit.train.checkpoint, train.checkpoint
            tail = old[-k:]
            if k < len(old) and tail[-1] in FILE_WORDS:
                continue
            ancestor = old[:-k]
            if new[:len(ancestor)] != ancestor:
                continue
            rules.append((".".join(tail), ".".join(new[len(ancestor):])))
        oldp, newp = [*old[:-1], old[-1] + ".py"], [*new[:-1], new[-1] + ".py"]
        for k in range(len(oldp), 0, -1):  # toolkit/train/checkpoint.py, train/checkpoint.py, checkpoint.py
            tail, ancestor = oldp[-k:], oldp[:-k]
            if newp[:len(ancestor)] != ancestor:
                continue
            if k == 1 and basenames[tail[0]] > 1:
                continue
            rules.append(("/".join(tail), "/".join(newp[len(ancestor):])))
    rules.sort(key=lambda r: -len(r[0]))
    return [(re.compile(r"(?<![\w./-])" + re.escape(o) + r"(?![\w/])(?!\.\w)" if o.endswith(".py") else
                        r"(?<![\w./-])" + re.escape(o) + r"(?!\w)"), n, o) for o, n in rules]


def rewrite_text(text: str, rules: list[tuple[re.Pattern[str], str, str]]) -> str:
    for pattern, new, old in rules:
        if old.endswith(".py"):  # a path that starts a fixed-width row ("toolkit/train/log.py    the worker's
            # lines") keeps the row's columns
            pad = re.compile(r"(?m)^(\s*(?:- )?)" + re.escape(old) + r"( {2,})(?=\S)")
            text = pad.sub(lambda mm, old=old, new=new: mm.group(1) + new
                           + " " * max(2, len(old) + len(mm.group(2)) - len(new)), text)
        text = pattern.sub(new.replace("\\", "\\\\"), text)
    return text


def _names(source: str) -> list[tokenize.TokenInfo]:
    return [t for t in tokenize.generate_tokens(io.StringIO(source).readline)]


def _in_fstring(t: tokenize.TokenInfo, renames: dict[str, str]) -> list[tuple[int, int, int, int, str]]:
    """Edits for `old.attr` inside the {fields} of one f-string token (code, not prose)."""
    if t.start[0] != t.end[0]:
        return []  # a multi-line f-string: none names a module here; --check would list one
    names = "|".join(re.escape(n) for n in renames)
    edits = []
    for field in re.finditer(r"\{[^{}]*\}", t.string):
        for m in re.finditer(rf"(?<![\w.])({names})(?=\.\w)", field.group()):
            col = t.start[1] + field.start() + m.start()
            edits.append((t.start[0], col, t.start[0], col + len(m.group()), renames[m.group()]))
    return edits


def rewrite_imports(source: str, moves: list[Move], notes: list[str], where: str) -> str:
    """`from <parent> import a, b as c` naming moved modules: split into the new packages, and rename the code's
    uses of each bare module name that changes (or keep it by an alias where the new name is taken)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source  # not Python (a template's .py): its text rules still apply
    by_parent: dict[str, dict[str, Move]] = {}
    for m in moves:
        by_parent.setdefault(m.old_parent, {})[m.old_base] = m
    tokens = _names(source)
    bare_names = {t.string for i, t in enumerate(tokens) if t.type == tokenize.NAME
                  and not (i and tokens[i - 1].string == ".")}
    renames: dict[str, str] = {}
    edits: list[tuple[int, int, int, int, str]] = []  # (line, col, end line, end col, text), 1-based lines
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or node.module not in by_parent:
            continue
        moved = by_parent[node.module]
        if not any(a.name in moved for a in node.names):
            continue
        stay = [a for a in node.names if a.name not in moved]
        groups: dict[str, list[str]] = {}
        for a in node.names:
            if a.name not in moved:
                continue
            m = moved[a.name]
            if a.asname is not None:
                groups.setdefault(m.new_parent, []).append(f"{m.new_base} as {a.asname}")
            elif m.new_base == m.old_base:
                groups.setdefault(m.new_parent, []).append(m.new_base)
            elif m.new_base in bare_names:
                groups.setdefault(m.new_parent, []).append(f"{m.new_base} as {m.old_base}")
                notes.append(f"{where}: `{m.new_base}` is taken there, so it imports {m.new} as {m.old_base}")
            else:
                groups.setdefault(m.new_parent, []).append(m.new_base)
                renames[m.old_base] = m.new_base
        indent = " " * node.col_offset
        lines = []
        if stay:
            lines.append("from " + node.module + " import " + ", ".join(
                a.name + (f" as {a.asname}" if a.asname else "") for a in stay))
        lines += [f"from {parent} import {', '.join(sorted(names))}" for parent, names in sorted(groups.items())]
        edits.append((node.lineno, node.col_offset, node.end_lineno or node.lineno, node.end_col_offset or 0,
                      ("\n" + indent).join(lines)))
    for i, t in enumerate(tokens):  # the code's uses of a renamed bare module name (not attributes, not in prose)
        if t.type == tokenize.STRING and renames and re.match(r"(?i)[rb]*f", t.string):
            edits += _in_fstring(t, renames)  # before Python 3.12 an f-string is one token: its {fields} are code
        if t.type == tokenize.NAME and t.string in renames and not (i and tokens[i - 1].string == "."):
            if any(e[0] <= t.start[0] <= e[2] for e in edits):
                continue  # the import line itself, rewritten above
            edits.append((t.start[0], t.start[1], t.end[0], t.end[1], renames[t.string]))
    if not edits:
        return source
    lines = source.splitlines(keepends=True)
    for line, col, end_line, end_col, text in sorted(edits, reverse=True):
        head, tail = lines[line - 1][:col], lines[end_line - 1][end_col:]
        lines[line - 1:end_line] = [head + text + tail]
    return "".join(lines)


def rewrite_files(root: Path, moves: list[Move], notes: list[str]) -> list[Path]:
    files = [root / f for f in git("ls-files", "-z", cwd=root).split("\0") if f]
    files = [f for f in files if f.suffix in TEXT_SUFFIXES and f.is_file() and not f.is_symlink() and f != SELF]
    basenames = Counter(f.name for f in files)
    for m in moves:  # a moved file still counts under its old name (it is the one with that name)
        basenames[m.old_path.name] += 0 if (root / m.old_path).exists() else 1
    rules = text_rules(moves, basenames)
    changed = []
    for f in files:
        try:
            before = f.read_text()
        except UnicodeDecodeError:
            continue
        after = before
        if f.suffix == ".py":
            after = rewrite_imports(after, moves, notes, str(f.relative_to(root)))
        after = rewrite_text(after, rules)
        for name, old, new in BY_HAND:
            if f == root / name:
                after = after.replace(old, new)
        if after != before:
            f.write_text(after)
            changed.append(f)
    return changed


def leftovers(root: Path, moves: list[Move]) -> list[str]:
    """Lines that still name an old module by its full dotted name or path."""
    found = []
    olds = [re.compile(r"(?<![\w.])" + re.escape(m.old) + r"(?!\w)") for m in moves]
    olds += [re.compile(r"(?<![\w/])" + re.escape(m.old_path.as_posix()) + r"\b") for m in moves]
    olds += [re.compile(rf"from {re.escape(m.old_parent)} import [^\n#]*\b{m.old_base}\b") for m in moves]
    for f in git("ls-files", cwd=root).splitlines():
        p = root / f
        if p.suffix not in TEXT_SUFFIXES or not p.is_file() or p == SELF:
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if any(o.search(line) for o in olds):
                found.append(f"{f}:{n}: {line.strip()}")
    return found


def sort_imports(root: Path, files: list[Path]) -> None:
    """The rewritten import blocks in ruff's order (the project's lint; rule I only, nothing else changes)."""
    near = [root / ".venv" / "bin" / "ruff", Path(sys.executable).parent / "ruff"]
    exe = next((str(p) for p in near if p.exists()), None) or shutil.which("ruff")
    py = [str(f) for f in files if f.suffix == ".py"]
    if exe is None:
        print("ruff not found: run `ruff check --select I --fix .` to sort the rewritten imports", file=sys.stderr)
    elif py:
        subprocess.run([exe, "check", "--select", "I", "--fix", "--quiet", *py], cwd=root, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only list what still names an old module (exit 1)")
    parser.add_argument("--allow-dirty", action="store_true", help="run on a work tree with uncommitted changes")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository's top (default: here)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    moves = [Move(o, n) for o, n in MOVES] + [Move(o, n, fold=True) for o, n in FOLDS]
    try:
        if not (root / ".git").exists() or not (root / "toolkit").is_dir():
            raise Refused(f"{root} is not the toolkit repository's top: run from there or pass --root")
        if args.check:
            left = leftovers(root, moves)
            print("\n".join(left) if left else "no old module names left")
            return 1 if left else 0
        if git("status", "--porcelain", "--untracked-files=no", cwd=root).strip() and not args.allow_dirty:
            raise Refused("the work tree has uncommitted changes: commit or stash them (or pass --allow-dirty)")
        for line in move_files(root, moves):
            print(line)
        notes: list[str] = []
        long_before = {line for f in root.rglob("*.py") if ".venv" not in f.parts and ".git" not in f.parts
                       for line in f.read_text(errors="replace").splitlines() if len(line) > LINE_LIMIT}
        changed = rewrite_files(root, moves, notes)
        sort_imports(root, changed)
        for line in notes:
            print(line)
        print(f"rewrote {len(changed)} files")
        for f in changed:  # a longer name may push a line of prose past the limit: wrap those by hand
            if f.suffix != ".py":
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if len(line) > LINE_LIMIT and line not in long_before:
                    print(f"longer than {LINE_LIMIT} now, wrap it: {f.relative_to(root)}:{n}")
        left = leftovers(root, moves)
        for line in left:
            print(f"still names an old module: {line}", file=sys.stderr)
        return 1 if left else 0
    except Refused as e:
        print(f"move_modules: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
