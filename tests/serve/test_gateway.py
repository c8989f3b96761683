"""The gateway through the official openai client: answers, streaming, context handles and their
fallbacks, concurrency, and OpenAI-style errors."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from kvrelay.serve import handles
from kvrelay.serve.chat import Message, answer_start_ids, conversation_ids

openai = pytest.importorskip("openai")

QWEN = "tiny:qwen2"
FIRST = [{"role": "system", "content": "you read the report and check the code"},
         {"role": "user", "content": "what is the key in the vault and which file has the bug"}]
SECOND = {"role": "user", "content": "which function has the error and what is the fix"}


def ask(client, messages, model=QWEN, **kw):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=12, **kw)


def ext(resp) -> dict:
    return resp.model_extra["kvrelay"]


def direct(gateway, model, messages):
    """What the model itself answers greedily to ``messages`` (no server in between)."""
    agent = gateway["pool"].pick(model).agent
    msgs = [Message(m["role"], m["content"]) for m in messages]
    r = agent.respond_ids(conversation_ids(agent, msgs) + answer_start_ids(agent), max_new_tokens=12)
    return r.text


def test_models_lists_every_served_model(gateway):
    assert sorted(m.id for m in gateway["client"].models.list()) == ["auto", "tiny:llama", QWEN]


def test_chat_completion_is_the_models_greedy_answer(gateway):
    r = ask(gateway["client"], FIRST)
    assert r.object == "chat.completion" and r.model == QWEN
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == direct(gateway, QWEN, FIRST)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.usage.prompt_tokens_details.cached_tokens == 0
    assert ext(r)["handle"].startswith("kvr1.")


def test_streaming_sends_the_same_answer_in_pieces(gateway):
    c = gateway["client"]
    whole = ask(c, FIRST)
    chunks = list(ask(c, FIRST, stream=True, stream_options={"include_usage": True}))
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    last = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(last) == 1 and last[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert last[0].model_extra["kvrelay"]["handle"].startswith("kvr1.")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def _continue(c, handle, model=QWEN):
    return ask(c, [SECOND], model=model, extra_body={"kv_context": [handle]})


def _resend(c, first, model=QWEN):
    return ask(c, FIRST + [{"role": "assistant", "content": first.choices[0].message.content}, SECOND], model=model)


def test_continuing_a_handle_gives_the_text_answer_and_prefills_only_the_new_turn(gateway):
    c = gateway["client"]
    first = ask(c, FIRST)
    relayed = _continue(c, ext(first)["handle"])
    kv_cache = _cache_of(gateway, relayed)
    text = _resend(c, first)
    text_cache = _cache_of(gateway, text)
    assert relayed.choices[0].message.content == text.choices[0].message.content
    # the turn's cache is the same whichever way it was read (content-addressed: same tokens, same key)
    assert handles.decode(ext(relayed)["handle"], gateway["secret"]).handle.key == \
        handles.decode(ext(text)["handle"], gateway["secret"]).handle.key
    assert torch.equal(kv_cache.token_ids, text_cache.token_ids)
    assert torch.equal(kv_cache.positions, text_cache.positions)
    for a, b in zip(kv_cache.keys + kv_cache.values, text_cache.keys + text_cache.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert relayed.choices[0].message.content  # not an empty answer compared with an empty one
    assert ext(relayed)["context"] == [{"index": 0, "channel": "kv", "tokens": relayed.usage.prompt_tokens_details
                                        .cached_tokens}]
    agent = gateway["pool"].pick(QWEN).agent
    own = len(conversation_ids(agent, [Message(**SECOND)]) + answer_start_ids(agent))
    assert relayed.usage.prompt_tokens - relayed.usage.prompt_tokens_details.cached_tokens == own
    assert relayed.usage.prompt_tokens == text.usage.prompt_tokens
    assert text.usage.prompt_tokens_details.cached_tokens == 0


def _cache_of(gateway, resp):
    from kvrelay.transport.payloads import get_payload

    return get_payload(gateway["store"], handles.decode(ext(resp)["handle"], gateway["secret"]).handle.key)


def _reissue(handle: str, secret: bytes, **changes) -> str:
    o = handles.decode(handle, secret)
    return handles.encode(dataclasses.replace(o.handle, **changes), secret)


def _assert_fallback(gateway, handle, reason, first, model=QWEN):
    c = gateway["client"]
    got = _continue(c, handle, model)
    assert ext(got)["context"][0]["channel"] == "text" and ext(got)["context"][0]["fallback"] == reason
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    assert got.choices[0].message.content == _resend(c, first, model).choices[0].message.content


def test_expired_handle_falls_back_to_text_and_says_so(gateway):
    first = ask(gateway["client"], FIRST)
    old = _reissue(ext(first)["handle"], gateway["secret"], expires=time.time() - 1)
    _assert_fallback(gateway, old, "expired", first)


def test_tampered_handle_falls_back_to_text_and_says_so(gateway):
    first = ask(gateway["client"], FIRST)
    h = ext(first)["handle"]
    forged = _reissue(h, b"another server's key that is long", expires=time.time() + 3600)
    _assert_fallback(gateway, forged, "unsigned", first)
    prefix, body, sig = h.split(".")
    flipped = f"{prefix}.{body}.{('A' if sig[0] != 'A' else 'B') + sig[1:]}"
    _assert_fallback(gateway, flipped, "unsigned", first)


def test_cache_edited_missing_or_from_another_model_falls_back(gateway):
    first = ask(gateway["client"], FIRST)
    h = ext(first)["handle"]
    key = handles.decode(h, gateway["secret"]).handle.key
    store = gateway["store"]
    _assert_fallback(gateway, h, "incompatible", first, model="tiny:llama")
    data = bytearray(store.get_bytes(key))
    data[-3] ^= 0xFF  # a flipped byte in the last tensor: its checksum no longer holds
    store.put_bytes(key, bytes(data))
    _assert_fallback(gateway, h, "corrupt", first)
    store.delete(key)
    _assert_fallback(gateway, h, "missing", first)


def test_concurrent_requests_give_the_answers_they_get_alone(gateway):
    c = gateway["client"]
    convs = [[{"role": "user", "content": q}] for q in
             ("what is the key", "which file has the bug", "how many agents read the report", "what is the fix",
              "where is the error", "who wrote the plan")]
    alone = [ask(c, m).choices[0].message.content for m in convs]
    with ThreadPoolExecutor(len(convs)) as ex:
        together = list(ex.map(lambda m: ask(c, m).choices[0].message.content, convs))
        streamed = list(ex.map(lambda m: "".join(ch.choices[0].delta.content or "" for ch in ask(c, m, stream=True)
                                                 if ch.choices), convs))
    assert together == alone and streamed == alone
    assert len(set(alone)) > 1  # different questions, different answers: no request saw another's tokens


@pytest.mark.parametrize("kw,status,param,code", [
    ({"model": "no-such-model"}, 404, "model", "model_not_found"),
    ({"n": 2}, 400, "n", None),
    ({"max_tokens": 0}, 400, "max_tokens", None),
    ({"max_tokens": 10_000}, 400, "max_tokens", None),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", None),
    ({"messages": [{"content": "no role"}]}, 400, "messages[0]", None),
    ({"extra_body": {"kv_context": ["not a handle"]}}, 400, "kv_context", None),
    ({"stop": ["\n"]}, 400, "stop", None),
    ({"messages": [{"role": "user", "content": "the " * 4100}]}, 400, "messages", "context_length_exceeded"),
])
def test_bad_requests_get_openai_error_bodies(gateway, kw, status, param, code):
    args = {"model": QWEN, "messages": FIRST, "max_tokens": 12} | kw
    with pytest.raises(openai.APIStatusError) as info:
        gateway["client"].chat.completions.create(**args)
    err = info.value
    assert err.status_code == status
    assert err.body["type"] == ("invalid_request_error") and err.body["param"] == param and err.body["code"] == code
    assert "expected" in err.body["message"]


def test_routes_and_bodies_outside_the_api_get_error_bodies(gateway):
    url = gateway["url"]
    r = httpx.get(url + "/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_health_and_metrics_count_hits_and_fallbacks(gateway):
    c = gateway["client"]
    first = ask(c, FIRST)
    _continue(c, ext(first)["handle"])
    _continue(c, _reissue(ext(first)["handle"], gateway["secret"], expires=0.0))
    assert httpx.get(gateway["url"] + "/health").json()["status"] == "ok"
    text = httpx.get(gateway["url"] + "/metrics").text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['kvrelay_relay_hits_total{model="tiny:qwen2"}'] >= 1
    assert values['kvrelay_relay_fallbacks_total{model="tiny:qwen2",reason="expired"}'] >= 1
    assert values['kvrelay_queue_depth{model="tiny:qwen2"}'] == 0
    assert values['kvrelay_ttft_seconds_count{channel="kv",model="tiny:qwen2"}'] >= 1
    assert 'kvrelay_decode_tokens_per_second_count{model="tiny:qwen2"}' in values
