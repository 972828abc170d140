"""Coverage-guided fuzzing of one door with atheris (libFuzzer for Python), under a memory cap.

    python -m fuzz.run TARGET [--seconds 60] [--mem-gb 6] [libFuzzer flags...]
    python -m fuzz.run all --seconds 60          every target in turn (what `make fuzz` runs)

vitkit's own modules, PIL and PyYAML are instrumented for coverage. Each target starts from its seeds
(`fuzz/targets.py`) plus the corpus earlier campaigns grew (fuzz/corpus/TARGET, not in git). The address space is
capped with RLIMIT_AS (--mem-gb), each input with libFuzzer's -timeout and -rss_limit_mb. An input that breaks the
property (an exception other than a vitkit error, a 5xx, a stray file, a timeout or the memory cap) stops that
target's campaign and is written to fuzz/crashes/TARGET/; `python -m fuzz.run keep TARGET FILE` copies it
into tests/fuzz_regressions/, which `make test` replays.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _fuzz_one(target: str, seconds: int, mem_gb: float, extra: list[str]) -> dict:
    """Run one target in a child process (libFuzzer exits the process on a crash) and summarise it."""
    corpus = HERE / "corpus" / target
    crashes = HERE / "crashes" / target
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    seeds = HERE / "seeds" / target
    cmd = [sys.executable, "-m", "fuzz.run", "_child", target, "--mem-gb", str(mem_gb), "--",
           f"-max_total_time={seconds}", "-timeout=20", f"-rss_limit_mb={int(mem_gb * 1024)}", "-max_len=65536",
           f"-artifact_prefix={crashes}/", "-print_final_stats=1", str(corpus), str(seeds), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (HERE / "logs").mkdir(exist_ok=True)
    (HERE / "logs" / f"{target}.log").write_text(log)
    stats = dict(re.findall(r"^stat::(\w+):\s*(\d+)", log, re.M))
    found = sorted(p.name for p in crashes.iterdir())
    return {"target": target, "seconds": round(time.time() - t0),
            "executions": int(stats.get("number_of_executed_units", 0)),
            "exit": proc.returncode, "crash_files": found, "corpus": len(list(corpus.iterdir()))}


def _child(target: str, mem_gb: float, libfuzzer_args: list[str]) -> None:
    import atheris

    resource.setrlimit(resource.RLIMIT_AS, (int(mem_gb * 2**30), resource.RLIM_INFINITY))
    with atheris.instrument_imports(include=["vitkit", "PIL", "yaml"]):
        import vitkit  # noqa: F401 - every vitkit module imported below is instrumented too
        from vitkit import checkpoints, serve, training  # noqa: F401
        from vitkit.data import image, shards  # noqa: F401
        from vitkit.inference import predict  # noqa: F401 - predict's inputs (the predict_inputs target)
    from fuzz.targets import check, seeds

    seed_dir = HERE / "seeds" / target
    seed_dir.mkdir(parents=True, exist_ok=True)
    for name, data in seeds(target).items():
        (seed_dir / name).write_bytes(data)

    def one(data: bytes) -> None:
        check(target, data)

    atheris.Setup([sys.argv[0], *libfuzzer_args], one)
    atheris.Fuzz()


def keep(target: str, file: str) -> Path:
    """Copy a crash input into tests/fuzz_regressions/TARGET/ (named by its hash), replayed by `make test`."""
    data = Path(file).read_bytes()
    out = ROOT / "tests" / "fuzz_regressions" / target / hashlib.sha256(data).hexdigest()[:16]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        extra = argv[argv.index("--") + 1:]
        _child(argv[1], float(argv[argv.index("--mem-gb") + 1]), extra)
        return 0
    if argv and argv[0] == "keep":
        print(keep(argv[1], argv[2]))
        return 0
    from fuzz.targets import TARGETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", choices=[*TARGETS, "all"])
    p.add_argument("--seconds", type=int, default=60, help="per target")
    p.add_argument("--mem-gb", type=float, default=6.0)
    p.add_argument("--out", default=str(HERE / "results.json"), help="the campaign's summary")
    args, extra = p.parse_known_args(argv)
    targets = list(TARGETS) if args.target == "all" else [args.target]
    results = []
    for t in targets:
        shutil.rmtree(HERE / "crashes" / t, ignore_errors=True)
        r = _fuzz_one(t, args.seconds, args.mem_gb, extra)
        results.append(r)
        print(f"{t:12s} {r['executions']:>8,} executions in {r['seconds']:>4} s, corpus {r['corpus']:>5}, "
              f"crashes: {len(r['crash_files'])} {' '.join(r['crash_files'][:3])}", flush=True)
    Path(args.out).write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"), "results": results}, indent=1))
    bad = [r for r in results if r["crash_files"]]
    if bad:
        print(f"{len(bad)} target(s) found inputs that break the property: see fuzz/crashes/ and fuzz/logs/; keep each "
              f"with `python -m fuzz.run keep TARGET FILE` once fixed", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("VITKIT_NO_PROGRESS", "1")
    sys.exit(main())
