"""Mutation testing of the core modules with mutmut, module by module, each against its fast unit tests.

    python -m tests.mutation                 # every module (what ``make mutation`` runs, niced)
    python -m tests.mutation kv.wire kv.compat
    python -m tests.mutation --recheck kv.wire   # only the last run's survivors, against the current tests
    python -m tests.mutation --report            # rebuild docs/mutation.json from the runs in out/mutation

Each module runs in its own copy of the repository under ``out/mutation/<module>`` (mutmut rewrites
the copy, never the work tree), with one torch thread so forked test workers are safe. Results
merge into ``docs/mutation.json``::

    {"modules": {NAME: {"killed", "total"}},
     "survivors": [{"module", "source", "line", "mutation", "why_acceptable"}]}

and the table of ``docs/mutation.md``. A surviving mutant must be explained in
``tests/mutation_survivors.toml`` (matched by module and mutated line); an unexplained one makes
the run fail, as does a module below ``TARGET`` killed.
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "mutation"
REPORT = ROOT / "docs" / "mutation.json"
PAGE = ROOT / "docs" / "mutation.md"
EXPLAINED = ROOT / "tests" / "mutation_survivors.toml"
TARGET = 0.90
KILLED = {"killed", "timeout", "segfault", "caught by type check"}  # the tests noticed the mutant


@dataclass(frozen=True)
class Module:
    sources: tuple[str, ...]  # paths under src/: one file, or the files one module is split into
    tests: tuple[str, ...]  # pytest selections (files or node ids): fast unit tests only
    functions: tuple[str, ...] = ()  # mutate only these functions, wherever defined (default: the whole files)

    def patterns(self) -> list[str]:
        """mutmut mutant-name globs (``pkg.mod.x_<function>__mutmut_<n>``) of the mutants in scope."""
        return ([f"{_dotted(s)}.x_{f}__mutmut_*" for s in self.sources for f in self.functions]
                or [f"{_dotted(s)}.*" for s in self.sources])

    def source_of(self, mutant: str) -> str:
        """The source file that mutant ``pkg.mod.x_<function>__mutmut_<n>`` mutates."""
        return next(s for s in self.sources if _dotted(s) == mutant.rsplit(".", 1)[0])


def _dotted(source: str) -> str:
    return source.removesuffix(".py").replace("/", ".")


# kv/wire_header.py + kv/wire_decode.py: the read side only (decode and everything it validates with);
# writers (kv/wire_encode.py) are not an attack surface
WIRE_SOURCES = ("kvrelay/kv/wire_header.py", "kvrelay/kv/wire_decode.py")
WIRE_DECODE = ("header_length", "tensor_digest", "root_digest", "parse_header", "_parse_entry", "_is_hex_digest", "_read",
               "_payload_meta", "_check_expected", "_held", "_check_layout", "_layer_positions", "_token_range",
               "_slots", "_decode", "decode")


STATS_UNITS = "mcnemar or tost_ or cluster or holm or wilcoxon or bca or paired_test"  # no summary fixtures
MODULES = {
    "kv.transforms": Module(("kvrelay/kv/transforms.py",), ("tests/kv/test_transforms.py",)),
    "kv.layout": Module(("kvrelay/kv/layout.py",), ("tests/kv/test_rules.py",)),
    "kv.wire": Module(WIRE_SOURCES, ("tests/kv/test_wire.py", "tests/kv/test_wire_hostile.py"), WIRE_DECODE),
    "kv.compat": Module(("kvrelay/kv/compat.py",), ("tests/kv/test_rules.py",)),
    "agents.receive": Module(("kvrelay/agents/receive.py",), ("tests/agents/test_receive.py",)),
    "audit.hypothesis": Module(("kvrelay/audit/hypothesis.py",), ("tests/audit/test_stats.py", "-k", STATS_UNITS)),
    "audit.bootstrap": Module(("kvrelay/audit/bootstrap.py",), ("tests/audit/test_stats.py", "-k", STATS_UNITS)),
    "audit.partners": Module(("kvrelay/audit/partners.py",), ("tests/audit/test_arms.py", "-k", "partner")),
    "audit.arms": Module(("kvrelay/audit/arms.py",), ("tests/audit/test_arms.py", "-k", "not runner and not mismatch_partner and not mismatched_is")),
    "transport.keys": Module(("kvrelay/transport/keys.py",), ("tests/transport/test_keys.py",)),
}


def _prepare(name: str, mod: Module) -> Path:
    work = OUT / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(ROOT / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    config = {
        "source_paths": ["src"],
        "only_mutate": [f"src/{s}" for s in mod.sources],
        "pytest_add_cli_args_test_selection": list(mod.tests),
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q"],
    }
    lines = [f"{k} = {json.dumps(v)}" for k, v in config.items()]
    text = (ROOT / "pyproject.toml").read_text()
    (work / "pyproject.toml").write_text(text + "\n[tool.mutmut]\n" + "\n".join(lines) + "\n")
    return work


def _mutmut(work: Path, *args: str) -> str:
    env = {**os.environ, "KVRELAY_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": "",
           "KVRELAY_FUZZ_EXAMPLES": "40"}  # per mutant: the fuzzers still try 40 edits each
    exe = Path(sys.executable).with_name("mutmut")
    r = subprocess.run([str(exe), *args], cwd=work, env=env, capture_output=True, text=True)
    if r.returncode != 0 and args[0] != "run":
        raise RuntimeError(f"mutmut {' '.join(args)} failed in {work}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def _functions(mutated: Path) -> dict[str, str]:
    """Source of every top-level function in mutmut's rewritten module (originals and mutants)."""
    text = mutated.read_text()
    lines = text.splitlines()
    return {n.name: "\n".join(lines[n.lineno - 1:n.end_lineno]) for n in ast.parse(text).body
            if isinstance(n, ast.FunctionDef)}


