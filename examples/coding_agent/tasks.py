"""SWE-style bug-fix tasks: a small Python package, a bug injected into one function, hidden tests that catch it.

The function corpus: 14 function shapes (clamp, running sums, counting, max/min scans, sign, range checks, ...)
instantiated with different names, parameter names and constants, ~700 distinct functions. A function belongs to
the train or the held-out split by a hash of its name, so no held-out function (nor its code) is ever seen in
training, not even as a neighbour in a train repository.

A task (``make_task``):

* ``repo`` — the repository state the sandbox is created from: ``mathkit/__init__.py`` and ``mathkit/MODULE.py``
  with four functions of the task's split, one of them carrying the bug, and ``build/lib/mathkit/MODULE.py``, a
  stale build copy of that module (``tests/`` is NOT in it);
* ``bug_kind`` — one of ``BUG_KINDS``: swapped operator (``+``/``-``), off-by-one bound (``n + 1`` -> ``n``, or a
  ``- 1`` dropped), inverted comparison (``<`` -> ``>=`` ...), wrong variable returned, missing negation (``not``
  dropped), swapped boolean operator (``and``/``or``);
* ``issue`` — the text the agent gets: the failing test's name and its assertion output, as pytest prints it;
* ``FAIL_TO_PASS`` (tests of the buggy function that fail with the bug) and ``PASS_TO_PASS`` (the other tests of
  the module); the tests themselves are produced by ``hidden_tests(task)`` at verification time only.

``demonstration(task)``: the episode the warm start imitates — locate the function with ``grep``, fix the line
with a one-line ``sed`` substitution, ``submit``. ``demonstrations()`` are of mixed quality: in ``WRONG_FILE_SHARE``
(65%) of them the (correct) substitution is applied to the module's stale build copy (``build/lib/mathkit/MODULE.py``,
in every repository) instead of the file grep showed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUG_KINDS = (
    "swapped_operator",
    "off_by_one",
    "inverted_comparison",
    "wrong_variable_returned",
    "missing_negation",
    "swapped_boolean",
)
PACKAGE = "mathkit"
MODULES = ("core", "stats", "seqs", "checks")

# Shapes: {f} function name, parameters/locals in braces, {K} a small constant. ``args`` draws test inputs.
SHAPES: dict[str, tuple[str, str]] = {
    "clamp": (
        "def {f}({x}, {lo}, {hi}):\n    if {x} < {lo}:\n        return {lo}\n    if {x} > {hi}:\n"
        "        return {hi}\n    return {x}\n",
        "int3sorted",
    ),
    "sum_to": (
        "def {f}({n}):\n    {acc} = 0\n    for {i} in range(1, {n} + 1):\n        {acc} += {i} + {K}\n"
        "    return {acc}\n",
        "small",
    ),
    "count_at_least": (
        "def {f}({xs}, {t}):\n    {acc} = 0\n    for {v} in {xs}:\n        if {v} >= {t}:\n"
        "            {acc} += 1\n    return {acc}\n",
        "list_int",
    ),
    "largest": (
        "def {f}({xs}):\n    {acc} = {xs}[0]\n    for {v} in {xs}:\n        if {v} > {acc}:\n"
        "            {acc} = {v}\n    return {acc}\n",
        "list",
    ),
    "smallest": (
        "def {f}({xs}):\n    {acc} = {xs}[0]\n    for {v} in {xs}:\n        if {v} < {acc}:\n"
        "            {acc} = {v}\n    return {acc}\n",
        "list",
    ),
    "in_range": ("def {f}({x}, {lo}, {hi}):\n    return {lo} <= {x} and {x} < {hi}\n", "int3sorted"),
    "distance": (
        "def {f}({a}, {b}):\n    if {a} > {b}:\n        return {a} - {b}\n    return {b} - {a}\n",
        "int2",
    ),
    "head_total": (
        "def {f}({xs}, {n}):\n    {acc} = 0\n    for {i} in range({n}):\n        {acc} += {xs}[{i}]\n"
        "    return {acc}\n",
        "list_int",
    ),
    "last_index": ("def {f}({xs}):\n    return len({xs}) - 1\n", "list"),
    "sign": (
        "def {f}({x}):\n    if {x} == 0:\n        return 0\n    if {x} < 0:\n        return -1\n    return 1\n",
        "int1",
    ),
    "count_multiples": (
        "def {f}({xs}):\n    {acc} = 0\n    for {v} in {xs}:\n        if not {v} % {K}:\n"
        "            {acc} += 1\n    return {acc}\n",
        "list",
    ),
    "either_positive": ("def {f}({a}, {b}):\n    return {a} > 0 or {b} > 0\n", "int2"),
    "non_empty_total": (
        "def {f}({xs}):\n    if not {xs}:\n        return {K}\n    return {xs}[0] + {xs}[-1]\n",
        "list_or_empty",
    ),
    "offset_diff": ("def {f}({a}, {b}):\n    {acc} = {a} - {b}\n    return {acc} + {K}\n", "int2"),
}

SUFFIX = {
    "clamp": "clamp",
    "sum_to": "sum",
    "count_at_least": "atleast",
    "largest": "max",
    "smallest": "min",
    "in_range": "within",
    "distance": "dist",
    "head_total": "head",
    "last_index": "last",
    "sign": "sign",
    "count_multiples": "multiples",
    "either_positive": "anypos",
    "non_empty_total": "ends",
    "offset_diff": "offset",
}
VERBS = ["clamp", "sum", "count", "pick", "find", "check", "get", "scan", "total", "measure", "score", "fold"]
NOUNS = [
    "price", "score", "level", "width", "speed", "depth", "stock", "grade", "items", "steps", "votes", "hours",
    "miles", "pages", "coins", "bytes", "units", "marks",
]  # fmt: skip
SCALARS = ["x", "y", "n", "m", "k", "val", "num", "amount", "size", "pos"]
SEQS = ["xs", "ys", "vals", "nums", "items", "data", "seq", "arr"]
ACCS = ["total", "count", "acc", "best", "out", "res", "tally", "cur"]
LOOPS = ["i", "j", "v", "e", "w", "z"]
BOUNDS = [("lo", "hi"), ("low", "high"), ("a", "b"), ("lower", "upper"), ("start", "stop")]
PAIRS = [("a", "b"), ("p", "q"), ("u", "w"), ("left", "right"), ("first", "second")]


@dataclass(frozen=True)
class Function:
    name: str
    shape: str
    source: str
    args: str  # test-input kind

    def call(self, *values: Any) -> Any:
        return _compiled(self.name, self.source)(*values)


@functools.cache
def _compiled(name: str, source: str) -> Any:
    scope: dict[str, Any] = {}
    exec(source, scope)
    return scope[name]


def _split_of(name: str) -> str:
    return "heldout" if hashlib.sha256(name.encode()).digest()[0] < 52 else "train"  # ~20% held out


def _instantiate(shape: str, rng: random.Random, name: str) -> Function:
    template, args = SHAPES[shape]
    lo, hi = rng.choice(BOUNDS)
    a, b = rng.choice(PAIRS)
    names = {
        "f": name,
        "x": rng.choice([s for s in SCALARS if s not in (lo, hi)]),
        "lo": lo,
        "hi": hi,
        "n": rng.choice(["n", "m", "k", "count" if shape != "head_total" else "k", "limit"]),
        "xs": rng.choice(SEQS),
        "t": rng.choice(["t", "limit", "floor", "cut"]),
        "a": a,
        "b": b,
        "K": str(rng.randint(2, 9)),
    }
    names["acc"] = rng.choice([c for c in ACCS if c not in names.values()])
    names["i"] = rng.choice([c for c in LOOPS if c not in names.values()])
    names["v"] = rng.choice([c for c in LOOPS if c not in (names["i"],) and c not in names.values()])
    source = template
    for key, value in names.items():
        source = source.replace("{" + key + "}", value)
    return Function(name, shape, source, args)


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[Function, ...]:
    return tuple(_build_corpus())


def corpus() -> list[Function]:
    """Every function of the family (deterministic): one per (shape, verb, noun) name."""
    return list(_corpus())


def _build_corpus() -> list[Function]:
    """Every function of the family (deterministic): one per (shape, verb, noun) name."""
    out = []
    for shape in SHAPES:
        for verb in VERBS:
            for noun in NOUNS:
                name = f"{verb}_{noun}_{SUFFIX[shape]}"
                seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
                out.append(_instantiate(shape, random.Random(seed), name))
    return out


def _inputs(kind: str, rng: random.Random) -> tuple[Any, ...]:
    if kind == "int1":
        return (rng.randint(-9, 9),)
    if kind == "int2":
        return (rng.randint(-9, 9), rng.randint(-9, 9))
    if kind == "int3sorted":
        lo = rng.randint(-5, 5)
        return (rng.randint(-9, 12), lo, lo + rng.randint(1, 6))
    if kind == "small":
        return (rng.randint(0, 6),)
    if kind == "list_int":
        xs = [rng.randint(-5, 9) for _ in range(rng.randint(1, 6))]
        return (xs, rng.randint(0, len(xs)))
    if kind == "list_or_empty":
        return ([rng.randint(-5, 9) for _ in range(rng.randint(0, 5))],)
    return ([rng.randint(-5, 9) for _ in range(rng.randint(1, 6))],)


@functools.cache
def test_cases(fn: Function, n: int = 8) -> list[tuple[tuple[Any, ...], Any]]:
    """``n`` (arguments, expected) pairs computed from the correct function; the edge cases every shape has first."""
    rng = random.Random(fn.name)
    cases: list[tuple[tuple[Any, ...], Any]] = []
    seen: set[str] = set()
    for _ in range(200):
        args = _inputs(fn.args, rng)
        key = repr(args)
        if key in seen:
            continue
        seen.add(key)
        cases.append((args, fn.call(*args)))
        if len(cases) == n:
            break
    return cases


# -- bugs ------------------------------------------------------------------------------------------------------------
_SED_UNSAFE = set("*.[]\\/^$&'")
_COMPARE = {" < ": " >= ", " <= ": " > ", " > ": " <= ", " >= ": " < ", " == ": " != "}


def _mutations(line: str, kind: str, fn: Function) -> list[str]:
    """Every buggy version of ``line`` that a bug of ``kind`` makes."""
    out: list[str] = []
    if kind == "swapped_operator":
        for old, new in ((" + ", " - "), (" - ", " + ")):
            for m in re.finditer(re.escape(old), line):
                if line[m.end() :].startswith("1") and kind == "swapped_operator" and "range(" in line:
                    continue
                out.append(line[: m.start()] + new + line[m.end() :])
    elif kind == "off_by_one":
        for old in (" + 1", " - 1"):
            if old in line and line.count(old) == 1:
                out.append(line.replace(old, ""))
        m = re.search(r"range\((\w+)\)", line)
        if m:
            out.append(line[: m.end() - 1] + " - 1" + line[m.end() - 1 :])
    elif kind == "inverted_comparison":
        for old, new in _COMPARE.items():
            for m in re.finditer(re.escape(old), line):
                out.append(line[: m.start()] + new + line[m.end() :])
    elif kind == "wrong_variable_returned":
        m = re.match(r"(\s*return )(\w+)$", line)
        if m and not m.group(2).lstrip("-").isdigit():
            params = re.match(r"def \w+\((.*)\):", fn.source.splitlines()[0])
            names = [p.strip() for p in params.group(1).split(",")] if params else []
            out += [m.group(1) + p for p in names if p != m.group(2)]
    elif kind == "missing_negation":
        if "not " in line:
            out.append(line.replace("not ", "", 1))
    elif kind == "swapped_boolean":
        for old, new in ((" and ", " or "), (" or ", " and ")):
            if old in line:
                out.append(line.replace(old, new, 1))
    return out


def fix_fragments(good: str, bad: str, context: str = "") -> tuple[str, str] | None:
    """The shortest readable (OLD, NEW) pair such that replacing OLD in ``bad`` by NEW gives ``good``: the differing
    span widened to whole words until OLD occurs once in ``bad`` + ``context`` (the rest of the file), so that
    ``sed -i 's/OLD/NEW/' FILE`` fixes exactly this line. None when no unique, sed-safe pair exists."""
    p = 0
    while p < min(len(good), len(bad)) and good[p] == bad[p]:
        p += 1
    s = 0
    while s < min(len(good), len(bad)) - p and good[-1 - s] == bad[-1 - s]:
        s += 1
    lo, hi_bad, hi_good = p, len(bad) - s, len(good) - s
    # widen to word boundaries (spaces) in the bad line
    while lo > 0 and bad[lo - 1] != " ":
        lo -= 1
    while hi_bad < len(bad) and bad[hi_bad] != " ":
        hi_bad += 1
        hi_good += 1
    for _ in range(8):
        old, new = bad[lo:hi_bad], good[lo:hi_good]
        if old.strip() and bad.count(old) == 1 and old not in context:
            if set(old) & _SED_UNSAFE or set(new) & set("\\/&'"):
                return None
            return old, new
        # widen by one more word on the left (then on the right)
        if lo > 0:
            lo -= 1
            while lo > 0 and bad[lo - 1] != " ":
                lo -= 1
        elif hi_bad < len(bad):
            hi_bad += 1
            hi_good += 1
            while hi_bad < len(bad) and bad[hi_bad] != " ":
                hi_bad += 1
                hi_good += 1
        else:
            return None
    return None


def _inject(fn: Function, kind: str, rng: random.Random, others: str = "") -> tuple[str, int, str, str] | None:
    """A buggy source of ``fn`` with a bug of ``kind`` that the tests catch: (source, line index, OLD, NEW); OLD is
    unique in the file (``others``: the other functions' text)."""
    lines = fn.source.splitlines()
    options = [(k, bad) for k, line in enumerate(lines) if k > 0 for bad in _mutations(line, kind, fn)]
    rng.shuffle(options)
    cases = test_cases(fn)
    for k, bad in options:
        rest = "\n".join(lines[:k] + lines[k + 1 :]) + "\n" + others
        frag = fix_fragments(lines[k], bad, rest)
        if frag is None:
            continue
        source = "\n".join([*lines[:k], bad, *lines[k + 1 :]]) + "\n"
        buggy = Function(fn.name, fn.shape, source, fn.args)
        if any(_outcome(buggy, args) != expected for args, expected in cases):
            return source, k, frag[0], frag[1]
    return None


def _outcome(fn: Function, args: tuple[Any, ...]) -> Any:
    try:
        return fn.call(*args)
    except Exception as exc:
        return f"raised {type(exc).__name__}"


# -- tasks -----------------------------------------------------------------------------------------------------------
def _test_source(module: str, fns: list[Function]) -> str:
    lines = [f"from {PACKAGE}.{module} import " + ", ".join(f.name for f in fns), ""]
    for fn in fns:
        for c, (args, expected) in enumerate(test_cases(fn)):
            call = f"{fn.name}({', '.join(repr(a) for a in args)})"
            lines += ["", f"def test_{fn.name}_{c}():", f"    assert {call} == {expected!r}", ""]
    return "\n".join(lines)


def _failure_text(fn: Function, buggy: Function, c: int, args: tuple[Any, ...], expected: Any) -> str:
    call = f"{fn.name}({', '.join(repr(a) for a in args)})"
    got = _outcome(buggy, args)
    if isinstance(got, str) and got.startswith("raised "):
        detail = f"E       {got.split()[1]}"
    else:
        detail = f"E       assert {got!r} == {expected!r}"
    return f"FAILED tests/test_{{module}}.py::test_{fn.name}_{c}\n>       assert {call} == {expected!r}\n{detail}"


def make_task(target: Function, kind: str, neighbours: list[Function], seed: int) -> dict[str, Any] | None:
    """The task of fixing a ``kind`` bug in ``target`` inside a module with ``neighbours`` (None: no such bug)."""
    made = _make(target, kind, neighbours, seed)
    return made[0] if made else None


def _make(
    target: Function, kind: str, neighbours: list[Function], seed: int
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(task, its fix) — the fix (line, OLD, NEW) stays out of the task: the harness gets the task."""
    rng = random.Random(seed)
    injected = _inject(target, kind, rng, "\n".join(fn.source for fn in neighbours))
    if injected is None:
        return None
    source, line_idx, old, new = injected
    module = MODULES[seed % len(MODULES)]
    fns = [*neighbours]
    fns.insert(rng.randrange(len(fns) + 1), target)
    text = "\n\n".join(source if fn is target else fn.source for fn in fns)
    start = 1 + next(k for k, line in enumerate(text.splitlines()) if line.startswith(f"def {target.name}("))
    buggy = Function(target.name, target.shape, source, target.args)
    f2p, p2p, failures = [], [], []
    for c, (args, expected) in enumerate(test_cases(target)):
        test_id = f"tests/test_{module}.py::test_{target.name}_{c}"
        if _outcome(buggy, args) != expected:
            f2p.append(test_id)
            failures.append(_failure_text(target, buggy, c, args, expected).replace("{module}", module))
        else:
            p2p.append(test_id)
    for fn in fns:
        if fn is not target:
            p2p += [f"tests/test_{module}.py::test_{fn.name}_{c}" for c in range(len(test_cases(fn)))]
    path = f"{PACKAGE}/{module}.py"
    issue = failures[0]
    task = {
        "instance_id": f"{target.name}-{kind}-{seed}",
        "function": target.name,
        "bug_kind": kind,
        "module": module,
        "path": path,
        "issue": issue,
        # build/lib/: a stale copy of the module, as a build leaves one (the tests import the package's own module)
        "repo": {f"{PACKAGE}/__init__.py": "", path: text, f"{STALE_DIR}/{path}": text},
        "neighbours": [fn.name for fn in fns if fn is not target],
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
    }
    return task, {"line": start + line_idx, "old": old, "new": new}


def make_tasks(split: str, n: int, seed: int, n_neighbours: int = 3) -> list[dict[str, Any]]:
    """``n`` tasks whose target and neighbours are all functions of ``split``; bug kinds and shapes mixed."""
    return [task for task, _ in make_tasks_with_fixes(split, n, seed, n_neighbours)]


def make_tasks_with_fixes(
    split: str, n: int, seed: int, n_neighbours: int = 3
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``make_tasks`` with each task's reference fix (for demonstrations and tests)."""
    fns = [f for f in corpus() if _split_of(f.name) == split]
    rng = random.Random(seed)
    out: list[tuple[dict[str, Any], dict[str, Any]]] = []
    while len(out) < n:
        kind = BUG_KINDS[len(out) % len(BUG_KINDS)]  # balanced kinds: draw targets until one takes this kind
        target = rng.choice(fns)
        neighbours = rng.sample([f for f in fns if f.name != target.name], n_neighbours)
        made = _make(target, kind, neighbours, rng.randrange(1 << 30))
        while made is None:
            target = rng.choice(fns)
            made = _make(
                target, kind, [f for f in neighbours if f.name != target.name][:n_neighbours], rng.randrange(1 << 30)
            )
        out.append(made)
    return out


def hidden_tests(task: dict[str, Any]) -> dict[str, str]:
    """The tests of the task's module (``tests/test_MODULE.py``), built at verification time only."""
    by_name = {f.name: f for f in corpus()}
    names = [task["function"], *task["neighbours"]]
    return {f"tests/test_{task['module']}.py": _test_source(task["module"], [by_name[n] for n in names])}


# -- the episode the agent plays (kept in sync with coder.py) ----------------------------------------------------------
SYSTEM = "Fix the bug. Use bash to find and edit the code, then submit."
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in the repository",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}
SUBMIT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "submit", "description": "Submit the fix", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [BASH_TOOL, SUBMIT_TOOL]


def locate_command(task: dict[str, Any]) -> str:
    return f"grep -r -A5 'def {task['function']}' {PACKAGE}"


def fix_command(task: dict[str, Any], fix: dict[str, Any], path: str | None = None) -> str:
    return f"sed -i 's/{fix['old']}/{fix['new']}/' {path or task['path']}"


def grep_output(task: dict[str, Any]) -> str:
    """What ``locate_command`` prints in the task's repository (as grep does; used for demonstrations)."""
    lines = task["repo"][task["path"]].splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith(f"def {task['function']}("))
    out = []
    for k in range(start, min(start + 6, len(lines))):
        sep = ":" if k == start else "-"
        out.append(f"{task['path']}{sep}{lines[k]}")
    return "\n".join(out)


def demonstration(task: dict[str, Any], fix: dict[str, Any], path: str | None = None) -> dict[str, Any]:
    """The ideal episode: grep for the function, fix the line with sed, submit (``path``: sed edits that file)."""

    def call(i: int, name: str, args: dict[str, str]) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            ],
        }

    return {
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task["issue"]},
            call(0, "bash", {"cmd": locate_command(task)}),
            {"role": "tool", "tool_call_id": "call_0", "content": grep_output(task)},
            call(1, "bash", {"cmd": fix_command(task, fix, path)}),
            {"role": "tool", "tool_call_id": "call_1", "content": "(no output)"},
            call(2, "submit", {}),
        ],
    }


