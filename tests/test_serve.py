"""`hippo serve` live on 127.0.0.1, driven by the real `openai` client (tiny float64 checkpoints).

One server process serves the whole module (starting one costs seconds): concurrent requests,
streamed or not, about two videos, each token-identical to the target's own `generate`; a seeded
sampled request that reproduces whatever shares its batch; bad requests answered with OpenAI's
error JSON and the right status, after which the server is still healthy; a flood past the queue
answered 429 with Retry-After; a client that disconnects mid-stream freeing its row; and last,
SIGTERM draining the request in flight and exiting 0.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hippo
from hippo.media.inputs import load_video_inputs

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("av")
from tiny_checkpoint import save_checkpoint, write_video  # noqa: E402

MAX_PIXELS = 3136
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERIAL = ("--scheduler", "serial", "--gamma", "3")


def launch(
    env: dict, port: int, *extra: str, deadline: float = 120, scheduler: tuple[str, ...] = SERIAL
) -> tuple[subprocess.Popen, object]:
    """`hippo serve` on the module's tiny pair at `port` (with `extra` options; `scheduler`: its
    flags, () to take it from a --config file), once /health answers: (the process, an openai
    client)."""
    cmd = [
        sys.executable,
        "-m",
        "hippo.cli",
        "serve",
        "--target",
        str(env["target"]),
        "--draft",
        str(env["draft"]),
        "--max-pixels",
        str(MAX_PIXELS),
        "--max-new-tokens",
        "8",
        *scheduler,
        "--media-dir",
        str(env["media"]),
        "--port",
        str(port),
        "--max-batch",
        "4",
        "--max-queue",
        "6",
        "--served-model-name",
        MODEL,
        "--drain",
        "20",
        "--prefill-chunk",  # a new video's prefill in pieces: the equality tests cover them
        "8",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    until = time.time() + deadline
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > until:
            proc.kill()
            pytest.fail(f"the server did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return proc, openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny float64 pair and the videos (two under the media directory, one outside it)."""
    root = tmp_path_factory.mktemp("serve")
    media = root / "media"
    media.mkdir()
    return {
        "target": save_checkpoint(root / "target", dtype=torch.float64),
        "draft": save_checkpoint(root / "draft", role="draft", seed=1, dtype=torch.float64),
        "long": write_video(media / "long.mp4", n=16, fps=8),
        "short": write_video(media / "short.mp4", n=8, fps=8),
        "outside": write_video(root / "outside.mp4", n=8, fps=8),
        "media": media,
    }


#: the tests of the one live server run on one worker, so it starts once (about 10 s)
ONE_SERVER = pytest.mark.xdist_group("server")


@pytest.fixture(scope="module")
def server(files):
    port = _free_port()
    proc, client = launch(files, port)
    env = {**files, "proc": proc, "base": f"http://127.0.0.1:{port}", "client": client}
    yield env
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def messages(video: Path, question: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": f"file://{video}"}},
                {"type": "text", "text": question},
            ],
        }
    ]


def ask(server, video, question, stream=False, **kw):
    """(text, hippo extras, finish_reason) through the openai client."""
    client = server["client"]
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages(video, question), **kw)
        return r.choices[0].message.content, r.model_extra["hippo"], r.choices[0].finish_reason, r.usage
    text, last = [], None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages(video, question), stream=True, **kw
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        last = chunk
    return "".join(text), last.model_extra["hippo"], last.choices[0].finish_reason, last.usage


@ONE_SERVER
def test_concurrent_answers_equal_the_targets_own(server):
    """Six requests at once (two videos, streamed and not, other frame counts, a second question on
    a video already prepared): each answer's tokens are `target.generate`'s on that prompt alone."""
    pipe = (
        hippo.PipelineBuilder().target(str(server["target"]), dtype=torch.float64).scheduler("autoregressive")
    )
    pipe = pipe.build()
    cases = [
        ("long", "describe the video .", False, {}),
        ("short", "what happens ?", True, {}),
        ("long", "is there a red square ?", True, {"max_tokens": 5}),
        ("short", "describe the video .", False, {"extra_body": {"frames": 4}}),
        ("long", "what happens ?", False, {"temperature": 0}),
        ("short", "what happens ?", False, {"stop": ["zzz"]}),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(ask, server, server[v], q, s, **kw) for v, q, s, kw in cases]
        answers = [f.result() for f in futures]
    for (video, question, _, kw), (text, extra, finish, usage) in zip(cases, answers):
        frames = kw.get("extra_body", {}).get("frames")
        inputs = load_video_inputs(
            pipe.target_adapter, server[video], question, frames=frames, max_pixels=MAX_PIXELS
        )
        L = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            ref = pipe.target.generate(**inputs, max_new_tokens=kw.get("max_tokens", 8), do_sample=False)
        assert extra["token_ids"] == ref[0, L:].tolist(), (video, question)
        assert usage.prompt_tokens == L and usage.completion_tokens == len(extra["token_ids"])
        assert finish in ("stop", "length") and text == pipe_text(server, extra["token_ids"])
    metrics = httpx.get(f"{server['base']}/metrics").text
    assert 'hippo_requests_total{status="ok"}' in metrics and "hippo_batch_size" in metrics


def pipe_text(server, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(server["target"])).decode(ids, skip_special_tokens=True)


