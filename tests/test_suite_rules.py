"""Rules the test suite holds itself to.

No wall-clock bound on a test's behaviour: an assertion that something took less than N seconds
fails on any busy CI runner (a case that took 11.4 s against a 10 s bound behaved rightly). A test
proves that a run *ends* (a subprocess or communicate timeout against hangs, of HANG_TIMEOUT or
more) and what it did (exit code, messages, files, chunks priced); speed is measured in the
benchmarks, and the seconds a test sees are recorded (PRICER_RELIABILITY_REPORT,
PRICER_FUZZ_REPORT), not bounded.

The check reads every tests/**/*.py with `ast` and looks at each ordering comparison (<, <=, >,
>=) in an `assert`, an `if`/`elif`, a conditional expression or a comprehension's `if`. A
comparison is timed when a side involves a clock reading (time.perf_counter(), time.monotonic(),
time.time(), their _ns forms), a name assigned from one (directly or through other names), or a
name, attribute or string key whose words say it holds a time (DEADLINE, seconds, elapsed,
waited, wall(s), duration, stall). A timed comparison fails the test, naming file:line,
unless it is
  * a hang timeout: a clock reading against a deadline name (`deadline = time.monotonic() + X`)
    whose budget X is a constant of at least HANG_TIMEOUT seconds (X may be a parameter: its
    default and every call in the module that passes it must be), as in a polling loop's
    `if time.monotonic() > deadline: raise`; or
  * in ALLOWED below, each entry with the behaviour it states: lower bounds, the sign of a
    recorded figure, the order of events and a comparison of CPU times, which a slow or busy host
    never breaks, and one recorded figure checked against the 120 s hang timeout its run ran
    under. A test that stops naming an entry's comparison fails too (no stale entry).
`while` conditions are not checked: a loop that polls until a deadline fails only through what
the test asserts after it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
HANG_TIMEOUT = 60.0
CLOCKS = {"perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns"}
# words of a name that holds a time ("took" is not one: test_memory_guard's `took` is bytes; a
# `took = time.monotonic() - sent` is timed by its clock reading)
TIME_WORDS = {"deadline", "seconds", "elapsed", "waited", "wall", "walls", "duration", "stall"}

# (path under tests/, the comparison as ast.unparse writes it): why it is no speed bound
ALLOWED = {
    # a holder that keeps the cubin's lock is outwaited only after LOCK_WAIT_SECONDS (patched to
    # 0.2 s): the wait is at least that long, which a slow host never makes false
    ("test_cuda_compile.py", "0.2 <= waited"): "lower bound: the lock is waited for",
    # the order of two events (the waiting thread entered after the holder let go), no duration
    ("test_cuda_compile.py", "entered[0] >= released"): "event order: entered after the release",
    # CPU time, not wall time (the names say seconds): the process used less CPU after the signal
    # than before it, where a kernel call that ran on would have used several times more; a busy
    # host slows a process, it does not make it compute more
    ("test_refusals.py", "after < before"): "CPU time: no computing after the signal",
    # a recorded duration is not negative / is positive: the figure was measured and written
    # (the sign of a duration, which no host's speed changes)
    ("mpi/test_distributed.py", "run_group['seconds'] < 0"): "sign: /run's seconds not negative",
    ("test_cli.py", "0 < float(attrs['wall_seconds'])"): "sign: wall_seconds was recorded",
    ("test_hw1f_gpu.py", "row['kernel_seconds'] > 0"): "sign: the kernel time was recorded",
    ("test_scaling.py", "float(r['wall']) > 0"): "sign: the wall time was recorded",
    # one recorded duration against another of the same run: compute is a part of the wall
    ("test_scaling.py", "float(r['compute']) <= float(r['wall'])"): "a part is within its whole",
    # the recorded wall_seconds of a run made under run_pricer's 120 s subprocess timeout: it is
    # below the hang timeout the run already ended within (a check of the attribute's unit, that
    # it holds seconds, not milliseconds), no bound tighter than the timeout
    ("test_cli.py", "float(attrs['wall_seconds']) < 120"): "within the run's 120 s hang timeout",
}


# ------------------------------------------------------------------------------------- the rule

def _words(name: str) -> set[str]:
    return set(filter(None, re.split(r"_+", name.lower())))


def _is_clock_call(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}   # from time import monotonic


class _Scope:
    """A module's or a function's names: what each is assigned, and the function's parameters."""

    def __init__(self, node, parent: "_Scope | None"):
        self.node, self.parent = node, parent
        self.assigned: dict[str, list[ast.expr]] = {}
        self.params: dict[str, ast.expr | None] = {}
        self.positions: dict[str, int] = {}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
            for k, (arg, default) in enumerate(zip(positional, defaults)):
                self.params[arg.arg] = default
                self.positions[arg.arg] = k
            for arg, default in zip(a.kwonlyargs, a.kw_defaults):
                self.params[arg.arg] = default
        body = node.body if isinstance(node.body, list) else [node.body]
        for stmt in body:
            for sub in _walk_scope(stmt):
                self._note(sub)

    def _note(self, node) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind(target, node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            self._bind(node.target, node.value)
        elif isinstance(node, ast.NamedExpr):
            self._bind(node.target, node.value)

    def _bind(self, target, value) -> None:
        if isinstance(target, ast.Name):
            self.assigned.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) \
                and len(value.elts) == len(target.elts) else [value] * len(target.elts)
            for t, v in zip(target.elts, values):
                self._bind(t, v)

    def lookup(self, name: str):
        """(the scope that binds `name`, its assigned values) or (None, [])."""
        scope = self
        while scope is not None:
            if name in scope.assigned or name in scope.params:
                return scope, scope.assigned.get(name, [])
            scope = scope.parent
        return None, []


