"""`cadence generate` and `cadence serve`, run as a user would: in a subprocess."""

import argparse
import contextlib
import errno
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

from runtime.cpu_weights import DEFAULT_CPU_QUANTIZE
from runtime.errors import CadenceError

import pytest
import structlog
import trio
import trio.testing
from structlog.testing import capture_logs

from actors import cli
from actors.choices import DEFAULT_MAX_N
from actors.cors import CorsPolicy
from actors.http_app import ServerState

CLI = [sys.executable, "-m", "actors.cli"]


def run_cli(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_generate_streams_text_to_stdout_and_keeps_stderr_quiet(tiny):
    result = run_cli("generate", "Hello", "--model", str(tiny), "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and result.stderr == ""


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_generate_runs_with_stdout_or_stderr_closed_by_its_launcher(tiny, closed):
    """Python has None for a stream closed at exec (`>&-`): logging's isatty() (stderr)
    or the first write (stdout) raised, after or before the model loaded."""
    command = [*CLI, "generate", "Hello", "--model", str(tiny), "--max-tokens", "8"]
    other = "stderr" if closed == "stdout" else "stdout"
    fd = 1 if closed == "stdout" else 2
    # The child's descriptor is closed after the fork, before the exec, as `>&-` does.
    result = subprocess.run(
        command,
        capture_output=False,
        **{other: subprocess.PIPE},
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(fd),
    )
    assert result.returncode == 0
    if closed == "stderr":
        assert result.stdout.strip()  # the text came out
    else:
        assert result.stderr == ""  # no traceback


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "Hello", "--model", "/no/such/checkpoint"],
        ["generate", "Hello", "--temperature", "9", "--model", "{tiny}"],
        ["generate", "Hello", "--max-tokens", "5000", "--model", "{tiny}"],
        ["generate", "Hello", "--max-tokens", "zero"],
        ["serve", "--port", "-5", "--model", "{tiny}"],
        ["serve", "--api-key-file", "/no/such/keys", "--model", "{tiny}"],
        ["serve", "--api-key", "", "--model", "{tiny}"],
        ["serve", "--allowed-origin", "example.com/x", "--model", "{tiny}"],
        ["serve", "--max-batch", "8", "--max-num-batched-tokens", "4", "--model", "{tiny}"],
        ["serve", "--max-n", "0", "--model", "{tiny}"],
        ["serve", "--max-n", "9", "--max-waiting", "4", "--model", "{tiny}"],
        ["serve", "--block-size", "100000000", "--model", "{tiny}"],
    ],
    ids=[
        "bad-model",
        "bad-temperature",
        "too-long",
        "bad-int",
        "bad-port",
        "no-key-file",
        "empty-key",
        "bad-origin",
        "budget-below-batch",
        "n-of-0",
        "n-above-the-queue",
        "huge-block",  # crashed the process (SIGSEGV) while the pool was allocated
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_status_2(tiny, args):
    result = run_cli(*[a.format(tiny=tiny) for a in args])
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and "error" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_prompt_argument_that_is_not_utf8_is_named_in_one_line(tiny):
    # "\udcff" reaches the subprocess as the byte 0xFF (os.fsencode), as a shell passes it.
    result = run_cli("generate", "a\udcff", "--max-tokens", "2", "--model", str(tiny))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "cadence: error: the prompt holds a lone surrogate, U+DCFF (byte 0xFF, which is not"
        " UTF-8): it is not valid Unicode text"
    )


def test_an_empty_model_is_refused_not_read_as_the_current_directory():
    result = run_cli("generate", "Hello", "--model", "")
    assert result.returncode == 2 and result.stderr.strip().endswith("--model: must not be empty")


@pytest.mark.parametrize(
    ("content", "said"),
    [(b"", "holds no keys"), (b"# only a comment\n\n", "holds no keys"), (b"\xff\xfe", "not UTF-8")],
    ids=["empty", "comments-only", "binary"],
)
def test_a_key_file_without_keys_is_refused_not_served_open(tmp_path, content, said):
    """An empty --api-key-file started the server with no authentication at all. The
    bad origin after it is checked later: it is what fails were the key check gone."""
    keys = tmp_path / "keys"
    keys.write_bytes(content)
    result = run_cli("serve", "--api-key-file", str(keys), "--allowed-origin", "example.com/x")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and said in result.stderr