@ONE_SERVER
def test_a_seeded_sample_reproduces_whatever_shares_its_batch(server):
    sampled = {"temperature": 1.5, "seed": 11, "max_tokens": 8}
    alone = ask(server, server["short"], "what happens ?", **sampled)[1]["token_ids"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        crowd = [pool.submit(ask, server, server["long"], "describe the video .", True) for _ in range(2)]
        again = pool.submit(ask, server, server["short"], "what happens ?", **sampled)
        assert again.result()[1]["token_ids"] == alone
        [f.result() for f in crowd]


@ONE_SERVER
@pytest.mark.parametrize(
    "body, status, param",
    [
        ("{not json", 400, None),
        ("[" * 100_000 + "]" * 100_000, 400, None),  # nested past the parser's recursion limit
        ({"model": "other", "messages": "M"}, 404, "model"),
        ({"model": MODEL, "messages": "OUTSIDE"}, 403, "messages[0].content[0].video_url.url"),
        ({"model": MODEL, "messages": "MISSING"}, 400, "messages[0].content[0].video_url.url"),
        ({"model": MODEL, "messages": "HTTP"}, 403, "messages[0].content[0].video_url.url"),
        ({"model": MODEL, "messages": "IMAGE"}, 400, "messages[0].content[1].type"),
        ({"model": MODEL, "messages": "NOVIDEO"}, 400, "messages[0].content"),
        ({"model": MODEL, "messages": "M", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "messages": "M", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": "M", "frames": 100000}, 400, None),  # more frames than the video has
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": "NUL"}, 400, "messages[0].content[0].video_url.url"),
        ({"model": MODEL, "messages": "NULPCT"}, 400, "messages[0].content[0].video_url.url"),
        ({"model": MODEL, "messages": "LONGPATH"}, 400, "messages[0].content[0].video_url.url"),
        ({"model": MODEL, "messages": "LATESYSTEM"}, 400, "messages[1]"),
        ({"model": MODEL, "messages": "M", "logit_bias": {"7": 5}}, 400, "logit_bias"),
        ({"model": MODEL, "messages": "M", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"model": MODEL, "messages": "M", "frequency_penalty": 1}, 400, "frequency_penalty"),
        (
            {"model": MODEL, "messages": "M", "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        ({"model": MODEL, "messages": "M", "tools": [{"type": "function"}]}, 400, "tools"),
        ({"model": MODEL, "messages": "M", "tool_choice": "auto"}, 400, "tool_choice"),
        ({"model": MODEL, "messages": "M", "n": 2}, 400, "n"),
        ({"model": MODEL, "messages": "M", "no_such_field": 1}, 400, "no_such_field"),
        ({"model": MODEL, "messages": "M", "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": MODEL, "messages": "M", "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"model": MODEL, "messages": "M", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"model": MODEL, "messages": "M", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": MODEL, "messages": [1]}, 400, "messages[0]"),
        ({"model": MODEL, "messages": "HOSTURL"}, 400, "messages[0].content[0].video_url.url"),
        ({"model": MODEL, "messages": "TEXTNOTSTR"}, 400, "messages[0].content[1].text"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(server, body, status, param):
    video = f"file://{server['short']}"
    parts = {
        "M": messages(server["short"], "what happens ?"),
        "OUTSIDE": messages(server["outside"], "what happens ?"),
        "MISSING": messages(server["media"] / "nope.mp4", "what happens ?"),
        "HTTP": [
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}]}
        ],
        "IMAGE": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": video}},
                    {"type": "image_url", "image_url": {"url": video}},
                ],
            }
        ],
        "NOVIDEO": [{"role": "user", "content": "hi"}],
        "NUL": messages(Path(f"{server['media']}/a\x00b.mp4"), "what happens ?"),
        "NULPCT": messages(Path(f"{server['media']}/a%00b.mp4"), "what happens ?"),
        "LONGPATH": messages(server["media"] / ("x" * 5000 + ".mp4"), "what happens ?"),
        "HOSTURL": [  # file://clip.mp4: a host, not a file
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file://short.mp4"}}]}
        ],
        "TEXTNOTSTR": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": video}},
                    {"type": "text", "text": [1]},
                ],
            }
        ],
        "LATESYSTEM": [
            *messages(server["short"], "what happens ?"),
            {"role": "system", "content": "be brief"},
        ],
    }
    if isinstance(body, dict) and isinstance(body.get("messages"), str):
        body = {**body, "messages": parts[body["messages"]]}
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{server['base']}/v1/chat/completions", content=data, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    assert httpx.get(f"{server['base']}/health").json() == {"status": "ok"}


@ONE_SERVER
def test_unreadable_paths_leave_the_connection_to_the_next_request(server):
    """A NUL byte or a name over the OS's limit in the URL: a 400 with OpenAI's JSON, and the same
    keep-alive connection answers the next request."""
    url = f"{server['base']}/v1/chat/completions"
    with httpx.Client(timeout=120) as http:
        for name in ("a\x00b.mp4", "a%00b.mp4", "x" * 5000 + ".mp4", "d/" * 3000 + "v.mp4"):
            r = http.post(url, json={"model": MODEL, "messages": messages(server["media"] / name, "what ?")})
            assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
        r = http.post(url, json={"model": MODEL, "messages": messages(server["short"], "what happens ?")})
        assert r.status_code == 200, r.text


