"""`cadence generate` and `cadence serve`, run as a user would: in a subprocess."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time

from runtime.errors import CadenceError

import pytest
import trio

from actors import cli
from actors.cors import CorsPolicy

CLI = [sys.executable, "-m", "actors.cli"]


def run_cli(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_generate_streams_text_to_stdout_and_keeps_stderr_quiet(tiny):
    result = run_cli("generate", "Hello", "--model", str(tiny), "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and result.stderr == ""


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


def test_api_keys_come_from_flags_the_environment_and_the_file(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# the team's\nfrom-file\n\n   # an indented comment is a comment\n")
    monkeypatch.setenv("CADENCE_API_KEY", "from-env")
    args = cli._parser().parse_args(["serve", "--api-key", "flag", "--api-key-file", str(keys)])
    assert cli._api_keys(args) == ["flag", "from-env", "from-file"]
    for bad in ("", "a b"):
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


def test_flags_at_their_bounds_are_taken_and_reach_the_app(monkeypatch):
    options = serve_until_loading(
        monkeypatch,
        *("--max-batch", "8", "--max-num-batched-tokens", "8"),  # a token per decoding row
        *("--max-waiting", "4", "--max-n", "4"),
        *("--allowed-origin", "https://app.example"),
    )
    assert options["max_n"] == 4
    assert options["cors"] == CorsPolicy(frozenset({"https://app.example"}))