def _mutation_of(funcs: dict[str, str], mutant: str, source: Path) -> tuple[int, str]:
    """(line in the original source, ``old -> new``) of one mutant: its function diffed against the original."""
    short = mutant.rsplit(".", 1)[-1]  # x_<function>__mutmut_<n>
    orig = funcs.get(short.rsplit("__mutmut_", 1)[0] + "__mutmut_orig", "").splitlines()[1:]  # bodies: the
    mut = funcs.get(short, "").splitlines()[1:]  # def lines differ by name only (a multi-line def: its tail is equal)
    diff = [d for d in difflib.ndiff(orig, mut) if d[:1] in "-+"]
    old = next((d[2:] for d in diff if d.startswith("- ")), "")
    new = next((d[2:] for d in diff if d.startswith("+ ")), "")
    text = source.read_text()
    lines = text.splitlines()
    fn = short.rsplit("__mutmut_", 1)[0].removeprefix("x_")
    span = next(((n.lineno, n.end_lineno) for n in ast.parse(text).body
                 if isinstance(n, ast.FunctionDef) and n.name == fn), (1, len(lines)))
    line = next((i + 1 for i in range(span[0] - 1, span[1]) if lines[i].strip() == old.strip() and old.strip()), 0)
    return line, f"{old.strip()}  ->  {new.strip()}"


def _statuses(work: Path, mod: Module) -> dict[str, str]:
    """Verdict of every mutant in scope, from mutmut's own record; a survivor re-opened by a recheck that
    was stopped before testing it again keeps its earlier verdict."""
    from mutmut.stats import status_by_exit_code

    codes = {}
    for s in mod.sources:
        codes |= json.loads((work / "mutants" / "src" / (s + ".meta")).read_text())["exit_code_by_key"]
    reopened_file = work / "reopened.json"
    reopened = set(json.loads(reopened_file.read_text())) if reopened_file.exists() else set()
    out = {}
    for k, v in codes.items():
        if any(fnmatch.fnmatch(k, p) for p in mod.patterns()):
            out[k] = "survived (not re-tested)" if v is None and k in reopened else status_by_exit_code[v]
    return out


def _reopen_survivors(work: Path, mod: Module) -> list[str]:
    """Forget the verdicts of the surviving mutants of a finished run (so they are tested again) and
    bring in the current tests; returns their names. The source is unchanged, so the rest stand."""
    again = []
    for s in mod.sources:
        meta = work / "mutants" / "src" / (s + ".meta")
        d = json.loads(meta.read_text())
        codes = d["exit_code_by_key"]
        mine = [k for k, v in codes.items() if any(fnmatch.fnmatch(k, p) for p in mod.patterns())
                and (v is None or v == 0 or v == 5)]  # 0: survived, 5: no tests ran
        for k in mine:
            codes[k] = None
        meta.write_text(json.dumps(d))
        again += mine
    (work / "reopened.json").write_text(json.dumps(again))  # a stopped recheck still knows they survived before
    shutil.rmtree(work / "tests")
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return again