def reference(server, video, question, system=None, max_new_tokens=8, **gen):
    """(prompt length, HF generate's greedy tokens, its raw logits cast to float32 [n, V])."""
    from hippo.conversation import Prompt

    pipe = (
        hippo.PipelineBuilder().target(str(server["target"]), dtype=torch.float64).scheduler("autoregressive")
    )
    pipe = pipe.build()
    prompt = Prompt(question, system) if system else question
    inputs = load_video_inputs(pipe.target_adapter, video, prompt, max_pixels=MAX_PIXELS)
    L = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = pipe.target.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, **gen,
        )  # fmt: skip
    return L, out.sequences[0, L:].tolist(), torch.cat(out.logits)


@ONE_SERVER
def test_system_and_developer_messages_are_the_chat_templates_system_turn(server):
    client = server["client"]
    for msgs, system in [
        ([{"role": "system", "content": "this is a red square ."}], "this is a red square ."),
        (
            [
                {"role": "developer", "content": [{"type": "text", "text": "this is"}]},
                {"role": "system", "content": "a bright bar ."},
            ],
            "this is\na bright bar .",
        ),
    ]:
        r = client.chat.completions.create(
            model=MODEL, messages=[*msgs, *messages(server["long"], "what happens ?")], max_tokens=8
        )
        L, tokens, _ = reference(server, server["long"], "what happens ?", system)
        assert r.model_extra["hippo"]["token_ids"] == tokens and r.usage.prompt_tokens == L
    plain = reference(server, server["long"], "what happens ?")[0]
    assert plain < L  # the system turn is in the prompt


