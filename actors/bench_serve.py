"""`cadence bench serve`: load an OpenAI-compatible server and print what clients see.

    cadence bench serve --url http://host:8000 [--model NAME] [--api-key KEY]
    cadence bench serve [--checkpoint PATH] [--compare] [--clients 1 4 16 | --rate 2]

With `--url` it measures that server. Otherwise it starts `cadence serve` on a
loopback port itself, on `--checkpoint` (default: the benchmark checkpoint, built
once under `--cache-dir`, see actors/bench_model.py), and with `--compare` then
`mlx_lm.server` on the same checkpoint, each alone in its own subprocess. The peer
gets its best configuration: the same optimized BLAS loaded first, and
`--decode-concurrency` and `--prompt-concurrency` equal to cadence's `--max-batch`
(the second's default, 8, ran 16 clients ~3% slower: 55.9 and 54.6 tok/s against
57.0 and 57.0).

One run per `--clients` value (or one `--rate` run), after a warm-up load (see
`warm_up`); the workload and its figures are in actors/loadgen.py. `--rounds N` repeats
them all N times, each round on fresh prompts (a prefix cache must not carry over)
and, with `--compare`, with the servers taking turns to go first; then it prints
each server's median and the ratio of every round. On a shared 2-core box one run's
ratio moved from 2.29x to 2.69x between two consecutive runs (the peer read 50.9 and
56.5 tok/s), so a claim rests on the median. Beside the figures
it prints the compute floor of each run (actors/bench_model.py's `Floor`), when the
checkpoint is known, so the distance to the machine's limit shows next to the
distance to the peer.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import itertools
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
from runtime.tokenizer import Tokenizer

import attrs
import trio

from actors import arg_types
from actors.atomic_write import write_atomically
from actors.bench_blas import measure_unpinned, pin_note
from actors.bench_model import Floor, bench_checkpoint, describe_machine, measure_floor
from actors.bench_servers import cadence_server, first_model, has_mlx_lm, mlx_lm_server, models_url
from actors.loadgen import (
    Request,
    RunResult,
    Span,
    Target,
    Workload,
    build_requests,
    parse_span,
    run_load,
)

Results = dict[str, list[list[RunResult]]]  # server -> rounds -> its runs, in --clients order


def add_parser(which: argparse._SubParsersAction) -> None:
    serve = which.add_parser("serve", help="a load generator for any OpenAI-compatible server")
    target = serve.add_argument_group("target")
    target.add_argument(
        "--url", type=arg_types.http_url, default=None, help="measure this running server"
    )
    target.add_argument("--model", default=None, help="the model name to send (default: its first)")
    target.add_argument("--api-key", default=None)
    target.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="the checkpoint to serve (default: the benchmark one); with --url, only read "
        "for its tokenizer and the compute floor",
    )
    target.add_argument("--cache-dir", type=Path, default=Path(".bench"))
    target.add_argument(
        "--compare", action="store_true", help="then mlx_lm.server, same checkpoint"
    )
    target.add_argument("--max-batch", type=arg_types.positive_int, default=16)
    target.add_argument(
        "--cadence-args",
        type=arg_types.shell_words,
        default=[],
        help="extra `cadence serve` flags, quoted",
    )
    load = serve.add_argument_group("workload")
    load.add_argument(
        "--clients", type=arg_types.positive_int, nargs="+", default=[1, 4, 16], help="one run each"
    )
    load.add_argument(
        "--rate", type=arg_types.positive_float, default=None, help="Poisson arrivals, req/s"
    )
    load.add_argument(
        "--requests",
        type=arg_types.positive_int,
        default=None,
        help="per run (default: the clients; 32 at a rate)",
    )
    load.add_argument("--prompt-tokens", type=_span, default="100", help="N or LOW:HIGH")
    load.add_argument("--max-tokens", type=_span, default="64", help="N or LOW:HIGH")
    load.add_argument(
        "--shared-prefix", type=arg_types.fraction, default=0.0, help="fraction of each prompt"
    )
    load.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    load.add_argument(
        "--timeout", type=arg_types.positive_float, default=600.0, help="seconds per request"
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--rounds",
        type=arg_types.positive_int,
        default=1,
        help="repeat the runs, on fresh prompts, servers taking turns to go first; "
        "print the medians",
    )
    serve.add_argument("--json", type=arg_types.output_file, default=None, help="also write the results here")
    serve.set_defaults(run=main)


def write_json(command: str, path: Path, report: Any) -> bool:
    """Write `report` to `path`; on failure (a full disk) say so in one line and return
    False, leaving what `path` held before whole."""
    text = json.dumps(report, indent=2)
    try:
        write_atomically(path, functools.partial(Path.write_text, data=text))
    except OSError as error:
        print(f"{command}: {path}: {error.strerror or error}", file=sys.stderr)
        return False
    return True


def _span(text: str):
    try:
        return parse_span(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def workloads(args: argparse.Namespace, round_index: int = 0) -> list[Workload]:
    """One round's runs; every run of every round draws its prompts from its own seed."""
    shape = dict(
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        shared_prefix=args.shared_prefix,
        endpoint=args.endpoint,
        ignore_eos=args.ignore_eos,
        timeout=args.timeout,
    )
    if args.rate:
        seed = args.seed + round_index
        return [Workload(args.requests or 32, rate=args.rate, seed=seed, **shape)]
    first_seed = args.seed + round_index * len(args.clients)
    return [
        Workload(args.requests or n, clients=n, seed=first_seed + i, **shape)
        for i, n in enumerate(args.clients)
    ]


def main(args: argparse.Namespace) -> int:
    if args.compare and args.url is not None:
        print("cadence bench serve: --compare starts its own servers; drop --url", file=sys.stderr)
        return 2
    checkpoint = args.checkpoint
    if checkpoint is None and args.url is None:
        checkpoint = bench_checkpoint(args.cache_dir)
    first_floor = measure_floor(checkpoint) if checkpoint is not None else None
    tokenizer = Tokenizer.from_dir(checkpoint) if checkpoint is not None else None
    rounds = [
        [(w, build_requests(w, tokenizer)) for w in workloads(args, r)] for r in range(args.rounds)
    ]
    warm = warm_up(args)
    warm_load = (warm, build_requests(warm, tokenizer))
    results: Results = {}
    if args.url is not None:
        try:
            model = args.model or first_model(args.url, args.api_key)
        except (OSError, ValueError, http.client.HTTPException) as error:
            print(f"cadence bench serve: {models_url(args.url)}: {error}", file=sys.stderr)
            return 2
        target = Target(args.url, model, args.api_key)
        results["server"] = [_measure(target, warm_load, runs) for runs in rounds]
    else:
        servers = {
            "cadence": functools.partial(cadence_server, checkpoint, args.max_batch, args.cadence_args)
        }
        if args.compare:
            if has_mlx_lm():
                servers["mlx-lm"] = functools.partial(mlx_lm_server, checkpoint, args.max_batch)
            else:
                print("mlx_lm is not importable: the mlx-lm comparison is skipped")
        results = {name: [] for name in servers}
        for i, runs in enumerate(rounds):
            # Turns, so that neither server always meets the box's next slow phase.
            for name in list(servers)[:: -1 if i % 2 else 1]:
                with servers[name]() as target:
                    results[name].append(_measure(target, warm_load, runs))
    # Timed before and after the runs, when no server computes; a busy machine only slows it.
    floor = None
    if checkpoint is not None:
        floor = max(first_floor, measure_floor(checkpoint), key=lambda f: f.gemm_flops)
    # The servers it started inherit this environment's OpenBLAS pin, if any.
    unpinned = measure_unpinned(checkpoint) if checkpoint is not None and args.url is None else None
    _print(args, checkpoint, floor, results)
    note = pin_note(floor, unpinned) if floor else None
    if note:
        print(f"\n{note}")
    report = _report(args, checkpoint, floor, results)
    report["unpinned_blas"] = attrs.asdict(unpinned) if unpinned is not None else None
    if args.json is not None and not write_json("cadence bench serve", args.json, report):
        return 2
    return 1 if any(r.num_errors for _, r in _every_run(results)) else 0


WARM_UP_SEED = 1_000_003  # past every run's seed: no measured prompt is warmed into a cache


def warm_up(args: argparse.Namespace) -> Workload:
    """The largest run's concurrency and prompt lengths, 4 tokens a request, on prompts of
    its own. A first request pays for kernel compiles, and on a GPU each new batch shape
    pays again (mlx's CUDA backend compiles its kernels the first time it meets them:
    ~30 s stalls on an H200 in a 64-client run, mid-stream); no measured run should."""
    largest = max(workloads(args), key=lambda w: w.clients or min(w.num_requests, args.max_batch))
    streams = largest.clients or min(largest.num_requests, args.max_batch)
    return attrs.evolve(
        largest,
        num_requests=streams,
        clients=streams,
        rate=None,
        max_tokens=Span(4, 4),
        seed=args.seed + WARM_UP_SEED,
    )


def _measure(
    target: Target,
    warm: tuple[Workload, list[Request]],
    runs: list[tuple[Workload, list[Request]]],
) -> list[RunResult]:
    trio.run(functools.partial(run_load, show=False), target, *warm)
    return [trio.run(run_load, target, workload, requests) for workload, requests in runs]


# -- output ---------------------------------------------------------------------------


def _print(args, checkpoint: Path | None, floor: Floor | None, results: Results) -> None:
    w = workloads(args)[0]
    eos = "ignore_eos" if w.ignore_eos else "until EOS"
    print(
        f"\n{checkpoint or args.url}: {w.endpoint}, greedy, streaming; prompts {w.prompt_tokens} "
        f"tokens ({w.shared_prefix:.0%} shared), max_tokens {w.max_tokens} ({eos})"
    )
    print(f"machine: {describe_machine()}")
    if floor is not None:
        m, k, n = floor.gemm_shape
        print(
            f"floor: (prompt + output tokens) x 2 x {_parameter_count(floor.num_params)} parameters "
            f"at {floor.gemm_flops / 1e9:.1f} GFLOP/s (the best fp32 [{m}, {k}] @ [{k}, {n}] "
            "matmul here, before or after the runs);\n       compute only: no attention, "
            "no memory-bandwidth limit, no overhead;\n       prompt floor: the run's prompt "
            "tokens (as the server counts them) alone at that rate, beside TTFT p99"
        )
    print(
        "\n| load | server | tok/s | floor tok/s (share) | TTFT p50 | TTFT p99 "
        "| prompt floor (TTFT p99 / it) | ITL p50 | ITL p99 | worst gap | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    names = list(results)
    num_loads = len(results[names[0]][0])
    for round_index, i in itertools.product(range(args.rounds), range(num_loads)):
        rows = {name: results[name][round_index][i] for name in names}
        label = rows[names[0]].label
        if args.rounds > 1:
            label = f"{label}, round {round_index + 1}"
        for name, r in rows.items():
            print(
                f"| {label} | {name} | {r.output_tok_s:.1f} | {_floor_tok_s(floor, r)} "
                f"| {_seconds(r.ttft_p50)} | {_seconds(r.ttft_p99)} | {_prompt_floor(floor, r)} "
                f"| {_ms(r.itl_p50)} | {_ms(r.itl_p99)} | {_seconds(r.worst_gap)} "
                f"| {r.num_errors} |"
            )
        if len(names) == 2:
            ours, peer = rows[names[0]], rows[names[1]]
            fields = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "worst_gap")
            ratio = [_ratio(getattr(ours, f), getattr(peer, f)) for f in fields]
            print(
                f"| {label} | {names[0]} / {names[1]} | {ratio[0]} | | "
                + " | ".join(ratio[1:3])
                + " | | "
                + " | ".join(ratio[3:])
                + " | |"
            )
    if floor is not None and any(_floor_share(floor, r) > 1 for _, r in _every_run(results)):
        print(
            "\nnote: a run beat its floor (a share over 100%): the matmul was timed while the "
            "box was busy (another process, a slow phase), or the server's own kernels outran "
            "it; read the floor columns as a lower bound"
        )
    if any(r.num_ok and r.ttft_p50 is None for _, r in _every_run(results)):
        print(
            "\nnote: a run's streams carried no text, so its latencies are not measured "
            "(-): the model generated ids its tokenizer decodes to nothing?"
        )
    if args.rounds > 1:
        _print_medians(args.rounds, results)
    for name, r in _every_run(results):
        for message, count in r.errors.items():
            print(f"{name}, {r.label}: {count} x {message}", file=sys.stderr)


def _every_run(results: Results) -> Iterator[tuple[str, RunResult]]:
    """(server, run) for every run of every round."""
    for name, rounds in results.items():
        for round_runs in rounds:
            for r in round_runs:
                yield name, r


def _print_medians(num_rounds: int, results: Results) -> None:
    names = list(results)
    first_went = "the servers took turns to go first" if len(names) == 2 else "one server"
    print(f"\nmedians of {num_rounds} rounds ({first_went}; fresh prompts each round):\n")
    columns = [f"{name} tok/s (min-max)" for name in names]
    if len(names) == 2:
        columns += [f"{names[0]} / {names[1]}, round by round", "median ratio"]
    print("| load | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for load in run_medians(results):
        cells = [f"{m:.1f} ({lo:.1f}-{hi:.1f})" for m, lo, hi in load.tok_s.values()]
        if load.ratios:
            cells += [", ".join(f"{x:.2f}x" for x in load.ratios), f"{load.median_ratio:.2f}x"]
        print(f"| {load.label} | " + " | ".join(cells) + " |")


@attrs.frozen
class LoadMedians:
    label: str
    tok_s: dict[str, tuple[float, float, float]]  # server -> (median, min, max) output tok/s
    ratios: tuple[float, ...]  # the first server's tok/s over the second's, each round
    median_ratio: float | None


def run_medians(results: Results) -> list[LoadMedians]:
    """Per load (a `--clients` value or the rate), over the rounds of `results`."""
    names = list(results)
    loads = []
    for i in range(len(results[names[0]][0])):
        runs = {name: [round_runs[i] for round_runs in results[name]] for name in names}
        tok_s = {name: [r.output_tok_s for r in rs] for name, rs in runs.items()}
        ratios: tuple[float, ...] = ()
        if len(names) == 2:
            ours, peer = tok_s[names[0]], tok_s[names[1]]
            ratios = tuple(a / b if b else 0.0 for a, b in zip(ours, peer, strict=True))
        loads.append(
            LoadMedians(
                runs[names[0]][0].label,
                {name: (statistics.median(v), min(v), max(v)) for name, v in tok_s.items()},
                ratios,
                statistics.median(ratios) if ratios else None,
            )
        )
    return loads


def _floor_tok_s(floor: Floor | None, r: RunResult) -> str:
    """Output tok/s if the run's every token cost only its FLOPs, and the share reached."""
    if floor is None or not r.num_output_tokens:
        return "-"
    floor_tok_s = r.num_output_tokens / floor.seconds(r.num_prompt_tokens + r.num_output_tokens)
    return f"{floor_tok_s:.1f} ({_floor_share(floor, r):.0%})"


def _floor_share(floor: Floor, r: RunResult) -> float:
    """The run's output tok/s over its floor's (0 for a run without output)."""
    if not r.num_output_tokens:
        return 0.0
    floor_tok_s = r.num_output_tokens / floor.seconds(r.num_prompt_tokens + r.num_output_tokens)
    return r.output_tok_s / floor_tok_s


def _prompt_floor(floor: Floor | None, r: RunResult) -> str:
    """Seconds the run's prompts alone take at the floor's rate, and TTFT p99 against it:
    the last first token can come no sooner than every prompt computed."""
    if floor is None or not r.num_prompt_tokens:
        return "-"
    seconds = floor.seconds(r.num_prompt_tokens)
    if r.ttft_p99 is None:
        return f"{seconds:.2f} s"
    return f"{seconds:.2f} s ({r.ttft_p99 / seconds:.2f}x)"


def _ratio(ours: float | None, peer: float | None) -> str:
    return f"{ours / peer:.2f}x" if ours is not None and peer else "-"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _report(
    args: argparse.Namespace,
    checkpoint: Path | None,
    floor: Floor | None,
    results: Results,
) -> dict[str, Any]:
    w = workloads(args)[0]

    def run(round_index: int, r: RunResult) -> dict[str, Any]:
        floor_s = floor.seconds(r.num_prompt_tokens + r.num_output_tokens) if floor else None
        prompt_s = floor.seconds(r.num_prompt_tokens) if floor else None
        return {
            **attrs.asdict(r),
            "round": round_index + 1,
            "floor_seconds": floor_s,
            "prompt_floor_seconds": prompt_s,
        }

    return {
        "argv": sys.argv,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "url": args.url,
        "machine": describe_machine(),
        "workload": {
            "clients": None if args.rate else args.clients,
            "rate": args.rate,
            "prompt_tokens": str(w.prompt_tokens),
            "max_tokens": str(w.max_tokens),
            "shared_prefix": w.shared_prefix,
            "endpoint": w.endpoint,
            "ignore_eos": w.ignore_eos,
            "seed": args.seed,
            "rounds": args.rounds,
        },
        "floor": None
        if floor is None
        else {**attrs.asdict(floor), "flops_per_token": floor.flops_per_token},
        "runs": {
            name: [run(i, r) for i, round_runs in enumerate(rounds) for r in round_runs]
            for name, rounds in results.items()
        },
        "medians": [attrs.asdict(m) for m in run_medians(results)],
    }


def _parameter_count(num_params: int) -> str:
    """182M, or 0.31M for a tiny test checkpoint (which read "0M")."""
    millions = num_params / 1e6
    return f"{millions:.0f}M" if millions >= 10 else f"{millions:.2g}M"
