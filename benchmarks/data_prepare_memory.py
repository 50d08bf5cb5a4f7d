"""Peak memory of `isthmus data prepare` on large inputs (issue 63: 20.3 GB for a 300 MB text
file, 10.5 GB for a 180 MB one-line jsonl, when a document was tokenized whole).

    python3 benchmarks/data_prepare_memory.py --text-mb 300 --jsonl-mb 180

Writes, under a temporary folder in --dir, a text file of the standard library's Python
sources (4.7 MB) repeated to about --text-mb MB and a one-line jsonl of the same text to
about --jsonl-mb MB, trains a byte-level BPE of --vocab tokens on their first 4 MB, and
prepares each, after a 5-byte file: the interpreter, numpy, tokenizers and the tokenizer,
the baseline the bound (intra/corpus/prepare.py, PEAK_BYTES) is above. Each run's peak RSS is read by a
small process that starts it (os.wait4), as tests/deploy/test_data_prepare.py reads it.
Prints one row per input; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from isthmus.intra.corpus.prepare import PEAK_BYTES
from isthmus.intra.corpus.tokenizer import TextTokenizer

MEASURE = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def _corpus() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "".join(p.read_text(errors="replace") for p in sorted(lib.glob("*.py")))


def _write_repeated(path: Path, text: str, megabytes: int, jsonl: bool) -> None:
    """``text`` repeated to about ``megabytes`` MB (whole copies): a text file, or one
    jsonl line holding it."""
    block = (json.dumps(text)[1:-1] if jsonl else text).encode()  # escaped once: same JSON
    with open(path, "wb") as f:
        f.write(b'{"text": "' if jsonl else b"")
        for _ in range(max(1, round(megabytes * 10**6 / len(block)))):
            f.write(block)
        f.write(b'"}\n' if jsonl else b"")


def _prepare(src: Path, tokenizer: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "isthmus.deploy.cli", "data", "prepare", str(src)]
    cmd += ["--tokenizer", str(tokenizer), "--out", str(out), "--force", "--quiet"]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    code, kib = map(int, done.stdout.split())
    if code != 0:
        raise SystemExit(f"{src.name}: exit {code}: {done.stderr.strip()}")
    manifest = json.loads((out / "manifest.json").read_text())
    return {
        "input": src.name,
        "bytes": src.stat().st_size,
        "tokens": manifest["tokens"],
        "seconds": round(seconds, 1),
        "peak_rss_mib": round(kib / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text-mb", type=int, default=300, help="text file size (0: none)")
    parser.add_argument("--jsonl-mb", type=int, default=180, help="one-line jsonl (0: none)")
    parser.add_argument("--vocab", type=int, default=4096, help="BPE tokens")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="data-prepare-memory.", dir=args.dir))
    try:
        text = _corpus()
        tokenizer = work / "tokenizer.json"
        tokenizer.write_text(TextTokenizer.train([text[:4_000_000]], args.vocab).json)
        inputs = [work / "tiny.txt"]
        inputs[0].write_text("hello")
        if args.text_mb:
            inputs.append(work / f"big-{args.text_mb}mb.txt")
            _write_repeated(inputs[-1], text, args.text_mb, jsonl=False)
        if args.jsonl_mb:
            inputs.append(work / f"one-line-{args.jsonl_mb}mb.jsonl")
            _write_repeated(inputs[-1], text, args.jsonl_mb, jsonl=True)
        rows = []
        for src in inputs:
            row = _prepare(src, tokenizer, work / "out")
            row["above_baseline_mib"] = (
                round(row["peak_rss_mib"] - rows[0]["peak_rss_mib"], 1) if rows else 0.0
            )
            rows.append(row)
            print(
                f"{row['input']:>24}: {row['bytes'] / 1e6:8.1f} MB, {row['tokens']:>12,} tokens, "
                f"{row['seconds']:7.1f} s, peak RSS {row['peak_rss_mib']:7.1f} MiB "
                f"({row['above_baseline_mib']:+.1f} MiB; bound {PEAK_BYTES >> 20} MiB)",
                flush=True,
            )
        if args.json:
            facts = {"cores": os.cpu_count(), "vocab": args.vocab, "bound_mib": PEAK_BYTES >> 20}
            Path(args.json).write_text(json.dumps({**facts, "rows": rows}, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