@ONE_SERVER
def test_logprobs_are_the_targets_own_streamed_and_not(server):
    """logprobs / top_logprobs: each token's log-prob under the target and its top alternatives, as
    log_softmax of HF generate's raw logits (which it returns in float32: within 1e-6)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(server["target"]))
    _, tokens, logits = reference(server, server["short"], "describe the video .")
    lp = torch.log_softmax(logits.double(), -1)  # [n, V]
    client = server["client"]
    kw = dict(model=MODEL, messages=messages(server["short"], "describe the video ."), max_tokens=8)
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    for content in (whole, streamed):
        assert [c.token for c in content] == [tok.decode([t]) for t in tokens]
        for i, (c, t) in enumerate(zip(content, tokens)):
            assert c.logprob == pytest.approx(float(lp[i, t]), abs=1e-6)
            top = lp[i].topk(2)
            assert [a.token for a in c.top_logprobs] == [tok.decode([x]) for x in top.indices.tolist()]
            assert [a.logprob for a in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-6)
            assert c.bytes == list(c.token.encode())
    r = client.chat.completions.create(logprobs=True, **kw).choices[0].logprobs.content
    assert all(c.top_logprobs == [] for c in r) and len(r) == len(tokens)
    assert client.chat.completions.create(**kw).choices[0].logprobs is None


@ONE_SERVER
def test_fields_without_semantics_are_ignored_and_stream_options_honoured(server):
    client = server["client"]
    kw = dict(model=MODEL, messages=messages(server["short"], "what happens ?"), max_tokens=4)
    r = client.chat.completions.create(user="u1", presence_penalty=0, logit_bias={}, **kw)
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    # repetition_penalty (an extra field, as vLLM takes it) reaches the target's logits processors
    r = client.chat.completions.create(extra_body={"repetition_penalty": 1.5}, **{**kw, "max_tokens": 8})
    _, tokens, _ = reference(server, server["short"], "what happens ?", repetition_penalty=1.5)
    assert r.model_extra["hippo"]["token_ids"] == tokens


@ONE_SERVER
def test_a_non_streamed_client_that_disconnects_frees_its_row(server):
    """max_tokens far past the context is clamped to it (the row would decode ~4000 tokens); the
    client hangs up: its row is cancelled, not decoded to the end."""
    body = {"model": MODEL, "messages": messages(server["long"], "describe the video ."), "max_tokens": 10**6}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server['base']}/v1/chat/completions", json=body, timeout=3)
    deadline = time.time() + 30
    while True:
        metrics = httpx.get(f"{server['base']}/metrics").text
        if 'hippo_requests_total{status="disconnected"}' in metrics and "hippo_batch_size 0.0" in metrics:
            break
        assert time.time() < deadline, metrics
        time.sleep(0.1)


def test_api_key_and_allowed_hosts(files, monkeypatch):
    """--allowed-hosts: another Host header gets a 400; the API key (here from HIPPO_API_KEY): /v1
    without it or with another gets a 401 with OpenAI's JSON, /health needs none."""
    port = _free_port()
    monkeypatch.setenv("HIPPO_API_KEY", "s3cret")
    proc, _ = launch(files, port, "--allowed-hosts", "127.0.0.1,*.example.com")
    base = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(f"{base}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = httpx.get(f"{base}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{base}/v1/models", headers=ok).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers={**ok, "Host": "api.example.com"}).status_code == 200
        r = httpx.get(f"{base}/v1/models", headers={**ok, "Host": "evil.com"})
        assert r.status_code == 400 and "Host" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        r = client.chat.completions.create(
            model=MODEL, messages=messages(files["short"], "what happens ?"), max_tokens=2
        )
        assert r.choices[0].message.content is not None
    finally:
        proc.kill()
        proc.wait()


@ONE_SERVER
def test_a_flood_past_the_queue_gets_429_and_the_rest_are_answered(server):
    def one(_):
        r = httpx.post(
            f"{server['base']}/v1/chat/completions",
            timeout=120,
            json={
                "model": MODEL,
                "messages": messages(server["long"], "describe the video ."),
                "max_tokens": 8,
            },
        )
        return r.status_code, r.headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 4, codes
    assert all(retry == "1" for c, retry in results if c == 429)


@ONE_SERVER
def test_a_client_that_disconnects_frees_its_row(server):
    body = {
        "model": MODEL,
        "messages": messages(server["long"], "describe the video ."),
        "max_tokens": 8,
        "stream": True,
    }
    with httpx.stream("POST", f"{server['base']}/v1/chat/completions", json=body) as r:
        next(r.iter_lines())  # the first chunk, then hang up
    deadline = time.time() + 30
    while True:
        metrics = httpx.get(f"{server['base']}/metrics").text
        if "hippo_batch_size 0.0" in metrics:
            break
        assert time.time() < deadline, metrics
        time.sleep(0.1)
    assert httpx.get(f"{server['base']}/health").json() == {"status": "ok"}


@ONE_SERVER
def test_sigterm_drains_the_request_in_flight_and_exits_0(server):
    """Last: SIGTERM once a streamed answer has started (its first chunk read); it still ends whole,
    with its finish reason and [DONE], then the process exits 0."""
    proc = server["proc"]
    body = {
        "model": MODEL,
        "messages": messages(server["long"], "describe the video ."),
        "max_tokens": 64,
        "stream": True,
    }
    chunks = []
    with httpx.stream("POST", f"{server['base']}/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                chunks.append(line)
                break  # the row is live now
        proc.send_signal(signal.SIGTERM)
        chunks += [line for line in lines if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    last = json.loads(chunks[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and last["hippo"]["token_ids"]
    assert proc.wait(timeout=60) == 0
    if os.name == "posix":
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server['base']}/health", timeout=2)


def _descendants(pid: int) -> list[str]:
    """The command lines of a process's descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            out.append((Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
        todo += children.get(child, [])
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the draft process from /proc")
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_hippo_serves_concurrent_clients_with_its_draft_beside_the_target(files, tmp_path, executor):
    """`hippo serve` with `hippo` (from a --config file): concurrent clients, streamed and not, are
    decoded together with the draft drafting each row's next block beside the target, on a thread
    or with the rows in the draft process; every answer is `target.generate`'s on its prompt alone."""
    options = (
        'executor = "inline"\nexecutor_options = { overlap = "thread" }'
        if executor == "thread"
        else 'executor = "process"\nexecutor_options = { timeout = 60 }'
    )
    config = tmp_path / "pipeline.toml"
    config.write_text(f'[scheduler]\nname = "hippo"\ngamma = 3\n{options}\n')
    port = _free_port()
    proc, client = launch(files, port, "--config", str(config), scheduler=())
    env = {**files, "client": client}
    try:
        cases = [("long", "describe the video .", False), ("short", "what happens ?", True)] * 2
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(lambda c: ask(env, files[c[0]], c[1], c[2]), cases))
        drafts = [c for c in _descendants(proc.pid) if "forkserver" in c]
        assert bool(drafts) == (executor == "process"), drafts
    finally:
        proc.kill()
        proc.wait()
    target = (
        hippo.PipelineBuilder().target(str(files["target"]), dtype=torch.float64).scheduler("autoregressive")
    )
    target = target.build()
    for (video, question, _), (_, extra, finish, _) in zip(cases, answers):
        inputs = load_video_inputs(target.target_adapter, files[video], question, max_pixels=MAX_PIXELS)
        L = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            ref = target.target.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert extra["token_ids"] == ref[0, L:].tolist(), (video, question)
        assert finish in ("stop", "length") and extra["mat"] is not None


@pytest.mark.slow
def test_ray_serve_replicas_answer_as_one_process_does(files):
    """`hippo serve --ray`: the same app on a Ray Serve replica behind Ray's HTTP proxy; answers,
    streamed or not, are `target.generate`'s, errors are the app's own, and SIGTERM exits 0."""
    pytest.importorskip("ray.serve")
    port = _free_port()
    proc, client = launch(files, port, "--ray", "--ray-num-cpus", "1", "--replicas", "1", deadline=180)
    env = {**files, "proc": proc, "base": f"http://127.0.0.1:{port}", "client": client}
    try:
        target = hippo.PipelineBuilder().target(str(files["target"]), dtype=torch.float64)
        pipe = target.scheduler("autoregressive").build()
        for video, question, stream in (
            ("short", "what happens ?", False),
            ("long", "describe the video .", True),
        ):
            _, extra, finish, _ = ask(env, files[video], question, stream)
            inputs = load_video_inputs(pipe.target_adapter, files[video], question, max_pixels=MAX_PIXELS)
            L = inputs["input_ids"].shape[1]
            with torch.inference_mode():
                ref = pipe.target.generate(**inputs, max_new_tokens=8, do_sample=False)
            assert extra["token_ids"] == ref[0, L:].tolist() and finish in ("stop", "length"), video
        outside = httpx.post(
            f"{env['base']}/v1/chat/completions",
            json={"model": MODEL, "messages": messages(files["outside"], "what happens ?")},
            timeout=60,
        )
        assert outside.status_code == 403, outside.text
        assert outside.json()["error"]["param"] == "messages[0].content[0].video_url.url"
        # a non-streamed client hangs up behind Ray's proxy: Serve cancels the request and the
        # replica frees its row (max_tokens is clamped to the context, ~4000 tokens), as one process does
        body = {
            "model": MODEL,
            "messages": messages(files["long"], "describe the video ."),
            "max_tokens": 10**6,
        }
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{env['base']}/v1/chat/completions", json=body, timeout=3)
        deadline = time.time() + 60
        while True:
            metrics = httpx.get(f"{env['base']}/metrics", timeout=10).text
            if 'hippo_requests_total{status="disconnected"}' in metrics and "hippo_batch_size 0.0" in metrics:
                break
            assert time.time() < deadline, metrics[-2000:]
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
    assert rc == 0, proc.stderr.read()[-2000:]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--ray",), "--ray needs Ray Serve, which is not installed"),
        (("--ray", "--replicas", "0"), "--replicas must be >= 1, got 0"),
        (("--ray", "--ray-num-cpus", "0"), "a replica needs some resources"),
    ],
)
def test_ray_serve_usage_errors(files, extra, message, monkeypatch, capsys):
    """`hippo serve --ray` without Ray Serve names the extra; bad replica options are named; exit 2."""
    from hippo.cli.main import main

    if extra == ("--ray",):
        monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    else:
        pytest.importorskip("ray.serve")
    argv = ["serve", "--target", str(files["target"]), "--media-dir", str(files["media"]), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hippo: error: ") and message in err, err
    if extra == ("--ray",):
        assert "pip install 'hippo[serve-ray]'" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--prefill-seconds", "-1"), "--prefill-seconds must be >= 0 seconds"),
        (("--prefill-seconds", "inf"), "--prefill-seconds must be >= 0 seconds"),
        (("--prefill-chunk", "-1"), "--prefill-chunk must be >= 0 tokens"),
    ],
)
def test_serve_prefill_options_are_checked(files, extra, message, capsys):
    """A bad prefill option is named before a model loads; exit 2."""
    from hippo.cli.main import main

    argv = ["serve", "--target", str(files["target"]), "--media-dir", str(files["media"]), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hippo: error: ") and message in err, err


def _answer(ticket) -> tuple[str, object]:
    while True:
        kind, *rest = ticket.events.get(timeout=120)
        if kind in ("end", "error"):
            return kind, rest[0]


def test_new_videos_are_prepared_one_per_round_while_rows_are_live(files):
    """In process: while a row is live, requests about new videos are prepared one between two rounds
    (the live rows wait for one video's prefill per round at most), and a question on a prepared video
    joins at once; every request is answered."""
    from tiny_checkpoint import tiny_tokenizer

    from hippo.service import Request, Service

    pipe = hippo.PipelineBuilder().target(str(files["target"]), dtype=torch.float64)
    videos = [write_video(files["media"] / f"new{i}.mp4", n=10 + 2 * i, fps=8) for i in range(3)]
    seen = []  # (rounds, videos prepared so far) after each round
    service = Service(
        pipe.scheduler("autoregressive").build(),
        tiny_tokenizer(),
        max_batch=5,
        on_round=lambda s: seen.append((s.rounds, s.contexts.misses)),
    )
    try:
        options = {"frames": 2, "max_pixels": MAX_PIXELS}
        first = service.submit(
            Request(
                str(files["short"]),
                [("what happens ?", None)],
                options,
                {"max_new_tokens": 40, "min_new_tokens": 40},
            )
        )
        assert first.events.get(timeout=60)[0] == "started"
        tickets = [
            service.submit(Request(str(v), [("what happens ?", None)], options, {"max_new_tokens": 4}))
            for v in videos
        ]
        tickets.append(
            service.submit(
                Request(str(files["short"]), [("describe it .", None)], options, {"max_new_tokens": 4})
            )
        )
        for ticket in [first, *tickets]:
            assert _answer(ticket)[0] == "end"
    finally:
        service.close(0)
    steps = [b[1] - a[1] for a, b in zip(seen, seen[1:])]
    assert service.contexts.misses == 4 and service.contexts.hits == 1
    assert max(steps) == 1 and sum(steps) == 3, seen  # the three new videos, one per round


@pytest.mark.parametrize("budget", [0.0, 60.0])
def test_a_new_videos_prefill_runs_in_pieces_between_rounds(files, budget):
    """In process: while a row decodes, a new video is read on the media thread (the row goes on),
    then encoded and prefilled in steps (the encoding, then prefill pieces of `prefill_rows` rows)
    between rounds: one step a round with no time budget (`prefill_seconds=0`), so the live row
    waits for one step at a time; all of them between two rounds where the budget is longer than
    the whole preparation (one wait). The new request starts once its video is prepared, and both
    answers equal those of a service that prefills in one piece."""
    from tiny_checkpoint import tiny_tokenizer

    from hippo.service import Request, Service

    pipe = (
        hippo.PipelineBuilder().target(str(files["target"]), dtype=torch.float64).scheduler("autoregressive")
    )
    options = {"frames": 4, "max_pixels": MAX_PIXELS}
    first = Request(
        str(files["short"]), [("what happens ?", None)], options, {"max_new_tokens": 60, "min_new_tokens": 60}
    )
    second = Request(str(files["long"]), [("describe it .", None)], options, {"max_new_tokens": 6})
    answers = {}
    for rows in (5, None):
        seen = []  # (videos in preparation, steps the live row waited for) after each round
        service = Service(
            pipe.build(),
            tiny_tokenizer(),
            prefill_rows=rows,
            prefill_seconds=budget,
            on_round=lambda s, seen=seen: seen.append((len(s.preparing), len(s.stall_seconds))),
        )
        try:
            a = service.submit(first)
            assert a.events.get(timeout=60)[0] == "started"
            b = service.submit(second)
            answers[rows] = [_answer(t)[1]["token_ids"] for t in (a, b)]
            prefix = list(service.contexts.entries.values())[-1].length  # the new video's
            waits = len(service.stall_seconds)
        finally:
            service.close(0)
        during = [n for busy, n in seen if busy]  # waits so far, after each round while it was prepared
        steps = 1 + -(-prefix // rows) if rows and not budget else 1  # encoded, then each piece (or all)
        assert waits == steps + 1, (waits, seen)  # and the new request's own question
        assert all(b - a <= 1 for a, b in zip(during, during[1:])), seen  # one step per round
        assert len(during) >= steps - 1, seen  # a round between two steps
    assert answers[5] == answers[None]


def test_the_service_fails_a_prompt_longer_than_the_context_alone_and_bounds_its_video_cache(tmp_path):
    """In process (`hippo.service`, no HTTP): a request whose prompt passes the target's context fails
    with the message `hippo generate` prints, the next request is answered; the video cache keeps
    within its byte budget (least recently used out) and a question on an evicted video is answered
    again, the same."""
    from tiny_checkpoint import tiny_tokenizer

    from hippo.adapters.qwen2_5_vl_tiny import tiny_config
    from hippo.registry import lookup
    from hippo.service import Request, Service

    cfg = tiny_config("target")
    cfg.text_config.max_position_embeddings = 48
    lookup("adapters", "qwen2_5_vl").model_class(cfg).to(torch.float64).save_pretrained(tmp_path / "t")
    videos = [write_video(tmp_path / f"v{i}.mp4", n=8 + 2 * i, fps=8) for i in range(2)]  # other bytes
    pipe = (
        hippo.PipelineBuilder().target(str(tmp_path / "t"), dtype=torch.float64).scheduler("autoregressive")
    )
    service = Service(pipe.build(), tiny_tokenizer(), max_batch=2, cache_bytes=1, prefills_per_round=1)
    try:
        small = {"frames": 2, "max_pixels": MAX_PIXELS}
        kind, error = _answer(
            service.submit(Request(str(videos[0]), [("what happens ?", None)], {"frames": 8}))
        )
        assert kind == "error" and "but the target's context is 48" in str(error)
        answers = []
        for v in (videos[0], videos[1], videos[0]):
            kind, info = _answer(
                service.submit(Request(str(v), [("what happens ?", None)], small, {"max_new_tokens": 3}))
            )
            assert kind == "end", info
            answers.append(info["token_ids"])
            assert len(service.contexts.entries) == 1  # over budget: only the newest is kept
        # the first failed as its video was read (its prompt is longer than the context): never prepared
        assert answers[2] == answers[0] and service.contexts.misses == 3 and service.contexts.hits == 0
    finally:
        service.close(0)


def test_requests_that_come_while_the_loop_reads_the_queue_each_get_their_own_video(files, monkeypatch):
    """In process: requests about two new videos that arrive after the loop read the queue's video keys
    and before it admits (a burst of clients) wait for the next read; each is answered on its own
    video, as a service that gets them one at a time answers it, and each video is prepared once."""
    from tiny_checkpoint import tiny_tokenizer

    from hippo.service import Request, Service

    pipe = (
        hippo.PipelineBuilder().target(str(files["target"]), dtype=torch.float64).scheduler("autoregressive")
    )
    six = {"max_new_tokens": 6}
    requests = [
        Request(
            str(files["short"]), [("what happens ?", None)], {"frames": 2, "max_pixels": MAX_PIXELS}, six
        ),
        Request(str(files["long"]), [("describe it .", None)], {"frames": 4, "max_pixels": MAX_PIXELS}, six),
        Request(str(files["long"]), [("what happens ?", None)], {"frames": 2, "max_pixels": MAX_PIXELS}, six),
    ]

    def answers(service: Service, tickets: list) -> list[tuple[int, list[int]]]:
        out = []
        for ticket in tickets:
            assert ticket.events.get(timeout=60)[0] == "started"
            kind, info = _answer(ticket)
            assert kind == "end", info
            out.append((info["prompt_tokens"], info["token_ids"]))
        return out

    alone = Service(pipe.build(), tiny_tokenizer())
    try:
        expected = [answers(alone, [alone.submit(r)])[0] for r in requests]
    finally:
        alone.close(0)
    assert expected[1][0] != expected[2][0]  # the two late videos differ (in frames, so in length)

    late = list(requests[1:])
    tickets = []
    read = Service._read_keys

    def read_then_more_arrive(self, waiting):
        read(self, waiting)
        while late:  # after the read, before the choice
            tickets.append(self.submit(late.pop(0)))

    monkeypatch.setattr(Service, "_read_keys", read_then_more_arrive)
    service = Service(pipe.build(), tiny_tokenizer())
    try:
        tickets.insert(0, service.submit(requests[0]))
        got = answers(service, tickets)
    finally:
        service.close(0)
    assert got == expected
    assert service.contexts.misses == 3  # each video prepared once, none shared


@pytest.mark.parametrize("slow_read", [False, True])
def test_new_videos_that_come_together_to_an_idle_service_are_prepared_before_its_first_round(
    files, slow_read, monkeypatch
):
    """In process: two requests about two new videos reach an idle service together. Both videos are
    prepared, whole, before the first round (the second's pieces do not wait for rounds of the
    first's row), each prefilled in one piece, and the first's row waits for that once, after its
    first token; also when the second file is still being read once the first video is prepared."""
    from tiny_checkpoint import tiny_tokenizer

    from hippo.service import ContextCache, Request, Service

    if slow_read:
        read = ContextCache.read

        def slowly(self, path, *args, **kwargs):
            if Path(path) == files["long"]:
                time.sleep(0.3)
            return read(self, path, *args, **kwargs)

        monkeypatch.setattr(ContextCache, "read", slowly)

    pipe = (
        hippo.PipelineBuilder().target(str(files["target"]), dtype=torch.float64).scheduler("autoregressive")
    )
    seen = []  # videos prepared, after each round
    service = Service(
        pipe.build(),
        tiny_tokenizer(),
        prefill_rows=5,
        on_round=lambda s: seen.append(len(s.contexts.entries)),
    )
    pieces = []  # the prefill piece of each preparation (None: whole)
    prepare = service.contexts.prepare
    service.contexts.prepare = lambda source, key, rows=None: (
        pieces.append(rows) or prepare(source, key, rows)
    )
    requests = [
        Request(
            str(files[v]),
            [("what happens ?", None)],
            {"frames": n, "max_pixels": MAX_PIXELS},
            {"max_new_tokens": 4},
        )
        for v, n in (("short", 2), ("long", 8))
    ]
    try:
        with service.cv:  # both queued before the loop looks
            tickets = [service.submit(r) for r in requests]
        assert [_answer(t)[0] for t in tickets] == ["end", "end"]
        waits = len(service.stall_seconds)
    finally:
        service.close(0)
    assert seen[0] == 2, seen
    assert pieces == [None, None]  # nobody was waiting: one forward each, as generate prefills
    assert waits == 2  # the first row waited for the second video's preparation, and its question


@pytest.mark.parametrize("live", [True, False])
def test_a_queued_new_videos_file_is_read_while_another_video_is_prepared(files, monkeypatch, live):
    """In process: two requests about two new videos come one after the other, while a row decodes
    (the service prepares one new video at a time, `prepares_per_round=1`, in steps between rounds)
    or to an idle service (the first video is prepared whole). The second video's file is read on
    the media thread while the first video is still being prepared, not after (its request waits for
    its turn, its reading does not). Both answers equal those of a service that serves each alone."""
    from tiny_checkpoint import tiny_tokenizer

    from hippo.service import ContextCache, Request, Service

    pipe = (
        hippo.PipelineBuilder().target(str(files["target"]), dtype=torch.float64).scheduler("autoregressive")
    )
    events = []  # ("read", video) when a file's reading starts, ("ready", n) when a context is, n-th
    read, prepare = ContextCache.read, ContextCache.prepare

    def reading(self, path, *args, **kwargs):
        events.append(("read", Path(path).name))
        return read(self, path, *args, **kwargs)

    def preparing(self, *args, **kwargs):
        for ctx in prepare(self, *args, **kwargs):
            time.sleep(0.05)  # each step: slow enough for the second request to come meanwhile
            if ctx is not None:
                events.append(("ready", len(self.entries)))
            yield ctx

    monkeypatch.setattr(ContextCache, "read", reading)
    monkeypatch.setattr(ContextCache, "prepare", preparing)
    options = {"frames": 4, "max_pixels": MAX_PIXELS}
    first = Request(
        str(files["short"]), [("what happens ?", None)], options, {"max_new_tokens": 60, "min_new_tokens": 60}
    )
    news = [write_video(files["media"] / f"ahead{i}.mp4", n=10 + 2 * i, fps=8) for i in range(2)]
    requests = [Request(str(v), [("describe it .", None)], options, {"max_new_tokens": 5}) for v in news]

    def serve(requests, live):
        service = Service(pipe.build(), tiny_tokenizer(), prefill_rows=5, prepares_per_round=1)
        try:
            row = service.submit(live) if live else None
            if row is not None:
                assert row.events.get(timeout=60)[0] == "started"
            tickets = []
            for r in requests:
                tickets.append(service.submit(r))
                time.sleep(0.02)
            answers = [_answer(t) for t in tickets]
            if row is not None:
                assert _answer(row)[0] == "end"
        finally:
            service.close(0)
        assert [k for k, _ in answers] == ["end"] * len(requests)
        return [a["token_ids"] for _, a in answers]

    together = serve(requests, first if live else None)
    order = [e for e in events if e != ("read", "short.mp4")]
    first_ready = ("ready", 2 if live else 1)  # the first new video's context (after short's)
    assert order.index(("read", news[1].name)) < order.index(first_ready), order
    assert together == [serve([r], None)[0] for r in requests]


def test_first_tokens_of_requests_that_come_together_wait_for_no_draft_prefill(files):
    """In process: four requests (two questions about each of two new videos, holistic pruning, so
    the attention scorer reads each request's own target prefill) reach an idle service together.
    Every first token is sent before any draft is prefilled: a request's first token waits for the
    targets' prefills before it, never for another request's draft. Each answer equals the one a
    service gives the request alone."""
    from tiny_checkpoint import tiny_tokenizer

    from hippo.job import DecodeJob
    from hippo.service import Request, Service

    def build():
        return (
            hippo.PipelineBuilder()
            .target(str(files["target"]), dtype=torch.float64)
            .draft(str(files["draft"]), dtype=torch.float64)
            .scorer("holistic")
            .selector("topk", keep_ratio=0.3)
            .scheduler("serial", gamma=3)
            .build()
        )

    requests = [
        Request(str(files[v]), [(q, None)], {"frames": 4, "max_pixels": MAX_PIXELS}, {"max_new_tokens": 6})
        for v in ("short", "long")
        for q in ("what happens ?", "describe it .")
    ]
    order = []  # ("first", request) when a first token is sent, ("draft", None) at each draft prefill
    prefill_draft = DecodeJob.prefill_draft

    def watched(job):
        order.append(("draft", None))
        return prefill_draft(job)

    tickets, sent = [], set()

    def notifier(i):
        def notify(event):
            if event[0] == "delta" and i not in sent:
                sent.add(i)
                order.append(("first", i))
            tickets[i].events.put(event)

        return notify

    service = Service(build(), tiny_tokenizer())
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(DecodeJob, "prefill_draft", watched)
            with service.cv:  # all queued before the loop looks
                tickets += [service.submit(r, notifier(i)) for i, r in enumerate(requests)]
            together = [_answer(t) for t in tickets]
    finally:
        service.close(0)
    firsts = [i for i, (what, _) in enumerate(order) if what == "first"]
    drafts = [i for i, (what, _) in enumerate(order) if what == "draft"]
    assert len(firsts) == 4 and len(drafts) == 4, order
    assert max(firsts) < min(drafts), order
    alone = []
    for r in requests:
        service = Service(build(), tiny_tokenizer())
        try:
            alone.append(_answer(service.submit(r)))
        finally:
            service.close(0)
    assert [k for k, _ in together] == ["end"] * 4
    assert [a["token_ids"] for _, a in together] == [a["token_ids"] for _, a in alone]


def test_max_tokens_is_clamped_to_the_context_and_video_options_are_bounded_before_decoding(
    tmp_path, monkeypatch
):
    """In process: max_new_tokens past the context ends at the context's end, finish_reason "length";
    frames the context or the memory cannot take are refused before a frame is decoded, naming the
    option; a file is hashed once while its size and mtime stay."""
    from tiny_checkpoint import tiny_tokenizer

    import hippo.context
    import hippo.service
    from hippo.adapters.qwen2_5_vl_tiny import tiny_config
    from hippo.registry import lookup
    from hippo.service import Request, Service, VideoOptionError

    cfg = tiny_config("target")
    cfg.text_config.max_position_embeddings = 40
    lookup("adapters", "qwen2_5_vl").model_class(cfg).to(torch.float64).save_pretrained(tmp_path / "t")
    video = write_video(tmp_path / "v.mp4", n=16, fps=8)
    pipe = (
        hippo.PipelineBuilder().target(str(tmp_path / "t"), dtype=torch.float64).scheduler("autoregressive")
    )
    service = Service(pipe.build(), tiny_tokenizer(), max_batch=2)
    decoded = []
    monkeypatch.setattr(service.pipeline, "video_inputs", _spy(service.pipeline.video_inputs, decoded))
    small = {"frames": 2, "max_pixels": MAX_PIXELS}
    try:
        kind, info = _answer(
            service.submit(Request(str(video), [("what happens ?", None)], small, {"max_new_tokens": 1000}))
        )
        assert kind == "end", info
        assert info["prompt_tokens"] + info["completion_tokens"] == 40 and info["finish_reason"] == "length"
        assert len(decoded) == 1
        # 16 frames: at least 8 tokens (2 frames a temporal patch); a context of 8 cannot hold them
        with monkeypatch.context() as m:
            m.setattr(service.pipeline.target_adapter, "context_length", lambda: 8)
            kind, error = _answer(service.submit(Request(str(video), [("what ?", None)], {"frames": 16})))
        assert kind == "error" and isinstance(error, VideoOptionError) and error.param == "frames", error
        assert "context is 8" in str(error)
        with monkeypatch.context() as m:
            m.setattr(hippo.context, "available_bytes", lambda device: 1 << 20)  # 1 MiB free
            kind, error = _answer(service.submit(Request(str(video), [("what ?", None)], {"fps": 8.0})))
        assert kind == "error" and isinstance(error, VideoOptionError) and error.param == "fps", error
        assert len(decoded) == 1  # neither was decoded
        assert service.contexts.hashed == 1  # one file, hashed once for its three requests
        os.utime(video, ns=(1, 1))
        service.contexts.digest(str(video))
        assert service.contexts.hashed == 2  # touched: hashed again
    finally:
        service.close(0)
    assert hippo.service.DIGESTS_KEPT > 0


def _spy(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return wrapper
