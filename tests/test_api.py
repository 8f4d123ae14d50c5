"""The OpenAI-compatible server, through the official `openai` client against a live uvicorn server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

import sluice
from sluice.api.app import create_app
from common import DEVICE

MODEL = "tiny"
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


class LiveServer:
    """create_app on uvicorn in a thread. tokenizer: instead of the store's; script: replaces the engine's steps
    (tests/test_tools.Script: canned replies); app: more create_app keywords."""

    def __init__(self, store, snapshot_bytes=1 << 30, context=None, template=None, schedule="overlap", tokenizer=None,
                 script=None, **app):
        self.engine = sluice.load(store, device=DEVICE, schedule=schedule)
        tok = tokenizer or AutoTokenizer.from_pretrained(store)
        if template:
            tok.chat_template = template
        if script is not None:
            self.engine.extend = script
        app = create_app(self.engine, tok, MODEL, snapshot_bytes=snapshot_bytes, context=context, prefill_chunk=8, **app)
        self.sock = socket.socket()  # bound here and handed to uvicorn: no other process can take the port meanwhile
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        self.engine.close()

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def server(stores):
    s = LiveServer(stores["nemotron_h_latent"], context=512)
    yield s
    s.close()


@pytest.fixture(scope="module")
def fresh_server(stores):
    """The same model with no snapshots: every request starts from scratch."""
    s = LiveServer(stores["nemotron_h_latent"], snapshot_bytes=0, context=512)
    yield s
    s.close()


def chat(s, messages, stream=False, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    if not stream:
        r = s.client.chat.completions.create(model=MODEL, messages=messages, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = [], None, None
    for chunk in s.client.chat.completions.create(model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, usage


def test_stream_and_non_stream_give_the_same_greedy_text(server):
    msgs = [{"role": "user", "content": "Tell me about rivers."}]
    a, fa, ua = chat(server, msgs)
    b, fb, ub = chat(server, msgs, stream=True)
    assert a == b and fa == fb and ua.completion_tokens == ub.completion_tokens > 0
    assert ua.prompt_tokens > 0 and ua.total_tokens == ua.prompt_tokens + ua.completion_tokens
    extra = ua.model_extra["sluice"]
    assert sum(extra["expert_bytes"].values()) > 0 and 0 <= extra["hit_rate"] <= 1


def test_usage_counts_the_direct_schedules_blocks(stores, tmp_path):
    """Under `direct` through the Triton kernels a one-token step counts its blocks per tier on the GPU; a reply's
    usage still has them: every decode step's K blocks in each MoE layer, besides the prompt's."""
    import yaml

    from sluice.pipeline.schedule import SCHEDULES_DIR

    doc = yaml.safe_load((SCHEDULES_DIR / "direct.yaml").read_text())
    doc["stages"]["compute"]["backend"] = "triton"
    path = tmp_path / "direct-triton.yaml"
    path.write_text(yaml.safe_dump(doc))
    srv = LiveServer(stores["nemotron_h"], schedule=str(path), snapshot_bytes=0)  # no snapshot: both requests prefill

    def blocks(max_tokens):
        r = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens,
                                               temperature=0)
        return sum(r.usage.model_extra["sluice"]["expert_bytes"].values()) // m.block_bytes, r.usage.completion_tokens

    try:
        m = srv.engine.store.manifest
        prompt_only, n1 = blocks(1)  # the prompt's blocks (counted on the host), no decode step
        both, n = blocks(6)
        assert n1 == 1 and n > 1 and both - prompt_only == (n - 1) * m.top_k * len(srv.engine.store.moe_layers)
    finally:
        srv.close()


def test_concurrent_requests_match_one_at_a_time(server):
    prompts = [[{"role": "user", "content": f"Question number {i}: {'why ' * i}?"}] for i in range(5)]
    one_by_one = [chat(server, p, max_tokens=10)[0] for p in prompts]
    with ThreadPoolExecutor(5) as pool:
        together = list(pool.map(lambda p: chat(server, p, stream=True, max_tokens=10)[0], prompts))
    assert together == one_by_one


def test_concurrent_requests_decode_in_shared_steps(stores):
    """With --max-batch, requests that are decoding share steps (one MoE pass over their rows): /metrics shows the
    batch, and each reply is the one it gets alone."""
    s = LiveServer(stores["nemotron_h_latent"], context=512, max_batch=4)  # prompt chunks of 8 tokens join the batches
    try:
        prompts = [[{"role": "user", "content": f"Question number {i}: {'why ' * i}?"}] for i in range(5)]
        one_by_one = [chat(s, p, max_tokens=10)[0] for p in prompts]
        with ThreadPoolExecutor(5) as pool:
            together = list(pool.map(lambda p: chat(s, p, stream=True, max_tokens=10)[0], prompts))
        assert together == one_by_one
        assert s.metric("sluice_decode_batch") > 1 and s.metric("sluice_expert_bytes_per_token") > 0
    finally:
        s.close()


def test_snapshot_follow_up_equals_a_fresh_run(server, fresh_server):
    first = [{"role": "user", "content": "Hello there."}]
    reply, _, _ = chat(server, first, max_tokens=16)
    follow = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    warm, _, usage = chat(server, follow, max_tokens=16)
    cold, _, cold_usage = chat(fresh_server, follow, max_tokens=16)
    assert usage.prompt_tokens_details.cached_tokens > 0 and cold_usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert warm == cold
    assert server.metric("sluice_snapshots") >= 1


def test_disconnect_mid_stream_cancels_and_frees(server):
    before = server.metric('sluice_requests_total{status="cancelled"}')
    ok_before = server.metric('sluice_requests_total{status="ok"}')
    # greedy: a sampled reply can end (EOS) before the client has left, and then nothing is cancelled
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 400, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines >= 3:
                break  # leave mid-stream
    deadline = time.time() + 30
    while server.metric('sluice_requests_total{status="cancelled"}') <= before:
        finished = server.metric('sluice_requests_total{status="ok"}') - ok_before  # 1: the reply ran to its end first
        assert time.time() < deadline, f"the server did not notice the disconnect (requests finished normally meanwhile: {finished:.0f})"
        time.sleep(0.1)
    assert server.metric("sluice_active_requests") == 0
    assert chat(server, [{"role": "user", "content": "still there?"}], max_tokens=3)[1] == "length"


def test_stop_sequences_and_finish_reasons(server):
    text, finish, _ = chat(server, [{"role": "user", "content": "List things."}], max_tokens=20)
    assert finish == "length" and len(text) > 3
    stop = text[2:4]
    cut, finish, _ = chat(server, [{"role": "user", "content": "List things."}], max_tokens=20, stop=[stop])
    assert finish == "stop" and cut == text[: text.find(stop)]


def test_completions_and_models(server):
    r = server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert r.choices[0].text == streamed and r.usage.completion_tokens == 8
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("sluice_generated_tokens_total", "sluice_time_to_first_token_seconds_bucket", "sluice_expert_hit_rate",
                 'sluice_expert_bytes_total{tier="disk"}', "sluice_stall_seconds_per_token", "sluice_decode_tokens_per_second"):
        assert name in metrics, name


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "'gpt-9' does not exist"),
        ({"model": MODEL}, 400, "'messages' must be a non-empty list"),
        ({"model": MODEL, "messages": []}, 400, "'messages' must be a non-empty list"),
        ({"model": MODEL, "messages": "hi"}, 400, "'messages' must be a non-empty list"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "'role' must be one of"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "'content' must be a string"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "'temperature' must be"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "'max_tokens' is out of range"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 2}, 400, "'top_p' is out of range"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, 400, "context"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10000}, 400, "exceeds the context"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "takes no images"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
         400, "audio input is not supported"),
        ({"model": MODEL, "prompt": ""}, 400, "'prompt' must be a non-empty string"),
    ],
)
def test_bad_input_gets_openai_errors(server, body, status, needle):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_openai_client_raises_on_bad_input(server):
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 700}])


def test_reasoning_model_id_splits_thinking(stores):
    s = LiveServer(stores["nemotron_h_latent"], template=THINK_TEMPLATE, context=512)
    try:
        assert [m.id for m in s.client.models.list().data] == [MODEL, MODEL + "-think"]
        r = s.client.chat.completions.create(model=MODEL + "-think", messages=[{"role": "user", "content": "hm"}], max_tokens=10, temperature=0)
        msg = r.choices[0].message
        assert msg.model_extra.get("reasoning_content")  # the template opened <think>: the text so far is reasoning
        plain = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hm"}], max_tokens=10, temperature=0)
        assert plain.choices[0].message.content and not plain.choices[0].message.model_extra.get("reasoning_content")
        chunks = s.client.chat.completions.create(model=MODEL + "-think", messages=[{"role": "user", "content": "hm"}], max_tokens=10, temperature=0, stream=True)
        streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
        assert streamed == msg.model_extra["reasoning_content"]
    finally:
        s.close()


@pytest.mark.skipif(not shutil.which("chromium"), reason="Debian's chromium is not installed (.ci/run installs it)")
def test_chat_page_streams_in_headless_chromium(server, tmp_path):
    """The chat page (?q= sends a first message) streams the reply and shows its usage under it (speed, cached
    prompt tokens, expert hit rate); its input sits at the bottom of the window, with no blank space below, and
    stays there when the conversation outgrows the window (the conversation scrolls above it)."""
    from chromium import Chromium

    browser = Chromium(tmp_path / "profile", 900, 700)
    try:
        browser.open(server.url + "/?q=Hello%20page&max_tokens=8")
        done = "new Promise(ok => { const t = setInterval(() => { if (document.getElementById('status').textContent === 'done') " \
               "{ clearInterval(t); ok(true); } }, 50); })"
        assert browser.evaluate(done)
        assert browser.evaluate("document.querySelector('.msg.user').textContent") == "Hello page"
        usage = browser.evaluate("[...document.querySelectorAll('.msg.assistant .usage')].map(u => u.textContent)")
        assert len(usage) == 1 and usage[0].startswith("8 tokens · ") and " tok/s · first token " in usage[0], usage
        assert "prompt tokens cached · expert hit rate " in usage[0] and usage[0].endswith("%"), usage
        bottom = "[document.getElementById('form').getBoundingClientRect().bottom, window.innerHeight]"
        form, height = browser.evaluate(bottom)
        assert height > 500 and height - 40 < form <= height, (form, height)  # not mid-screen
        for i in range(3):  # more replies than the window holds
            browser.evaluate(f"document.getElementById('status').textContent = ''; send('Tell me more, part {i}.')")
            assert browser.evaluate(done)
        assert browser.evaluate("document.querySelectorAll('.msg.assistant .usage').length") == 4
        assert browser.evaluate("document.getElementById('scroll').scrollHeight > document.getElementById('scroll').clientHeight")
        form, height = browser.evaluate(bottom)
        assert height - 40 < form <= height and browser.evaluate("document.documentElement.scrollHeight") == height
    finally:
        browser.close()


def test_one_json_log_line_per_request(stores, capsys):
    """--log-format json: each request is one JSON line on stderr with its id, model, status, tokens (prompt, cached,
    generated), time to first token and duration: replies streamed or not, a follow-up served from a snapshot, and a
    request refused before any work."""
    import json

    s = LiveServer(stores["nemotron_h_latent"], context=512, log_format="json")
    try:
        capsys.readouterr()
        first = [{"role": "user", "content": "Hello there."}]
        reply, _, _ = chat(s, first, max_tokens=6)
        r = s.client.chat.completions.create(model=MODEL, messages=first + [{"role": "assistant", "content": reply},
                                             {"role": "user", "content": "More?"}], max_tokens=4, temperature=0)
        streamed = chat(s, first, stream=True, max_tokens=5)
        assert httpx.post(s.url + "/v1/chat/completions", json={"model": "nope", "messages": first}).status_code == 404
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 400, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as response:
            for n, _ in enumerate(response.iter_lines()):
                if n >= 4:
                    break  # leave mid-stream
        err, deadline = "", time.time() + 30
        while err.count('"event": "request"') < 5:
            assert time.time() < deadline, err
            time.sleep(0.1)
            err += capsys.readouterr().err
    finally:
        s.close()
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    requests = [x for x in lines if x["event"] == "request"]
    assert len(requests) == 5, lines
    one, follow, stream, refused, left = requests
    assert left["status"] == "cancelled" and left["generated_tokens"] < 400 and left["finish_reason"] is None
    for x in (one, follow, stream):
        assert x["id"].startswith("chatcmpl-") and x["model"] == MODEL and x["status"] == "ok" and x["http_status"] == 200
        assert 0 < x["time_to_first_token_s"] <= x["duration_s"] and x["finish_reason"] == "length" and "timestamp" in x
    assert one["id"] != stream["id"] and one["generated_tokens"] == 6 and stream["generated_tokens"] == 5
    assert follow["id"] == r.id and follow["prompt_tokens"] == r.usage.prompt_tokens and follow["cached_tokens"] > 0
    assert follow["cached_tokens"] == r.usage.prompt_tokens_details.cached_tokens and one["cached_tokens"] == 0
    assert refused["status"] == "rejected" and refused["http_status"] == 404 and "'nope' does not exist" in refused["error"]
    assert streamed[2].model_extra["sluice"]["decode_tokens_per_s"] > 0 and streamed[2].model_extra["sluice"]["time_to_first_token_s"] > 0