# -- sources named by train.toml ---------------------------------------------------------------------------------------
def train_tasks() -> list[dict[str, Any]]:
    return make_tasks("train", 2000, seed=1)


def heldout_tasks() -> list[dict[str, Any]]:
    return make_tasks("heldout", 200, seed=2)


WRONG_FILE_SHARE = 0.8
STALE_DIR = "build/lib"


def stale_copy(task: dict[str, Any]) -> str:
    """The stale build copy of the task's module (``build/lib/mathkit/MODULE.py``, in every task's repository): an
    edit there changes nothing the tests import."""
    return f"{STALE_DIR}/{task['path']}"


def demonstrations() -> list[dict[str, Any]]:
    """Mixed quality, like traces of a careless agent: every demonstration has the reference substitution on the
    path grep showed, but in ``WRONG_FILE_SHARE`` of them sed is pointed at that module's stale build copy
    (``stale_copy``: ``build/lib/`` before the path) instead, which changes nothing the tests import (reward 0).
    Whether to edit the source or the copy is one choice, at the path's first token, that RL finds out; every
    demonstration teaches the rest (copy the path, write the fix)."""
    rng = random.Random(4)
    return [
        demonstration(t, fix, stale_copy(t) if rng.random() < WRONG_FILE_SHARE else None)
        for t, fix in make_tasks_with_fixes("train", 1500, seed=3)
    ]


def validation_tasks() -> list[dict[str, Any]]:
    return make_tasks("train", 32, seed=5)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_tasks()), ("heldout", heldout_tasks()), ("demos", demonstrations())):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
