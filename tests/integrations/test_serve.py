"""``kvcanary serve`` under a real client: the ``openai`` package on loopback against
transformers' server guarded in a subprocess, on a tiny model built here (random weights, a
byte-level BPE tokenizer trained with ``tokenizers``, a chat template).

Clean load (concurrent streaming and plain chat and completions, shared prefixes, one-token
answers, long prompts prefilled in chunks, clients that leave mid-stream or before their
first token) gives 0 findings and whole responses; each fire drill is found at its HTTP request
and position, in the log, the findings endpoint and the metrics alike, and ``kvcanary
explain`` of the canary log names the same cause; SIGTERM and SIGINT drain and exit 0."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import time

import pytest

import skip_reasons

pytest.importorskip("torch", reason="needs torch (pip install 'kvcanary[serve]')")
transformers = pytest.importorskip("transformers", reason=skip_reasons.SERVE)
openai = pytest.importorskip("openai", reason=skip_reasons.SERVE)
pytest.importorskip("prometheus_client", reason=skip_reasons.SERVE)
pytest.importorskip("fastapi", reason=skip_reasons.SERVE)
pytest.importorskip("accelerate", reason=skip_reasons.SERVE + " (transformers[serving])")

from click.testing import CliRunner  # noqa: E402
from serve_support import Server, build_tiny_model, get_json, get_text  # noqa: E402

from kvcanary.cli import main  # noqa: E402

PAGE = 16
WORDS = ["the", "quick", "brown", "fox", "canary", "cache", "block", "server", "hello",
         "world", "key", "value", "paged", "shared", "lazy", "dog"]
SHARED = " ".join(WORDS * 3)          # a prefix every "shared" prompt starts with


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                              timeout=180)


def text(r: random.Random, n: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(n))


async def ask(c, model, i, *, chat, stream, prompt, max_tokens, leave_after=None):
    """One request; returns (finish_reason, tokens or chunks, error). ``leave_after``: the
    client closes the stream after that many chunks."""
    headers = {"x-request-id": f"req-{i}"}
    kw = dict(model=model, max_tokens=max_tokens, stream=stream, extra_headers=headers)
    if chat:
        call = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        call = c.completions.create(prompt=prompt, **kw)
    try:
        response = await call
        if not stream:
            choice = response.choices[0]
            return choice.finish_reason, response.usage.completion_tokens, None
        finish, chunks = None, 0
        async for chunk in response:
            if chunk.choices:
                chunks += 1
                finish = chunk.choices[0].finish_reason or finish
            if leave_after is not None and chunks >= leave_after:
                await response.close()
                return "left", chunks, None
        return finish, chunks, None
    except openai.APIError as exc:
        return None, 0, str(exc)


def whole(result, max_tokens, stream):
    finish, count, error = result
    if error is not None or finish not in ("stop", "length"):
        return False
    return stream or finish == "stop" or count == max_tokens


def summary(server):
    return get_json(server.url + "/kvcanary/summary")


def settled_summary(server, timeout: float = 30.0):
    """The summary once the engine has stopped stepping: requests whose clients left or were
    cancelled are still drained by the engine after the client side has returned."""
    deadline = time.monotonic() + timeout
    last = summary(server)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = summary(server)
        if now["steps"] == last["steps"]:
            return now
        last = now
    return last


def metric(server, name, **labels):
    total = 0.0
    pattern = re.compile(rf"^{name}(\{{[^}}]*\}})? (\S+)$")
    for line in get_text(server.url + "/metrics").splitlines():
        m = pattern.match(line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


# ------------------------------------------------------------------ clean load


@pytest.fixture(scope="module")
def clean_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("clean") / "server.log"
    server = Server(model_dir, "--sources", "kv-all", log_path=log,
                    serve_options=("--cb-max-batch-tokens", "96"))
    yield server
    server.stop()


def test_concurrent_clients_clean_and_whole(clean_server, model_dir):
    r = random.Random(0)

    async def load():
        c = client(clean_server)
        jobs, kinds = [], []
        for i in range(72):
            chat, stream = bool(i % 2), bool(i // 2 % 2)
            max_tokens = 1 if i % 9 == 0 else r.randrange(4, 12)
            if i % 3 == 0:
                prompt = SHARED + " " + text(r, 4)                # a shared prefix
            elif i % 11 == 0:
                prompt = text(r, 180)                             # prefilled in chunks
            else:
                prompt = text(r, r.randrange(3, 30))
            leave = 2 if stream and i % 7 == 0 else None          # leaves mid-stream
            jobs.append(asyncio.ensure_future(ask(c, model_dir, i, chat=chat, stream=stream,
                                                  prompt=prompt, max_tokens=max_tokens,
                                                  leave_after=leave)))
            kinds.append((stream, max_tokens, leave))
        gone = [asyncio.ensure_future(ask(c, model_dir, 1000 + i, chat=False, stream=True,
                                          prompt=text(r, 20), max_tokens=30))
                for i in range(8)]
        await asyncio.sleep(1.0)            # sent, and queued behind the load above
        for job in gone:                                          # cancelled while queued
            job.cancel()
        results = await asyncio.gather(*jobs)
        await asyncio.gather(*gone, return_exceptions=True)
        await c.close()
        return results, kinds

    async def one_more():
        # Requests whose clients left are cancelled by the server, possibly after the engine's
        # last step; the guard drops what it kept for them after the next step it guards.
        c = client(clean_server)
        result = await ask(c, model_dir, 2000, chat=False, stream=False, prompt=text(r, 5),
                           max_tokens=2)
        await c.close()
        return result

    results, kinds = asyncio.run(load())
    broken = [(i, res) for i, (res, (stream, max_tokens, leave)) in enumerate(zip(results, kinds))
              if leave is None and not whole(res, max_tokens, stream)]
    assert not broken, broken[:5]
    settled_summary(clean_server)
    assert whole(asyncio.run(one_more()), 2, False)
    s = settled_summary(clean_server)
    assert s["findings"] == 0, get_json(clean_server.url + "/kvcanary/findings")["findings"][:3]
    assert s["steps"] > 10 and s["entries_verified"] > 0
    assert metric(clean_server, "kvcanary_steps_total") == s["steps"]
    assert metric(clean_server, "kvcanary_findings_total") == 0
    assert metric(clean_server, "kvcanary_guard_seconds_count") == s["steps"]
    # The whole load, cancelled ones included, has left the engine and the guard.
    assert s["requests_guarded"] >= 64
    assert s["guards"][0]["requests_tracked"] == 0


def test_sigterm_drains_in_flight_requests_and_exits_0(clean_server, model_dir):
    async def load():
        c = client(clean_server)
        jobs = [asyncio.ensure_future(ask(c, model_dir, 2000 + i, chat=bool(i % 2), stream=True,
                                          prompt=text(random.Random(i), 10), max_tokens=24))
                for i in range(8)]
        await asyncio.sleep(1.0)
        clean_server.proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*jobs)
        await c.close()
        return results

    results = asyncio.run(load())
    assert clean_server.proc.wait(timeout=90) == 0, clean_server.output()[-2000:]
    assert all(whole(res, 24, True) for res in results), results
    assert "serve stopped by SIGTERM" in clean_server.output()


# ------------------------------------------------------------------ fire drills

DRILLS = ("remap@6", "kv-flip@14", "position-shift@22", "free-held@30")


@pytest.fixture(scope="module")
def drilled(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("drills")
    server = Server(model_dir, "--canary-log", folder / "canary.log",
                    "--on-violation", "abort-request",
                    *[x for d in DRILLS for x in ("--drill", d)], log_path=folder / "server.log")

    async def load():
        c = client(server)
        r = random.Random(1)
        jobs = [ask(c, model_dir, i, chat=bool(i % 2), stream=bool(i % 3), max_tokens=24,
                    prompt=text(r, r.randrange(20, 40))) for i in range(40)]
        out = await asyncio.gather(*jobs)
        await c.close()
        return out

    results = asyncio.run(load())
    yield server, results, folder / "canary.log"
    server.stop()


def test_each_drill_is_found_at_its_http_request_and_position(drilled):
    server, results, _ = drilled
    fired = {d["kind"]: d for d in summary(server)["drills"] if d["fired_step"]}
    assert set(fired) == {d.split("@")[0] for d in DRILLS}, summary(server)["drills"]
    findings = get_json(server.url + "/kvcanary/findings")["findings"]
    for kind, d in fired.items():
        mine = [f for f in findings if f["http_request_id"] == d["request_id"]
                and f["first_step"] >= d["fired_step"]]
        if kind == "free-held":
            assert any(f["block"] == d["block"] for f in mine), (d, findings[:3])
        elif kind == "remap":
            assert any(d["position"] <= f["position"] < d["position"] + PAGE for f in mine), d
        else:
            assert any(f["position"] == d["position"] for f in mine), (d, mine[:3])
    assert "drill fired" in server.output() and "drill armed" in server.output()


def test_aborted_requests_are_exactly_those_with_findings(drilled):
    server, results, _ = drilled
    findings = get_json(server.url + "/kvcanary/findings")["findings"]
    with_findings = {f["http_request_id"] for f in findings}
    failed = {f"req-{i}" for i, (_, _, error) in enumerate(results) if error is not None}
    # A finding is made while its request is in flight, so its last output is the error.
    assert failed and failed == with_findings, (failed, with_findings)
    for i, res in enumerate(results):
        if f"req-{i}" not in with_findings:
            assert whole(res, 24, bool(i % 3)), (i, res)


def test_metrics_findings_and_canary_log_agree(drilled):
    server, _, log = drilled
    found = get_json(server.url + "/kvcanary/findings")
    blocks = log.read_text().count("\n  at: request=")
    assert found["total"] == len(found["findings"]) == blocks > 0
    assert metric(server, "kvcanary_findings_total") == found["total"]
    reason = "+".join(found["findings"][0]["reasons"])
    assert metric(server, "kvcanary_findings_total", reason=reason) == \
        sum("+".join(f["reasons"]) == reason for f in found["findings"])
    for f in found["findings"]:
        assert f"request={f['request_id']} position={f['position']}" in log.read_text()


# Per drill: what the guard's explanation says, and the causes kvcanary explain may give the
# same row from the log alone (a record that is another request's is one class of cause).
# A block freed while held and handed back to the same request is told by its facts only
# (whose record the slot holds); handed to another request, "freed ... then reused".
CAUSES = {"kv-flip": (("changed after they were written",), {"kv-bytes-changed"}),
          "position-shift": (("shifted by +1",), {"write-input"}),
          "remap": (("remapped",), {"record-changed", "overwritten", "position-changed",
                                    "shifted-mapping"}),
          "free-held": (("freed", "record of position"), {
              "record-changed", "overwritten", "position-changed", "shifted-mapping"})}


def test_explain_of_the_canary_log_names_the_same_cause(drilled):
    server, _, log = drilled
    findings = get_json(server.url + "/kvcanary/findings")["findings"]
    # Every finding: a drilled run under load can make more than the 50 shown by default.
    result = CliRunner().invoke(main, ["explain", str(log), "--format", "json",
                                       "--max-findings", "0"])
    assert result.exit_code == 1, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    explained = {(r["slot_idx"], r["position"], r["fail_reason"]): r for r in rows
                 if r.get("record") == "violation"}
    for d in summary(server)["drills"]:
        words, causes = CAUSES[d["kind"]]
        mine = [f for f in findings if f["http_request_id"] == d["request_id"] and
                f["violation"] and any(w in f["explanation"] for w in words)]
        assert mine, (d, [f["explanation"] for f in findings][:5])
        v = mine[0]["violation"]
        row = explained[(v["slot_idx"], v["position"], v["fail_reason"])]
        assert row["diagnosis"]["cause"] in causes, (d["kind"], row["likely_cause"])


def test_sigint_drains_and_exits_0(drilled):
    server, _, _ = drilled
    assert server.signal(signal.SIGINT, timeout=90) == 0, server.output()[-2000:]
    assert "serve stopped by SIGINT" in server.output()


def test_bad_options_exit_2(model_dir):
    runner = CliRunner()
    result = runner.invoke(main, ["serve", model_dir, "--drill", "melt@3"])
    assert result.exit_code == 2 and "drill 'melt@3'" in result.output
    result = runner.invoke(main, ["serve", model_dir, "--sources", "k9"])
    assert result.exit_code == 2 and "sources" in result.output


def test_on_violation_exit_fails_the_requests_in_flight_and_exits_1(model_dir, tmp_path):
    server = Server(model_dir, "--on-violation", "exit", "--drill", "kv-flip@3",
                    "--canary-log", tmp_path / "canary.log", log_path=tmp_path / "server.log")
    try:
        async def load():
            c = client(server)
            r = random.Random(2)
            out = await asyncio.gather(*[
                ask(c, model_dir, i, chat=False, stream=bool(i % 2), max_tokens=40,
                    prompt=text(r, 30)) for i in range(12)])
            await c.close()
            return out

        results = asyncio.run(load())
        assert server.proc.wait(timeout=90) == 1, server.output()[-2000:]
    finally:
        server.stop()
    assert any(error is not None for _, _, error in results), results
    # Full-length answers would have outlived the finding: none of them came back whole.
    assert not any(res[:2] == ("length", 40) for res in results), results
    assert "kv_canary violation:" in (tmp_path / "canary.log").read_text()
    assert "serve stopped by a finding" in server.output()


SOAK_REQUESTS, SOAK_WARM = 5000, 500


def test_soak_keeps_the_servers_memory_flat(model_dir, tmp_path):
    """5,000 requests: the server's RSS after them is within 5% of where it was after the
    first 500 (what the guard keeps per finished request is dropped). About 80 s on two
    cores, so it runs in the default suite."""
    psutil = pytest.importorskip("psutil", reason=skip_reasons.transformers_extra("psutil"))
    server = Server(model_dir, "--sources", "kv-all", log_path=tmp_path / "server.log")
    try:
        process = psutil.Process(server.proc.pid)

        async def wave(c, start, count):
            r = random.Random(start)
            sem = asyncio.Semaphore(64)

            async def one(i):
                async with sem:
                    return await ask(c, model_dir, i, chat=bool(i % 2), stream=bool(i % 3),
                                     max_tokens=2, prompt=text(r, r.randrange(2, 24)))
            return await asyncio.gather(*[one(i) for i in range(start, start + count)])

        async def load():
            c = client(server)
            first = await wave(c, 0, SOAK_WARM)
            warm = process.memory_info().rss
            rest = await wave(c, SOAK_WARM, SOAK_REQUESTS - SOAK_WARM)
            await c.close()
            return first + rest, warm, process.memory_info().rss

        results, warm, end = asyncio.run(load())
        s = summary(server)
    finally:
        server.stop()
    assert all(error is None for _, _, error in results)
    assert s["findings"] == 0 and s["requests_guarded"] >= SOAK_REQUESTS
    assert s["guards"][0]["requests_tracked"] == 0
    print(f"soak: RSS {warm / 2**20:.1f} MiB after {SOAK_WARM}, {end / 2**20:.1f} MiB after "
          f"{SOAK_REQUESTS} ({(end / warm - 1) * 100:+.2f}%)")
    assert end <= warm * 1.05, (warm, end)


def test_kvcanary_and_its_cli_import_none_of_the_serving_packages():
    import subprocess
    import sys

    code = ("import sys, kvcanary, kvcanary.cli\n"
            "from click.testing import CliRunner\n"
            "assert CliRunner().invoke(kvcanary.cli.main, ['serve', '--help']).exit_code == 0\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'fastapi', 'uvicorn', "
            "'prometheus_client', 'transformers', 'torch', 'openai', 'starlette'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
