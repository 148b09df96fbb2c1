"""`cadence bench load`: what loading a checkpoint costs, in seconds and peak memory.

Whether a model loads on a machine at all is the first figure a user needs, and the
peak is what decides it, not the weights' final size: a load that held the stored and
the final form side by side peaked at 2.5x the final weights. Each load runs in a fresh
interpreter (a process's peak resident memory never goes down): cadence's
`load_model` once per `--cpu-quantize` form asked, and with `--compare` mlx-lm's
`load` on the same checkpoint (which keeps the stored dtype).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from runtime.checkpoint import resolve_checkpoint
from runtime.cpu_weights import CPU_QUANTIZE_CHOICES
from runtime.errors import CadenceError

from actors.bench_model import bench_checkpoint
from actors.bench_servers import has_mlx_lm

# Run in a fresh interpreter: argv[1] is the checkpoint, argv[2] the form ("mlx-lm" for
# the peer). Prints one JSON line. The imports' own peak (mlx-lm's reached 170 MB) is
# cleared first where Linux allows it (writing 5 to clear_refs resets VmHWM); elsewhere
# the peak is the process's (ru_maxrss: KB on Linux, bytes on macOS).
_LOAD_SCRIPT = """
import json, resource, sys, time
import runtime
import mlx.core as mx
from mlx.utils import tree_flatten
from runtime.errors import CadenceError
path, form = sys.argv[1], sys.argv[2]
if form == "mlx-lm":  # the peer, in its own process: actors never import mlx-lm
    def run():
        return __import__("mlx_lm").load(path)[0]
else:
    from runtime.checkpoint import load_model
    def run():
        return load_model(path, cpu_quantize=form).model

def status_bytes(field):
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

def peak_bytes():
    peak = status_bytes("VmHWM")
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return peak

try:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
except OSError:
    pass
before = status_bytes("VmRSS") or peak_bytes()
start = time.perf_counter()
try:
    model = run()
except CadenceError as error:  # a checkpoint cadence refuses: its one line
    sys.exit(str(error))
mx.eval(model.parameters())
seconds = time.perf_counter() - start
print(json.dumps({
    "seconds": seconds,
    "weights_bytes": sum(p.nbytes for _, p in tree_flatten(model.parameters())),
    "peak_bytes": peak_bytes(),
    "start_bytes": before,
}))
"""


def add_parser(which: argparse._SubParsersAction) -> None:
    load = which.add_parser("load", help="seconds and peak memory of loading a checkpoint")
    load.add_argument("--model", default=None, help="a checkpoint (default: the 200M bench model)")
    load.add_argument("--cache-dir", type=Path, default=Path(".bench"))
    load.add_argument(
        "--cpu-quantize",
        choices=CPU_QUANTIZE_CHOICES,
        nargs="+",
        default=["off"],
        help="the forms to load, each in its own process",
    )
    load.add_argument("--compare", action="store_true", help="then mlx-lm's load, same checkpoint")
    load.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except CadenceError as error:
        print(f"cadence bench load: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.compare and not has_mlx_lm():
        raise CadenceError("--compare needs mlx-lm (pip install mlx-lm)")
    # Resolved here, once: a path that is no checkpoint is one line before any table, and
    # a Hub id is fetched before the first load is timed.
    checkpoint = str(resolve_checkpoint(args.model)[0] if args.model else bench_checkpoint(args.cache_dir))
    forms = [(f"cadence --cpu-quantize {form}", form) for form in args.cpu_quantize]
    forms += [("mlx-lm load", "mlx-lm")] * args.compare
    print(f"{checkpoint}: each load in a fresh process")
    print("| loader | seconds | weights MB | resident before MB | peak resident MB | (peak - before) / weights |")
    print("|---|---|---|---|---|---|")
    for label, form in forms:
        figures = _measure(checkpoint, form, label)
        weights, before, peak = (figures[key] for key in ("weights_bytes", "start_bytes", "peak_bytes"))
        print(
            f"| {label} | {figures['seconds']:.2f} | {weights / 2**20:.1f} | {before / 2**20:.1f} | "
            f"{peak / 2**20:.1f} | {(peak - before) / max(weights, 1):.2f}x |",
            flush=True,
        )
    return 0


def _measure(checkpoint: str, form: str, label: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, checkpoint, form],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise CadenceError(f"{label}: {lines[-1]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures
