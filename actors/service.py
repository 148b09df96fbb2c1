"""The embedding API: cadence's actors inside your own Trio program.

    async with actors.open_llm("path/or/org/repo") as llm:
        async with llm.generate(prompt="Once upon a time", max_tokens=32) as stream:
            async for delta in stream:
                print(delta.text, end="")
        print(stream.finish_reason, stream.usage)

`open_llm` loads the model on the process's MLX thread (actors/mlx_thread.py),
starts admission, scheduler, GPU and streamer in a nursery of its own, and on exit
drains: new requests are refused, running ones finish (or are aborted after
`drain_timeout`), then the actors stop. It installs no signal handlers and
configures no logging. Several models in one process share the MLX thread.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from runtime.checkpoint import LoadedModel, load_model
from runtime.cpu_weights import DEFAULT_CPU_QUANTIZE
from runtime.engine import Engine
from runtime.grammar import GrammarCompiler
from runtime.kv.blocks import BlockPool
from runtime.kv.budget import DEFAULT_BLOCK_SIZE
from runtime.kv.snapshots import SnapshotBook
from runtime.ladder import measure_ladder
from runtime.runner import PlanRunner
from runtime.scheduler import DEFAULT_PREFILL_CHUNK, DEFAULT_SOLO_PREFILL_TOKENS, FcfsScheduler
from runtime.think_reply import think_tags
from runtime.tool_prompts import tool_style_for
from runtime.tools import REASONING_STYLES
from runtime.warm_up import warm_up_steps

import attrs
import structlog
import trio

from actors.admission import Admission
from actors.checked_settings import check_settings
from actors.gpu import GpuActor
from actors.llm import LLM
from actors.messages import Admit, GpuMessage, SchedulerMessage, StreamerMessage
from actors.metrics import Metrics
from actors.mlx_thread import MlxThread, shared_mlx_thread
from actors.scheduler import SchedulerActor
from actors.streamer import Streamer

log = structlog.get_logger("cadence")


def _cache_salt(loaded: LoadedModel) -> bytes:
    """Cached K/V is only valid for the weights and dtype that computed it."""
    dtype = loaded.model.model.norm.weight.dtype
    return hashlib.blake2b(f"{loaded.name}|{dtype}|{loaded.config!r}".encode()).digest()


@contextlib.asynccontextmanager
async def open_llm(
    model: str | Path | None = None,
    *,
    max_batch: int = 16,
    max_waiting: int = 64,
    max_context: int | None = None,
    kv_budget: int | float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    prefix_cache: bool = True,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    max_num_batched_tokens: int | None = None,
    batch_ladder: bool = False,
    warm_up: bool | None = None,
    lookahead: int = 1,
    offline: bool = False,
    keep_dtype: bool = False,
    cpu_quantize: str = DEFAULT_CPU_QUANTIZE,
    on_progress: Callable[[str], None] | None = None,
    drain_timeout: float | None = None,
    think_split: bool = True,
) -> AsyncIterator[LLM]:
    """Load `model` (None: the built-in demo) and serve it until the block exits.

    `kv_budget` sizes the paged KV pool: bytes, a fraction of available memory, or
    None for the default (see `runtime.engine.Engine`). `max_num_batched_tokens` caps
    a step's tokens, a prompt computed alone included (default `max_batch +
    prefill_chunk` beside decoding rows, and 512 prompt tokens with none; see
    runtime/scheduler.py).
    `batch_ladder` times the model's dense layers at 1..max_batch tokens at start-up
    and pads steps to a cheaper size (runtime/ladder.py).
    `warm_up` runs the step shapes once on dummy prompts before serving, so that no
    request waits for a kernel compile (runtime/warm_up.py); None: on a GPU only.
    `prefix_cache=False` turns prefix caching off (a hybrid model's, Qwen3.5's, resumes
    from recurrent-state snapshots: runtime/kv/snapshots.py). `lookahead` (>= 1) is how many engine steps stay queued
    behind the running one (more hides more scheduling latency, and costs that many
    speculative steps per finish).
    `think_split=False` leaves a thinking model's thought (`<think>`, Mistral's `[THINK]`)
    in its chat replies' content, tags and all, unparsed (runtime/think_reply.py).
    `on_progress` is called from the loading thread with one-line messages.
    Raises `runtime.errors.CheckpointError` for a bad checkpoint, and `CadenceError`
    naming the setting for a bad setting, before anything loads.
    """
    try:  # under asyncio, Trio's own error came from deep in the MLX thread's hand-off
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        raise RuntimeError(
            "open_llm runs under Trio (trio.run); from asyncio, use actors.open_llm_asyncio"
        ) from None
    check_settings(
        model,
        block_size,
        {
            "max_batch": max_batch,
            "max_waiting": max_waiting,
            "prefill_chunk": prefill_chunk,
            "lookahead": lookahead,
        },
        {"max_context": max_context, "max_num_batched_tokens": max_num_batched_tokens},
        drain_timeout,
        kv_budget,
        cpu_quantize,
        {
            "prefix_cache": prefix_cache,
            "batch_ladder": batch_ladder,
            "offline": offline,
            "keep_dtype": keep_dtype,
            "think_split": think_split,
        },
        {"warm_up": warm_up},
        on_progress,
    )
    thread = shared_mlx_thread()
    load = functools.partial(
        load_model,
        model,
        offline=offline,
        keep_dtype=keep_dtype,
        cpu_quantize=cpu_quantize,
        on_progress=on_progress,
    )
    # Loading, filling the KV pool (seconds for a large one) and timing the ladder are
    # abandoned on cancel, so a signal during start-up stops the server at once; the
    # MLX thread finishes the call and drops what it built.
    loaded = await thread.run(load, abandon_on_cancel=True)
    engine = await thread.run(
        functools.partial(
            Engine,
            loaded,
            max_batch=max_batch,
            max_context=max_context,
            kv_budget=kv_budget,
            block_size=block_size,
            num_snapshots=None if prefix_cache else 0,
        ),
        abandon_on_cancel=True,
    )
    if batch_ladder:
        engine.ladder = await thread.run(
            functools.partial(measure_ladder, engine.model, loaded.config.num_hidden_layers, max_batch),
            abandon_on_cancel=True,
        )
        log.info("batch_ladder", **engine.ladder.describe())
    kv = engine.kv
    recurrent = {}
    if engine.states is not None:  # a hybrid model's prefix hits resume from state snapshots
        recurrent = {
            "recurrent_state_bytes": engine.recurrent_bytes,
            "state_snapshots": engine.num_snapshots,
            "state_snapshot_bytes": engine.snapshot_bytes,
        }
    log.info(
        "kv_pool",
        block_size=kv.block_size,
        num_blocks=kv.num_blocks,
        bytes=kv.nbytes,
        tokens=engine.kv_tokens,
        prefix_cache=prefix_cache,
        **recurrent,  # max_batch rows' linear-attention states and snapshots, off the same budget
    )
    if kv.layout.is_windowed:  # what the windows save on the longest row
        windowed, full = kv.row_bytes(engine.max_context)
        log.info(
            "kv_windows",
            layers=kv.layout.describe(),
            row_tokens=engine.max_context,
            row_bytes=windowed,
            row_bytes_all_layers_full=full,
        )
    if engine.max_context < engine.model_max_context:
        log.warning(
            "context_capped_by_kv_budget",
            max_context=engine.max_context,
            asked=engine.model_max_context,
        )
    pool = BlockPool(
        kv.num_blocks,
        kv.block_size,
        salt=_cache_salt(loaded),
        is_caching=prefix_cache,
        layout=kv.layout,
    )
    # An explicit budget is a hard cap: a prompt alone does not grow past it either.
    if max_num_batched_tokens is None:
        budget, solo = max_batch + prefill_chunk, DEFAULT_SOLO_PREFILL_TOKENS
    else:
        budget, solo = max_num_batched_tokens, min(DEFAULT_SOLO_PREFILL_TOKENS, max_num_batched_tokens)
    snapshots = SnapshotBook(engine.num_snapshots) if prefix_cache and engine.num_snapshots else None
    policy = FcfsScheduler(
        max_batch, pool, engine.max_context, prefill_chunk, budget, solo, snapshots=snapshots
    )
    warm = await thread.run(
        functools.partial(warm_up_steps, engine, policy, warm_up, on_progress),
        abandon_on_cancel=True,
    )
    if warm is not None:
        log.info("warm_up", **attrs.asdict(warm))
    async with run_actors(
        thread, loaded, engine, policy, max_waiting, drain_timeout, lookahead, think_split
    ) as llm:
        yield llm


@contextlib.asynccontextmanager
async def run_actors(
    thread: MlxThread,
    loaded: LoadedModel,
    engine: Engine,
    policy: FcfsScheduler,
    max_waiting: int = 64,
    drain_timeout: float | None = None,
    lookahead: int = 1,
    think_split: bool = True,
) -> AsyncIterator[LLM]:
    """Serve an already-built engine (`open_llm` without the loading)."""
    if lookahead < 1:  # the GPU actor collects step N only once N+1 is queued
        raise ValueError(f"lookahead must be at least 1, got {lookahead}")
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            llm = await _start_actors(
                nursery, thread, loaded, engine, policy, max_waiting, lookahead, think_split
            )
            try:
                yield llm
                await llm.drain(drain_timeout)
            except BaseException as error:  # stop the actors, then re-raise it unwrapped
                body_error = error  # (the block's, or a Ctrl-C or cancellation while draining)
                llm.is_draining = True
                nursery.cancel_scope.cancel()
    except BaseException as exit_error:
        # An actor's failure wins (the block's error most likely came of it), but not
        # a cancellation: a reader in an outer nursery, failing as the actors stopped,
        # cancelled it while they wound down, and the block's own error (a Ctrl-C too)
        # was lost under "the service stopped".
        if body_error is None or not _is_cancellation(exit_error):
            raise
    if body_error is not None:
        raise body_error


def _is_cancellation(error: BaseException) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return error.split(trio.Cancelled)[1] is None
    return isinstance(error, trio.Cancelled)


async def _start_actors(
    nursery: trio.Nursery,
    thread: MlxThread,
    loaded: LoadedModel,
    engine: Engine,
    policy: FcfsScheduler,
    max_waiting: int,
    lookahead: int,
    think_split: bool,
) -> LLM:
    # Every buffer is bounded. Admission's and the scheduler's hold all that can be
    # outstanding (a Submit and an Abort per request, a StepDone per plan in flight),
    # and the GPU's every plan in flight with its Idles: so the scheduler and the
    # GPU, which send to each other, never wait on each other. The streamer's is small.
    admit_send, admit_recv = trio.open_memory_channel[Admit](max_waiting)
    sched_send, sched_recv = trio.open_memory_channel[SchedulerMessage](
        2 * (max_waiting + policy.max_batch) + lookahead + 3
    )
    gpu_send, gpu_recv = trio.open_memory_channel[GpuMessage](2 * lookahead + 3)
    stream_send, stream_recv = trio.open_memory_channel[StreamerMessage](16)
    waiting_slots = trio.Semaphore(max_waiting)
    metrics = Metrics(loaded.name, policy)
    tool_style = tool_style_for(loaded.tokenizer.tool_use_template_source, loaded.config.model_type)
    # Harmony's and Gemma 4's replies have reasoning markup of their own.
    thinks = think_split and tool_style not in REASONING_STYLES
    tags = think_tags(loaded.tokenizer, loaded.config.model_type) if thinks else None
    admission = Admission(
        loaded.tokenizer,
        engine.max_context,
        loaded.config.vocab_size,
        engine.kv_bound,
        admit_recv,
        sched_send.clone(),
        stream_send.clone(),
        waiting_slots,
        GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, engine.eos_ids),
        tool_style,
        metrics=metrics,
        think_tags=tags,
    )
    actors = (
        Streamer(
            loaded.tokenizer,
            stream_recv,
            sched_send.clone(),
            metrics,
            engine.eos_ids,
            tool_style,
            tags,
        ),
        GpuActor(
            PlanRunner(engine),
            thread,
            gpu_recv,
            stream_send,
            sched_send.clone(),
            lookahead=lookahead,
        ),
        SchedulerActor(policy, sched_recv, gpu_send, waiting_slots, metrics, lookahead=lookahead),
        admission,
    )
    for actor in actors:  # downstream first, so each one's consumer is already up
        await nursery.start(actor.run)
    return LLM(loaded.name, engine, policy, thread, admission, admit_send, sched_send, metrics)
