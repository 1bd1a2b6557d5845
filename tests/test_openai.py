"""The OpenAI-compatible API, driven by the official `openai` client against a real server."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.model.builtin import BUILTIN_CHAT_TEMPLATE
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.sampling import SamplingParams
from tests.server_proc import ServerProcess

KEY = "test-key"
ARGS = ("--context-length", "256", "--max-running-requests", "4", "--prefill-buckets", "32,128",
        "--api-key", KEY, "--served-model-name", "tiny")  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(*ARGS, log_path=tmp_path_factory.mktemp("openai") / "log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    """The same built-in model in this process: the engine's own logits to check against."""
    e = Engine(EngineConfig(device="cpu", context_length=256, kv_cache_memory_bytes=16 << 20,
                            graph=GraphConfig(backend="eager")))  # fmt: skip
    e.return_logits = True
    return e


def prompt_log_softmax(e: Engine, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) log-probabilities of the next token at each position of ``ids``."""
    w = e.executor.worker
    slots = list(range(1, 1 + len(ids)))
    w.req_to_token.write(0, 0, slots)
    batch = ForwardBatch.build(BatchLayout(ForwardMode.EXTEND, (0,), (0,), (len(ids),)), ids,
                               slots, w.device)  # fmt: skip
    with torch.inference_mode():
        hidden = w.eager_runner.run(batch, None)
        return torch.log_softmax(w.model.logits(hidden), dim=-1)


def test_models_lists_the_served_name(client):
    (m,) = client.models.list().data
    assert m.id == "tiny"


def test_completion_greedy_matches_generate_and_reports_graphs(client, server):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    (choice,) = r.choices
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6
    assert r.usage.total_tokens == 11 and choice.finish_reason == "length"
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True}}  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY}"}
    native = httpx.post(server.url + "/generate", headers=auth, json=body, timeout=60).json()
    assert choice.text == native["text"]
    report = r.model_extra["capture_service"]["choices"][0]
    assert report["prefill_batches"][0]["graph_hit"] is True
    assert report["prefill_batches"][0]["bucket"] == 32


def test_several_prompts_as_text_and_as_token_ids(client):
    r = client.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 4
    ids = client.completions.create(model="tiny", prompt=[[97, 98], [99, 100]], max_tokens=3,
                                    temperature=0)  # fmt: skip
    assert [c.text for c in ids.choices] == [c.text for c in r.choices]


def test_streaming_completion_equals_the_whole_answer(client):
    kw = dict(model="tiny", prompt="stream me", max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_renders_the_model_template(client, reference):
    from service.chat_template import ChatTemplate

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                       temperature=0)  # fmt: skip
    rendered = ChatTemplate(BUILTIN_CHAT_TEMPLATE).render(messages)
    assert rendered == "system: be brief\nuser: hi\nassistant:"
    assert r.usage.prompt_tokens == len(reference.encode(rendered))
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    (want,) = reference.generate([rendered], SamplingParams(max_new_tokens=5))
    assert r.choices[0].message.content == want.text
    deltas = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                                 temperature=0, stream=True))  # fmt: skip
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == want.text


def test_logprobs_and_echo_are_the_engine_own(client, reference):
    prompt = "The cat"
    ids = reference.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                  logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    n = len(ids)
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None
    (ref_out,) = reference.generate([ids], SamplingParams(max_new_tokens=4, ignore_eos=True))
    generated = ref_out.output_ids
    want = prompt_log_softmax(reference, ids + generated)
    for pos in range(1, n + 4):  # token pos, scored by the position before it
        target = (ids + generated)[pos]
        assert abs(lp.token_logprobs[pos] - want[pos - 1, target].item()) < 1e-4, pos
        best = want[pos - 1].topk(3)
        assert len(lp.top_logprobs[pos]) == 3
        assert abs(max(lp.top_logprobs[pos].values()) - best.values[0].item()) < 1e-4
    # greedy: every generated token is the most likely one
    for pos in range(n, n + 4):
        assert abs(lp.token_logprobs[pos] - max(lp.top_logprobs[pos].values())) < 1e-6
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                          "content": "x"}], max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_stop_sequences_cut_the_text(client):
    free = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = free[3:5]
    if not stop.strip():
        pytest.skip(f"the greedy text has no usable stop sequence: {free!r}")
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(stop)]


def test_a_client_that_leaves_mid_stream_frees_its_kv(client, server):
    stream = client.completions.create(model="tiny", prompt="go", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while server.metric("capture_service_kv_usage_ratio") != 0.0:
        assert time.monotonic() < deadline, "the abandoned stream kept its KV"
        time.sleep(0.1)


def test_errors_surface_as_the_client_typed_exceptions(client, server):
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model="tiny", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, n=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )  # fmt: skip
    assert err.value.body["param"] == "tools" and "not supported" in err.value.message
    with pytest.raises(openai.BadRequestError, match="context length 256"):
        client.completions.create(model="tiny", prompt="x" * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_new_tokens 1000"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=3)