def run_module(name: str, workers: int, recheck: bool = False, report_only: bool = False) -> tuple[dict, list[dict]]:
    mod = MODULES[name]
    work = OUT / name
    if report_only:
        if not (work / "mutants").is_dir():
            raise RuntimeError(f"[{name}] no run in {work} to report on")
    elif recheck and (work / "mutants").is_dir():
        names = _reopen_survivors(work, mod)
        print(f"[{name}] re-testing {len(names)} surviving mutants against the current tests", flush=True)
        if names:
            _mutmut(work, "run", "--max-children", str(workers), *names)
    else:
        work = _prepare(name, mod)
        print(f"[{name}] mutating {' '.join('src/' + s for s in mod.sources)} against {' '.join(mod.tests)}", flush=True)
        _mutmut(work, "run", "--max-children", str(workers), *mod.patterns())
    status = _statuses(work, mod)
    if not status:
        raise RuntimeError(f"[{name}] mutmut produced no results; see {work}")
    unchecked = sum(s == "not checked" for s in status.values())  # a run stopped early: not counted
    status = {k: s for k, s in status.items() if s != "not checked"}
    killed = sum(s in KILLED for s in status.values())
    survivors = []
    funcs = {s: _functions(work / "mutants" / "src" / s) for s in mod.sources}
    for mutant, s in sorted(status.items()):
        if s not in KILLED:
            src = mod.source_of(mutant)
            line, mutation = _mutation_of(funcs[src], mutant, ROOT / "src" / src)
            survivors.append({"module": name, "source": f"src/{src}", "line": line, "mutation": mutation, "status": s})
    print(f"[{name}] killed {killed}/{len(status)}" + (f" ({unchecked} not run)" if unchecked else ""), flush=True)
    counts = {"killed": killed, "total": len(status)}
    return (counts | {"not_run": unchecked}) if unchecked else counts, survivors


def _explain(survivors: list[dict]) -> list[str]:
    """Fill ``why_acceptable`` from the curated file; returns the survivors nobody explained."""
    known = tomllib.loads(EXPLAINED.read_text()).get("survivor", []) if EXPLAINED.exists() else []
    why = {(e["module"], _norm(e["mutation"])): e["why_acceptable"] for e in known}
    missing = []
    for s in survivors:
        s["why_acceptable"] = why.get((s["module"], _norm(s["mutation"])), "")
        if not s["why_acceptable"]:
            missing.append(f"  {s['module']}:{s['line']}  {s['mutation']}  ({s['status']})")
    return missing


def _norm(mutation: str) -> str:
    return re.sub(r"\s+", " ", mutation).strip()


def write_page(report: dict) -> None:
    rows = [f"| `{n}` | {m['killed']} | {m['total']} | {100 * m['killed'] / max(m['total'], 1):.1f}% |"
            + (f" {m['not_run']} mutants not run (the run was stopped) |" if m.get("not_run") else "")
            for n, m in sorted(report["modules"].items())]
    k = sum(m["killed"] for m in report["modules"].values())
    t = sum(m["total"] for m in report["modules"].values())
    text = PAGE.read_text() if PAGE.exists() else "# Mutation testing\n"
    table = "\n".join(["| module | killed | total | score |", "|---|---:|---:|---:|", *rows,
                       f"| **all** | **{k}** | **{t}** | **{100 * k / max(t, 1):.1f}%** |"])
    start, end = "<!-- mutation-table -->", "<!-- /mutation-table -->"
    block = f"{start}\n{table}\n{end}"
    text = re.sub(re.escape(start) + ".*?" + re.escape(end), block, text, flags=re.S) if start in text else \
        text + "\n" + block + "\n"
    PAGE.write_text(text)


def main(argv: list[str]) -> int:
    recheck = "--recheck" in argv  # re-test only the survivors of the last run (after adding tests)
    report_only = "--report" in argv  # rebuild docs/mutation.json from the runs in out/mutation, run nothing
    names = [a for a in argv if a not in ("--recheck", "--report")] or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        print(f"unknown modules {unknown}; expected some of {list(MODULES)}", file=sys.stderr)
        return 2
    workers = int(os.environ.get("MUTATION_WORKERS", "2"))
    report = json.loads(REPORT.read_text()) if REPORT.exists() else {"modules": {}, "survivors": []}
    for name in names:
        counts, survivors = run_module(name, workers, recheck, report_only)
        if REPORT.exists():  # another run may have written meanwhile: merge into what is on disk
            report = json.loads(REPORT.read_text())
        report["modules"][name] = counts
        report["survivors"] = [s for s in report["survivors"] if s["module"] != name] + survivors
        missing = _explain(report["survivors"])
        report["survivors"].sort(key=lambda s: (s["module"], s["source"], s["line"]))
        report["totals"] = {key: sum(m[key] for m in report["modules"].values()) for key in ("killed", "total")}
        report["command"] = "make mutation"  # = python -m tests.mutation [MODULE ...], one module at a time
        REPORT.write_text(json.dumps(report, indent=2) + "\n")
        write_page(report)
    k = sum(m["killed"] for m in report["modules"].values())
    t = sum(m["total"] for m in report["modules"].values())
    print(f"all modules: killed {k}/{t} ({100 * k / max(t, 1):.1f}%), {len(report['survivors'])} survivors")
    low = [n for n, m in report["modules"].items() if m["killed"] < TARGET * m["total"]]
    if missing:
        print("survivors without an explanation in tests/mutation_survivors.toml:\n" + "\n".join(missing))
    if low:
        print(f"modules below {TARGET:.0%} killed: {low}")
    return 1 if (missing or low) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
