"""MATH answers: extraction (``\\boxed{}``, "The final answer is"), normalisation, and a
sympy-based equivalence check that runs in a separate worker process with a timeout.

Equivalence = the normalised strings are equal (the Hendrycks MATH convention), or, failing
that, both sides parse (a small LaTeX-to-sympy translation) and ``simplify(a - b) == 0`` or
they agree numerically. Tuples/intervals/lists are compared element-wise; equations side by
side. Anything that does not parse, or takes longer than the timeout, is "not equivalent".
Two exact numbers (integers, fractions) are equal only exactly; otherwise "numerically" means
``|a - b| <= 1e-6 * min(1, |gold|)`` (six decimals for a gold of at least 1, relative 1e-6 below).
Letters are products (``2xy`` equals ``2yx``), but a text answer (a word in ``\\text{}``, ``\\textbf{}``,
``\\mbox{}`` on either side, e.g. MATH-500's ``\\text{east}``) equals only the same text. Matrices
(``pmatrix``, ``bmatrix``, ...) are compared entry by entry.
"""

from __future__ import annotations

import atexit
import json
import re
import select
import subprocess
import sys
import threading


# ----------------------------------------------------------------------------- extraction
def _braced(s: str, i: int) -> tuple[str, int] | None:
    """Content of the brace group starting at ``s[i] == '{'`` and the index after it."""
    if i >= len(s) or s[i] != "{":
        return None
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return s[i + 1 : j], j + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed x``) in ``text``."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        j = m.end()
        if j < len(text) and text[j] == "{":
            got = _braced(text, j)
            if got is not None:
                best = got[0]
        elif m.group(0).endswith(" ") or (j < len(text) and text[j] != "{"):
            tail = re.match(r"[^\s$]+", text[j:])
            if tail:
                best = tail.group(0)
    return best


def extract_math_answer(text: str) -> str | None:
    """The model's final answer: last ``\\boxed{}``, else "final answer is X", else the last
    ``$...$``, else the last number; ``None`` if nothing answer-like is there."""
    b = last_boxed(text)
    if b is not None:
        return b.strip()
    m = None
    for m in re.finditer(r"final answer is\s*(.+?)(?:\.\s*I hope it is correct|\.\s*$|\.\s*\n|\n|$)", text,
                         flags=re.IGNORECASE):
        pass
    if m is not None:
        ans = m.group(1).strip()
        if ans.startswith("$") and ans.endswith("$") and len(ans) > 1:
            ans = ans.strip("$")
        return ans.strip()
    dollars = re.findall(r"\$([^$]+)\$", text)
    if dollars:
        return dollars[-1].strip()
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?", text)
    if nums:
        return nums[-1]
    return None


def gold_answer(record: dict) -> str:
    """MATH gold: the ``answer`` field when present, else the last ``\\boxed{}`` of the solution."""
    if record.get("answer") not in (None, ""):
        return str(record["answer"])
    b = last_boxed(str(record.get("solution", "")))
    return b if b is not None else ""


# ---------------------------------------------------------------------------- normalisation
def _remove_text_wrappers(s: str) -> str:
    # \text{ cm} -> " cm", \mbox{...}, \mathrm{...}, \textbf{...}
    for cmd in ("\\text", "\\textbf", "\\mbox", "\\mathrm", "\\mathbf", "\\textit", "\\operatorname"):
        while True:
            i = s.find(cmd + "{")
            if i < 0:
                break
            got = _braced(s, i + len(cmd))
            if got is None:
                break
            s = s[:i] + got[0] + s[got[1]:]
    return s


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}
    out = ""
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        out += "\\frac"
        if p.startswith("{"):
            got = _braced(p, 0)
            if got is None:
                out += p
                continue
            num, rest = "{" + got[0] + "}", p[got[1]:]
        elif p:
            num, rest = "{" + p[0] + "}", p[1:]
        else:
            continue
        if rest.startswith("{"):
            out += num + rest
        elif rest:
            out += num + "{" + rest[0] + "}" + rest[1:]
        else:
            out += num
    return out


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt\s*([0-9a-zA-Z])", r"\\sqrt{\1}", s)


_UNITS = ("degrees", "degree", "cm", "centimeters", "meters", "meter", "inches", "inch", "feet", "foot",
          "units", "unit", "square", "sq", "dollars", "cents", "mph", "hours", "minutes", "seconds", "km", "m")