def _walk_scope(node):
    """The nodes of `node` that belong to its scope (not those of nested functions or classes)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield from _walk_scope(child)


class _Module:
    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.scopes: dict[ast.AST, _Scope] = {}
        self._timed: dict[tuple[int, str], bool] = {}
        self._build(tree, None)
        self.calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]

    def _build(self, node, parent) -> None:
        scope = parent
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            scope = self.scopes[node] = _Scope(node, parent)
        for child in ast.iter_child_nodes(node):
            self._build(child, scope)

    # -- what an expression is

    def timed(self, node, scope: _Scope) -> bool:
        for sub in ast.walk(node):
            if _is_clock_call(sub):
                return True
            if isinstance(sub, ast.Attribute) and _words(sub.attr) & TIME_WORDS:
                return True
            if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) \
                    and isinstance(sub.slice.value, str) and _words(sub.slice.value) & TIME_WORDS:
                return True
            if isinstance(sub, ast.Name) and (_words(sub.id) & TIME_WORDS
                                              or self._timed_name(sub.id, scope)):
                return True
        return False

    def _timed_name(self, name: str, scope: _Scope) -> bool:
        """Whether `name` is assigned a timed value (each name worked out once: a name assigned
        from itself, `x = x + 1`, is not timed through itself)."""
        owner, values = scope.lookup(name)
        if owner is None:
            return False
        key = (id(owner), name)
        if key not in self._timed:
            self._timed[key] = False
            self._timed[key] = any(self.timed(v, owner) for v in values)
        return self._timed[key]

    def reading(self, node, scope: _Scope) -> bool:
        """A clock reading: a clock call, or a name assigned only from one."""
        if _is_clock_call(node):
            return True
        if isinstance(node, ast.Name):
            owner, values = scope.lookup(node.id)
            return bool(values) and all(_is_clock_call(v) for v in values)
        return False

    def _budget(self, node, scope: _Scope):
        """For a name assigned only `reading + X`: (X, the scope it is evaluated in); else None."""
        if not isinstance(node, ast.Name):
            return None
        owner, values = scope.lookup(node.id)
        if len(values) != 1 or not isinstance(values[0], ast.BinOp) \
                or not isinstance(values[0].op, ast.Add):
            return None
        v = values[0]
        if self.reading(v.left, owner):
            return v.right, owner
        if self.reading(v.right, owner):
            return v.left, owner
        return None

    def least(self, node, scope: _Scope):
        """The least value `node` can take as a number of seconds, where it is known: constants,
        arithmetic, names bound once to one, parameters (their default and every call in this
        module); None where it is not known."""
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = self.least(node.operand, scope)
            return None if value is None else -value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = self.least(node.left, scope), self.least(node.right, scope)
            if a is None or b is None:
                return None
            return a + b if isinstance(node.op, ast.Add) else a * b
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("float", "int") and len(node.args) == 1:
            return self.least(node.args[0], scope)
        if isinstance(node, ast.Name):
            owner, values = scope.lookup(node.id)
            if owner is None:
                return None
            if node.id in owner.params:
                return self._least_argument(owner, node.id)
            if len(values) == 1:
                return self.least(values[0], owner)
        return None

    def _least_argument(self, scope: _Scope, name: str):
        found = []
        default = scope.params[name]
        if default is not None:
            found.append(self.least(default, self.scopes[self.tree]))
        fn = scope.node
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        index = scope.positions.get(name)
        method = bool(fn.args.args) and fn.args.args[0].arg in ("self", "cls")
        for call in self.calls:
            f = call.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                else None
            if called != fn.name or not _fits(fn, call, method and isinstance(f, ast.Attribute)):
                continue
            given = [k.value for k in call.keywords if k.arg == name]
            k = None if index is None else index - (1 if method and isinstance(f, ast.Attribute)
                                                    else 0)
            if not given and k is not None and 0 <= k < len(call.args):
                given = [call.args[k]]
            if given:
                found.append(self.least(given[0], self.scopes[self.tree]))
            elif default is None:
                found.append(None)
        if not found or None in found:
            return None
        return min(found)


def _fits(fn, call: ast.Call, bound: bool) -> bool:
    """Whether `call` can be a call of `fn` (another object's method of the same name, such as
    Popen.wait(timeout=5) beside a Cluster.wait(job_id), cannot): its positional arguments fit,
    its keywords are parameters, every parameter without a default is given."""
    a = fn.args
    positional = [arg.arg for arg in a.posonlyargs + a.args][1 if bound else 0:]
    if any(isinstance(arg, ast.Starred) for arg in call.args) or \
            any(k.arg is None for k in call.keywords):
        return True                     # *args or **kwargs at the call: cannot tell
    if len(call.args) > len(positional) and a.vararg is None:
        return False
    names = set(positional) | {arg.arg for arg in a.kwonlyargs}
    given = set(positional[:len(call.args)]) | {k.arg for k in call.keywords}
    if a.kwarg is None and not {k.arg for k in call.keywords} <= names:
        return False
    required = positional[:len(positional) - len(a.defaults)] + \
        [arg.arg for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return set(required) <= given


def _scope_of(module: _Module, parents: dict, node) -> _Scope:
    while node is not None:
        if node in module.scopes:
            return module.scopes[node]
        node = parents.get(node)
    return module.scopes[module.tree]


def _conditions(tree):
    """(the condition, what it is) of every assert, if, conditional expression and comprehension
    filter."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            yield node.test, "assert"
        elif isinstance(node, (ast.If, ast.IfExp)):
            yield node.test, "if"
        elif isinstance(node, ast.comprehension):
            for test in node.ifs:
                yield test, "if"


ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def wall_clock_bounds(source: str, name: str) -> list[str]:
    """`name:line: why` for every timed comparison of `source` that is not a hang timeout of
    HANG_TIMEOUT seconds or more nor in ALLOWED."""
    tree = ast.parse(source)
    module = _Module(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for condition, kind in _conditions(tree):
        for compare in (n for n in ast.walk(condition) if isinstance(n, ast.Compare)):
            scope = _scope_of(module, parents, compare)
            sides = [compare.left, *compare.comparators]
            for left, op, right in zip(sides, compare.ops, sides[1:]):
                if not isinstance(op, ORDER):
                    continue
                if not (module.timed(left, scope) or module.timed(right, scope)):
                    continue
                text = ast.unparse(ast.Compare(left=left, ops=[op], comparators=[right]))
                if (name, text) in ALLOWED:
                    continue
                why = _hang_timeout(module, scope, left, right)
                if why is True:
                    continue
                found.append(f"tests/{name}:{compare.lineno}: {kind} {text}  ({why})")
    return found


def _hang_timeout(module: _Module, scope: _Scope, left, right):
    """True for a clock reading against a deadline of HANG_TIMEOUT seconds or more; else why not."""
    for now, limit in ((left, right), (right, left)):
        if module.reading(now, scope):
            budget = module._budget(limit, scope)
            if budget is not None:
                least = module.least(*budget)
                if least is None:
                    return f"a deadline of unknown length: {ast.unparse(budget[0])}"
                if least >= HANG_TIMEOUT:
                    return True
                return f"a deadline of {least:g} s, under the {HANG_TIMEOUT:g} s of a hang timeout"
    return "a bound on elapsed wall time: test that it ends (a timeout) and what it did instead"


def scan(root: Path = TESTS) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        found += wall_clock_bounds(path.read_text(), path.relative_to(root).as_posix())
    return found


# ------------------------------------------------------------------------------------ the tests

def test_no_test_bounds_elapsed_wall_time():
    found = scan()
    assert not found, "wall-clock bounds in tests (see tests/test_suite_rules.py):\n" + \
        "\n".join(found)


FLAGGED = {
    "assert": """
import time
def test():
    start = time.perf_counter()
    seconds = time.perf_counter() - start
    assert seconds < 10
""",
    "if": """
DEADLINE = 10.0
def check(reports):
    if max(s for _, _, s in reports) > DEADLINE:
        return ["slow"]
""",
    "derived": """
import time
def test():
    sent = time.monotonic()
    took = time.monotonic() - sent
    assert ok and took < 5.0
""",
    "inline": """
import time
def test():
    started = time.monotonic()
    assert time.monotonic() - started < 60 and ok
""",
    "counted": """
def test(time_case):
    _, _, walls = time_case()
    assert walls.size >= 25
""",
    "sum": "def test(walls):\n    assert walls.sum() >= 0.045\n",
    "chained": "def test(waited):\n    assert 0.1 <= waited < 3\n",
    "short deadline": """
import time
def take_over(timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError
""",
    "a call passes a short deadline": """
import time
def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError
wait_for(print, 120)
wait_for(print, 10)
""",
    "unknown deadline": """
import time
def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    if time.monotonic() > deadline:
        raise TimeoutError
""",
}

PASSED = {
    "hang timeout": """
import time
def wait(job, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise AssertionError
wait(1)
wait(1, timeout=600)
""",
    "polling while": """
import time
def test():
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not done():
        pass
    assert done()
""",
    "not time": "def test(proc, rows):\n    assert proc.returncode < 3 and len(rows) >= 25\n",
    "equality": "def test(walls, wall):\n    assert wall == sorted(walls)[2] and len(walls) == 48\n",
}


@pytest.mark.parametrize("case", list(FLAGGED))
def test_the_rule_flags_a_wall_clock_bound(case):
    assert wall_clock_bounds(FLAGGED[case], "case.py"), FLAGGED[case]


@pytest.mark.parametrize("case", list(PASSED))
def test_the_rule_passes_what_bounds_no_elapsed_time(case):
    assert wall_clock_bounds(PASSED[case], "case.py") == []


def test_the_allowed_comparisons_are_still_there():
    """Every ALLOWED entry names a comparison that exists (a stale entry would allow a future
    one of the same text unseen)."""
    present = set()
    for path in sorted(TESTS.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        for condition, _ in _conditions(tree):
            for compare in (n for n in ast.walk(condition) if isinstance(n, ast.Compare)):
                sides = [compare.left, *compare.comparators]
                for left, op, right in zip(sides, compare.ops, sides[1:]):
                    present.add((path.relative_to(TESTS).as_posix(), ast.unparse(
                        ast.Compare(left=left, ops=[op], comparators=[right]))))
    assert set(ALLOWED) <= present, set(ALLOWED) - present