# Each case ends with a second bad flag: were the first one's check gone, argparse would
# name that one instead of running a server or a load (the test would fail, not hang).
@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--drain-timeout", "nan", "--port", "-1"],
        ["bench", "serve", "--clients", "4", "0", "--max-batch", "0"],
        ["bench", "serve", "--requests", "0", "--max-batch", "0"],
        ["bench", "serve", "--rate", "-2", "--max-batch", "0"],
        ["bench", "serve", "--shared-prefix", "1.5", "--max-batch", "0"],
        ["bench", "serve", "--timeout", "inf", "--max-batch", "0"],
        ["bench", "soak", "--fault", "2", "--requests", "0"],
        ["bench", "soak", "--concurrency", "0", "--requests", "0"],
    ],
    ids=lambda args: "-".join(args[:3]),
)
def test_a_bad_number_is_refused_by_its_flag_before_anything_starts(args):
    result = run_cli(*args)
    first_flag = next(a for a in args if a.startswith("--"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"argument {first_flag}: " in result.stderr


def events_until(process, name):
    events = []
    for line in process.stderr:
        events.append(json.loads(line))
        if events[-1]["event"] == name:
            return events
    raise AssertionError(f"no {name!r} event; got {events}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_logs_its_address_and_drains_in_flight_streams_on_a_signal(tiny, signum):
    process = subprocess.Popen(
        [*CLI, "serve", "--model", str(tiny), "--port", "0", "--log-format", "json"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        events = events_until(process, "ready")
        assert any(e["event"] == "loading" for e in events)
        host, port = events[-1]["url"].removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        body = {
            "model": tiny.name,
            "prompt": "Hi",
            "max_tokens": 300,
            "stream": True,
            "ignore_eos": True,
        }
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.readline().startswith(b"data: ")
        process.send_signal(signum)  # drain: the running stream still completes
        rest = response.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
        started = time.monotonic()
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - started < 10
        drained = events_until(process, "stopped")
        requested = [e for e in drained if e["event"] == "shutdown requested"]
        assert [e["signal"] for e in requested] == [signal.Signals(signum).name]
        assert drained[-1]["event"] == "stopped"
    finally:
        if process.poll() is None:
            process.kill()


def test_serve_with_a_max_context_beyond_the_model_exits_2_with_one_error_line(tiny):
    result = run_cli("serve", "--model", str(tiny), "--port", "0", "--max-context", "99999")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("cadence: error: max_context 99999")
    assert "Traceback" not in result.stderr


def test_a_stream_outliving_the_drain_timeout_ends_with_an_error_event_and_done(tiny):
    serve = ["serve", "--model", str(tiny), "--port", "0", "--log-format", "json"]
    process = subprocess.Popen(
        [*CLI, *serve, "--drain-timeout", "0.3"], stderr=subprocess.PIPE, text=True
    )
    try:
        events = events_until(process, "ready")
        host, port = events[-1]["url"].removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        body = {
            "model": tiny.name,
            "prompt": "Hi",
            "max_tokens": 1000,
            "stream": True,
            "ignore_eos": True,
        }  # ~2 s of tokens: far longer than the 0.3 s drain
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.readline().startswith(b"data: ")
        process.send_signal(signal.SIGTERM)
        events = [e.strip() for e in response.read().split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]"
        last = json.loads(events[-2].removeprefix(b"data: "))
        assert set(last) == {"error"} and last["error"]["message"]
        assert all(e.startswith(b"data: ") for e in events)  # nothing cut mid-chunk
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_serve_takes_an_api_key_from_the_environment(tiny):
    serve = ["serve", "--model", str(tiny), "--port", "0", "--log-format", "json"]
    env = {**os.environ, "CADENCE_API_KEY": "from-env"}
    process = subprocess.Popen([*CLI, *serve], stderr=subprocess.PIPE, text=True, env=env)
    try:
        events = events_until(process, "ready")
        host, port = events[-1]["url"].removeprefix("http://").rsplit(":", 1)

        def status(headers):
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            connection.request("GET", "/v1/models", headers=headers)
            return connection.getresponse().status

        assert status({}) == 401
        assert status({"Authorization": "Bearer from-env"}) == 200
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_serve_with_a_small_max_waiting_starts_and_caps_n_to_it(tiny):
    """--max-n left unset follows a --max-waiting below its default instead of refusing it."""
    serve = ["serve", "--model", str(tiny), "--port", "0", "--log-format", "json"]
    process = subprocess.Popen(
        [*CLI, *serve, "--max-waiting", "4"], stderr=subprocess.PIPE, text=True
    )
    try:
        events = events_until(process, "ready")
        host, port = events[-1]["url"].removeprefix("http://").rsplit(":", 1)

        def status_for(n):
            body = json.dumps({"model": tiny.name, "prompt": "Hi", "max_tokens": 1, "n": n})
            connection = http.client.HTTPConnection(host, int(port), timeout=60)
            connection.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            return response.status, json.loads(response.read())

        ok = status_for(4)
        assert ok[0] == 200, ok
        status, error = status_for(5)
        assert status == 400 and error["error"]["param"] == "n"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_a_key_file_that_is_no_regular_file_or_too_big_is_refused_without_reading_it(
    tmp_path, monkeypatch
):
    """A FIFO with no writer hung the start-up, and /dev/zero filled the memory."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"k" * (cli.MAX_API_KEY_FILE_BYTES + 1))
    # (Not /dev/zero: were the check gone, the test would fill the memory as it did.)
    for file, said in [(big, "MiB, no key file"), (fifo, "not a regular file")]:
        args = cli._parser().parse_args(["serve", "--api-key-file", str(file)])
        with pytest.raises(CadenceError, match=said):
            cli._api_keys(args)


@pytest.mark.parametrize("text", ["\ufeffkey-1\r\nkey-2\r\n", "\ufeff# ours\r\nkey-1\r\nkey-2"])
def test_a_key_file_saved_with_a_byte_order_mark_reads_its_keys(tmp_path, text):
    """Notepad saves UTF-8 with a BOM: it was read into the first line, and the file
    refused as holding a key that is not ASCII."""
    keys = tmp_path / "keys.txt"
    keys.write_bytes(text.encode())
    args = cli._parser().parse_args(["serve", "--api-key-file", str(keys)])
    assert cli._api_keys(args) == ["key-1", "key-2"]


def test_an_empty_host_is_refused_not_every_interface():
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--host", ""])


def test_api_keys_come_from_flags_the_environment_and_the_file(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# the team's\nfrom-file\n\n   # an indented comment is a comment\n")
    monkeypatch.setenv("CADENCE_API_KEY", "from-env")
    args = cli._parser().parse_args(["serve", "--api-key", "flag", "--api-key-file", str(keys)])
    assert cli._api_keys(args) == ["flag", "from-env", "from-file"]
    for bad in ("", "a b", "a\tb", "clé", "a\x01b"):
        with pytest.raises(CadenceError, match="no whitespace"):
            cli._api_keys(cli._parser().parse_args(["serve", "--api-key", bad]))


def test_serve_listens_on_loopback_and_reuses_prompt_prefixes_unless_told():
    args = cli._parser().parse_args(["serve"])
    assert (args.host, args.prefix_cache) == ("127.0.0.1", True)
    assert not cli._parser().parse_args(["serve", "--no-prefix-cache"]).prefix_cache


def serve_until_loading(monkeypatch, *argv):
    """`cadence serve ARGV` in this process until it would load the model: the options
    its app was built with (a refused flag raises its CadenceError)."""
    built = []

    def create_app(state, **options):
        built.append(options)
        return real_create_app(state, **options)

    def open_llm(*args, **kwargs):
        raise CadenceError("loading")

    real_create_app = cli.create_app
    monkeypatch.setattr(cli, "create_app", create_app)
    monkeypatch.setattr(cli, "open_llm", open_llm)
    args = cli._parser().parse_args(["serve", "--port", "0", *argv])
    try:
        trio.run(cli._serve, args)
    except BaseException as error:  # trio wraps it in a group
        if str(cli._leaf(error, CadenceError)) != "loading":
            raise
    return built[0]


def test_no_think_split_reaches_the_model_s_service(monkeypatch):
    """`--no-think-split` leaves a <think> model's thought in content: open_llm is told."""
    loaded = []

    def open_llm(*args, **kwargs):
        loaded.append(kwargs)
        raise CadenceError("loading")

    monkeypatch.setattr(cli, "open_llm", open_llm)
    for argv, expected in ((["--no-think-split"], False), ([], True)):
        args = cli._parser().parse_args(["serve", "--port", "0", *argv])
        try:
            trio.run(cli._serve, args)
        except BaseException as error:  # trio wraps it in a group
            if str(cli._leaf(error, CadenceError)) != "loading":
                raise
        assert loaded.pop()["think_split"] is expected


def test_flags_at_their_bounds_are_taken_and_reach_the_app(monkeypatch):
    options = serve_until_loading(
        monkeypatch,
        *("--max-batch", "8", "--max-num-batched-tokens", "8"),  # a token per decoding row
        *("--max-waiting", "4", "--max-n", "4"),
        *("--allowed-origin", "https://app.example"),
    )
    assert options["max_n"] == 4
    assert options["cors"] == CorsPolicy(frozenset({"https://app.example"}))


async def after_signals(state, *signums):
    """(shutdown set, everything cancelled) once `_watch_signals` has taken SIGNUMS."""
    shutdown = trio.Event()
    everything = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        await nursery.start(cli._watch_signals, state, shutdown, everything)
        for signum in signums:
            os.kill(os.getpid(), signum)
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return shutdown.is_set(), everything.cancel_called


async def test_a_signal_while_the_model_loads_stops_at_once_instead_of_draining():
    assert await after_signals(ServerState(), signal.SIGTERM) == (False, True)


async def test_a_first_signal_drains_and_a_second_one_stops_at_once():
    state = ServerState(llm=object())
    assert await after_signals(state, signal.SIGTERM) == (True, False)
    assert await after_signals(state, signal.SIGTERM, signal.SIGTERM) == (True, True)


class FakeGeneration:
    def __init__(self, texts):
        self.texts = texts

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        return None

    async def __aiter__(self):
        for text in self.texts:
            yield types.SimpleNamespace(text=text)


def test_generate_sends_the_chat_prompt_and_sampling_flags_and_ends_with_a_newline(
    monkeypatch, capsys
):
    calls = []

    class Llm:
        def generate(self, *args, **kwargs):
            calls.append((args, kwargs))
            return FakeGeneration(["Hel", "lo"])

    @contextlib.asynccontextmanager
    async def open_llm(*args, **kwargs):
        yield Llm()

    monkeypatch.setattr(cli, "open_llm", open_llm)
    argv = ["generate", "Hi", "--chat", "--max-tokens", "5", "--seed", "7", "--top-k", "3"]
    with capture_logs():  # unconfigured, structlog would print to stdout
        trio.run(cli._generate, cli._parser().parse_args(argv))
    assert capsys.readouterr().out == "Hello\n"
    sampling = dict(temperature=0.0, top_p=1.0, top_k=3, min_p=0.0, seed=7)
    messages = [{"role": "user", "content": "Hi"}]
    assert calls == [((), dict(messages=messages, max_tokens=5, **sampling))]


@pytest.mark.parametrize(
    ("raised", "status", "said"),
    [
        (OSError(errno.EADDRINUSE, "Address already in use"), 2, "Address already in use"),
        (KeyboardInterrupt(), 130, ""),
    ],
    ids=["os-error", "interrupt"],
)
def test_an_os_error_is_one_line_and_exit_2_and_an_interrupt_exit_130(
    monkeypatch, capsys, raised, status, said
):
    async def serve(args):
        async with trio.open_nursery():  # as a real failure comes: in a group
            raise raised

    monkeypatch.setattr(cli, "_serve", serve)
    try:
        assert cli.main(["serve"]) == status
    finally:
        structlog.reset_defaults()  # main configured logging
    stderr = capsys.readouterr().err
    assert stderr == (f"cadence: error: {said}\n" if said else "")


def test_max_n_left_unset_is_the_default_or_a_lower_max_waiting(monkeypatch):
    assert serve_until_loading(monkeypatch)["max_n"] == DEFAULT_MAX_N
    assert serve_until_loading(monkeypatch, "--max-waiting", "4")["max_n"] == 4


def test_on_loopback_the_server_answers_its_own_host_names_only(monkeypatch):
    """A keyless server on 127.0.0.1 answered any Host: a web page whose own name the
    attacker rebinds to 127.0.0.1 read the API (DNS rebinding, as Ollama's CVE-2024-28224)."""
    names = ("MyBox", "box.lan.:8000", "[fe80::1]")
    named = [arg for name in names for arg in ("--allowed-host", name)]
    loopback = serve_until_loading(monkeypatch, *named)["allowed_hosts"]
    assert loopback == {"localhost", "127.0.0.1", "::1", "mybox", "box.lan", "fe80::1"}
    everywhere = serve_until_loading(monkeypatch, "--host", "0.0.0.0")  # exposed on purpose
    assert everywhere["allowed_hosts"] is None
    # Loopback however it is spelled keeps the guard (an exact-string test let these by).
    for host, own in (("LOCALHOST", "localhost"), ("127.0.0.2", "127.0.0.2"), ("[::1]", "::1"),
                      ("::ffff:127.0.0.1", "::ffff:127.0.0.1")):
        guarded = serve_until_loading(monkeypatch, "--host", host)["allowed_hosts"]
        assert guarded == {"localhost", "127.0.0.1", "::1", own}, host


def test_a_host_that_is_no_name_is_argparses_one_line_error(capsys):
    """A byte that is not UTF-8 (a lone surrogate here) failed in the socket's bind, as a traceback."""
    for host in ("\udcff", "a" * 64):
        with pytest.raises(SystemExit):
            cli._parser().parse_args(["serve", "--host", host])
        assert "is no host name or address" in capsys.readouterr().err


def test_keep_dtype_beside_cpu_quantize_is_refused_not_ignored(monkeypatch, capsys):
    """--keep-dtype replaces the --cpu-quantize policy: `--keep-dtype --cpu-quantize 4`
    loaded the stored weights as they were, the 4 silently dropped."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--keep-dtype", "--cpu-quantize", "4"])
    assert exited.value.code == 2
    assert "--keep-dtype keeps the stored weights; it takes no --cpu-quantize" in capsys.readouterr().err
    loads = []

    def open_llm(*args, **kwargs):
        loads.append((kwargs["keep_dtype"], kwargs["cpu_quantize"]))
        raise CadenceError("loading")

    monkeypatch.setattr(cli, "open_llm", open_llm)
    for argv in ([], ["--keep-dtype"], ["--cpu-quantize", "8"]):
        for command in (["serve", "--port", "0"], ["generate", "hi"]):
            args = cli._parser().parse_args([*command, *argv])
            with pytest.raises(BaseException) as raised:  # trio wraps it in a group
                trio.run(args.run, args)
            assert str(cli._leaf(raised.value, CadenceError)) == "loading"
    assert loads == [(False, DEFAULT_CPU_QUANTIZE)] * 2 + [(True, DEFAULT_CPU_QUANTIZE)] * 2 + [(False, "8")] * 2


def test_a_host_no_resolver_knows_is_named_in_the_one_line_error(monkeypatch, capsys):
    async def serve(args):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(cli, "_serve", serve)
    try:
        assert cli.main(["serve", "--host", "bad host"]) == 2
    finally:
        structlog.reset_defaults()  # main configured logging
    assert capsys.readouterr().err == "cadence: error: --host 'bad host': Name or service not known\n"


def http_cap_of(monkeypatch, *argv):
    """The cap on HTTP requests in flight that `cadence serve ARGV` starts its server with."""
    caps = []

    async def serve_http(*args, max_requests, **kwargs):
        caps.append(max_requests)
        raise CadenceError("stopped")

    monkeypatch.setattr(cli, "serve_http", serve_http)
    args = cli._parser().parse_args(["serve", "--port", "0", *argv])
    with pytest.raises(BaseException) as raised:  # trio wraps it in a group
        trio.run(cli._serve, args)
    assert str(cli._leaf(raised.value, CadenceError)) == "stopped"
    return caps[0]


def test_the_http_cap_is_twice_what_the_engine_holds_unless_given(monkeypatch):
    assert http_cap_of(monkeypatch) == 2 * (16 + 64)
    assert http_cap_of(monkeypatch, "--max-batch", "4", "--max-waiting", "8") == 24
    assert http_cap_of(monkeypatch, "--max-http-requests", "5") == 5
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--max-http-requests", "0"])


def test_a_signal_once_ready_marks_the_server_draining_and_drains_the_model_in_time(
    monkeypatch,
):
    """The HTTP server outwaits the engine's drain, so streams it aborts still end well."""
    states, seen = [], {}
    real_create_app, real_serve_http = cli.create_app, cli.serve_http

    def create_app(state, **options):
        states.append(state)
        return real_create_app(state, **options)

    async def serve_http(*args, **kwargs):
        seen["graceful_timeout"] = kwargs["graceful_timeout"]
        await real_serve_http(*args, **kwargs)

    class Llm:
        name, max_batch, max_context = "fake", 1, 8

        async def drain(self, timeout):
            seen["drain"] = (states[0].is_draining, timeout)

    async def signal_once_idle():
        await trio.testing.wait_all_tasks_blocked()  # ready, waiting for shutdown
        os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.asynccontextmanager
    async def open_llm(*args, **kwargs):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(signal_once_idle)
            yield Llm()

    monkeypatch.setattr(cli, "create_app", create_app)
    monkeypatch.setattr(cli, "serve_http", serve_http)
    monkeypatch.setattr(cli, "open_llm", open_llm)
    args = cli._parser().parse_args(["serve", "--port", "0", "--drain-timeout", "2.5"])
    with capture_logs():
        trio.run(cli._serve, args)
    assert seen["drain"] == (True, 2.5)
    assert seen["graceful_timeout"] > 2.5


def test_main_returns_the_exit_status_of_a_synchronous_command(tmp_path, capsys):
    argv = ["trace", "timeline", str(tmp_path / "no.log"), "-o", str(tmp_path / "t.png")]
    try:
        status = cli.main(argv)
    finally:
        structlog.reset_defaults()  # main configured logging
    assert status == 2 and capsys.readouterr().err.startswith("cadence: error: ")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["bench", "soak", "--model", "{missing}"], "no such directory"),
        (
            ["bench", "serve", "--url", "http://127.0.0.1:1", "--checkpoint", "{missing}"],
            "missing: no such directory",
        ),
    ],
    ids=["soak-model", "serve-checkpoint"],
)
def test_a_bench_with_a_missing_checkpoint_is_one_line_and_exit_2(tmp_path, capsys, argv, said):
    missing = tmp_path / "missing"
    try:
        status = cli.main([a.format(missing=missing) for a in argv])
    finally:
        structlog.reset_defaults()  # main configured logging
    stderr = capsys.readouterr().err
    assert status == 2
    assert stderr.startswith("cadence: error: ") and said in stderr
    assert len(stderr.splitlines()) == 1


def test_every_serve_flag_says_what_it_does_in_help():
    serve = next(
        action.choices["serve"]
        for action in cli._parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    undocumented = [a.option_strings for a in serve._actions if a.option_strings and not a.help]
    assert undocumented == []