def normalize(s: str | None) -> str:
    """A canonical string form of a MATH answer (Hendrycks-style ``strip_string`` plus units)."""
    if s is None:
        return ""
    s = str(s).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\:", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _remove_text_wrappers(s)
    s = re.sub(r"\s+(?:" + "|".join(_UNITS) + r")(?:\^2|\^3)?\s*$", "", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # "x = 5" / "k=5": keep the right side when the left side is a short name
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if len(lhs.strip()) <= 2:
            s = rhs
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


# ------------------------------------------------------------------------ sympy (in worker)
def _latex_to_py(s: str) -> str:
    """A small LaTeX-to-Python-expression translation for sympy's ``parse_expr``."""
    s = s.replace("\\left", "").replace("\\right", "")

    def repl_cmd(s: str, cmd: str, nargs: int, fmt) -> str:
        while True:
            i = s.find(cmd)
            if i < 0:
                return s
            j = i + len(cmd)
            opt = None
            if cmd == "\\sqrt" and j < len(s) and s[j] == "[":
                k = s.find("]", j)
                if k < 0:
                    return s
                opt, j = s[j + 1 : k], k + 1
            args = []
            for _ in range(nargs):
                got = _braced(s, j)
                if got is None:
                    raise ValueError(f"unbalanced {cmd}")
                args.append(got[0])
                j = got[1]
            s = s[:i] + fmt(args, opt) + s[j:]

    s = repl_cmd(s, "\\frac", 2, lambda a, o: f"(({a[0]})/({a[1]}))")
    s = repl_cmd(s, "\\sqrt", 1, lambda a, o: f"(({a[0]})**(1/({o})))" if o else f"sqrt({a[0]})")
    # names spaced out: the normalised answer has no spaces, and "2\\pir" / "\\sinx" must read as 2*pi*r / sin(x)
    for a, b in (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", " pi "), ("\\infty", " oo "),
                 ("\\ln", " log "), ("\\log", " log "), ("\\sin", " sin "), ("\\cos", " cos "), ("\\tan", " tan "),
                 ("\\exp", " exp "), ("^", "**"), ("{", "("), ("}", ")"), ("\\", " ")):
        s = s.replace(a, b)
    return s


def _split_top(s: str) -> list[str]:
    depth, cur, out = 0, "", []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


def _sympy_equal(a: str, b: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application,
                                            parse_expr, standard_transformations)

    # implicit products with names split into letters ("2xy" = 2*x*y = "2yx"); a text answer never gets here
    # (is_equiv compares it as text: split into letters, any anagram of a word was equal, helper 73)
    tr = standard_transformations + (implicit_multiplication_application, convert_xor)

    def parse(x: str):
        return parse_expr(_latex_to_py(x), transformations=tr, evaluate=True)

    def eq(x: str, y: str) -> bool:
        if x.count("=") == 1 and y.count("=") == 1:
            return all(eq(p, q) for p, q in zip(x.split("="), y.split("=")))
        ex, ey = parse(x), parse(y)
        try:
            if sympy.simplify(ex - ey) == 0:
                return True
        except Exception:
            pass
        infinities = (sympy.oo, -sympy.oo, sympy.zoo)
        if ex.has(*infinities) or ey.has(*infinities):
            return bool(ex == ey)  # an infinity equals only the same infinity (a tolerance around it would be inf)
        if ex.is_Rational and ey.is_Rational:
            return False  # two exact numbers are equal only exactly (simplify said they differ)
        try:  # in sympy's arbitrary-exponent floats: 10^400 became inf as a Python float, equal to 10^401
            # a decimal answer against an irrational gold (or decimals on either side): within 1e-6, relative for
            # golds below 1; never looser for a larger gold (relative to 2000000, 2000001 had passed)
            diff, scale = abs(sympy.N(ex - ey, 30)), min(sympy.Integer(1), abs(sympy.N(ey, 30)))
            return bool(diff <= sympy.Float("1e-6") * scale)
        except Exception:
            return False

    a, b = a.strip(), b.strip()
    brackets = "()[]"
    if a[:1] in brackets and b[:1] in brackets and len(_split_top(a[1:-1])) > 1:
        if a[0] != b[0] or a[-1] != b[-1]:
            return False  # (a, b) vs [a, b]: different intervals
        a, b = a[1:-1], b[1:-1]
    pa, pb = _split_top(a), _split_top(b)
    if len(pa) != len(pb):
        return False
    return all(eq(x, y) for x, y in zip(pa, pb))


def _worker_equal(a: str, b: str) -> bool:
    try:
        return bool(_sympy_equal(a, b))
    except Exception:
        return False


#: the worker: imports sympy and its parser (one comparison) before it says ``ready``, so that a check's timeout
#: is the comparison's alone. Imported by the first check instead, on a loaded machine (10 s for ``import sympy`` at
#: load 20 on 2 cores) the first check after every start (and a timed-out check restarts it) ran past its 5 s and
#: a right answer was scored wrong.
_LOOP = (
    "import json, sys\n"
    "from minicpm4_jax.eval.bench.math_equiv import _worker_equal\n"
    "_worker_equal('x', 'x + 0')\n"
    "print('ready', flush=True)\n"
    "for line in sys.stdin:\n"
    "    a, b = json.loads(line)\n"
    "    print(json.dumps(_worker_equal(a, b)), flush=True)\n"
)


class _Worker:
    """One persistent worker process (plain subprocess, line-based JSON); a check that exceeds
    its timeout kills the worker, counts as "not equivalent", and the next check starts a new one."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _LOOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1)
        if not self._wait_line(proc, 120.0) == "ready":
            self._kill(proc)
            raise RuntimeError("the sympy worker did not start")
        return proc

    @staticmethod
    def _wait_line(proc: subprocess.Popen, timeout: float) -> str | None:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = proc.stdout.readline()
        return line.strip() if line else None

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            proc.kill()
        except OSError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self._kill(proc)

    def equal(self, a: str, b: str, timeout: float) -> bool:
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
                self._proc.stdin.write(json.dumps([a, b]) + "\n")
                self._proc.stdin.flush()
                line = self._wait_line(self._proc, timeout)
            except (OSError, RuntimeError, ValueError):
                line = None
            if line is None:
                self.kill()
                return False
            return line == "true"


_WORKER = _Worker()
atexit.register(_WORKER.kill)


_TEXT_ARG = re.compile(r"\\(?:text|textbf|textit|mbox)\s*\{([^{}]*)\}")


def _is_text_answer(s: str) -> bool:
    """Whether ``s`` holds a word (2+ letters, not a unit such as ``cm``) inside ``\\text{}`` and the like."""
    return any(w.lower() not in _UNITS for arg in _TEXT_ARG.findall(s) for w in re.findall(r"[A-Za-z]{2,}", arg))
_MATRIX = re.compile(r"^\s*\\begin\{([pbvBV]?matrix)\}(.*)\\end\{\1\}\s*$", re.S)


def _matrix_entries(s: str) -> list[list[str]] | None:
    """The entries of an answer that is one ``\\begin{pmatrix} a & b \\\\ c & d \\end{pmatrix}`` (rows, then
    columns), else None."""
    m = _MATRIX.match(s.replace("$", ""))
    if m is None:
        return None
    rows = [r for r in re.split(r"\\\\", m.group(2)) if r.strip()]
    return [[c.strip() for c in r.split("&")] for r in rows]


def is_equiv(pred: str | None, gold: str | None, *, timeout: float = 5.0, use_sympy: bool = True) -> bool:
    """Whether a predicted MATH answer equals the gold one (see the module docstring).

    ``timeout``: seconds for the sympy comparison in the worker process (its start, which imports sympy, is not
    counted: up to 120 s); a comparison that takes longer is "not equivalent".
    """
    if pred is None or gold is None:
        return False
    mp, mg = _matrix_entries(str(pred)), _matrix_entries(str(gold))
    if mp is not None and mg is not None:  # entry by entry (as one expression, entries mixed into sums/products)
        return ([len(r) for r in mp] == [len(r) for r in mg]
                and all(is_equiv(x, y, timeout=timeout, use_sympy=use_sympy)
                        for rp, rg in zip(mp, mg) for x, y in zip(rp, rg)))
    a, b = normalize(pred), normalize(gold)
    if not a or not b:
        return False
    if a == b:
        return True
    if not use_sympy or _is_text_answer(str(pred)) or _is_text_answer(str(gold)):
        return False  # a text answer equals only the same text
    if len(a) > 400 or len(b) > 400:
        return False
    return _WORKER.equal(a, b, timeout)


def sympy_equal_direct(a: str, b: str) -> bool:
    """The sympy comparison in this process, without timeout (for tests and debugging)."""
    return _worker_equal(normalize(a), normalize(b))
