"""Sampling, request-pool resolution, the built-in model and the generate CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from service.errors import CapacityError
from service.ranks.kv_pool import _words, resolve_max_running_requests, store_entries
from service.ranks.sampler import sample
from service.sampling import SamplingError, SamplingParams


def test_pool_resolution_from_kv_capacity():
    assert resolve_max_running_requests(None, 65_535, 4096, 64) == 15
    assert resolve_max_running_requests(None, 10**9, 2048, 64) == 64
    assert resolve_max_running_requests(3, 65_535, 4096, 64) == 3
    with pytest.raises(CapacityError, match="--kv-cache-memory-bytes"):
        resolve_max_running_requests(None, 1000, 2048, 64)


def test_sampling_is_seeded_and_respects_top_k_top_p():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]] * 2)
    greedy = sample(logits, [SamplingParams(), SamplingParams(top_k=1, temperature=5.0)], [0, 0])
    assert greedy == [4, 4]
    p = SamplingParams(temperature=1.0, top_k=2, seed=7)
    draws = {sample(logits[:1], [p], [s])[0] for s in range(200)}
    assert draws == {3, 4}  # only the top 2 tokens, both seen
    assert sample(logits[:1], [p], [5]) == sample(logits[:1], [p], [5])  # same seed, same token
    top_p = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
    assert {sample(logits[:1], [top_p], [s])[0] for s in range(100)} == {4}


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_sampling_names_the_field(kw, field):
    with pytest.raises(SamplingError, match=f"sampling_params.{field}"):
        SamplingParams(**kw)


def test_random_load_format_runs_from_config_alone(tmp_path):
    from service.config import EngineConfig, GraphConfig
    from service.engine import Engine
    from service.model.builtin import BUILTIN_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(BUILTIN_CONFIG))
    e = Engine(EngineConfig(model_path=str(tmp_path), load_format="random", device="cpu",
                            context_length=64, graph=GraphConfig(backend="eager")))  # fmt: skip
    (out,) = e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(out.output_ids) == 3 and out.text is None  # no tokenizer.json there


def test_generate_cli_json_with_builtin_model_and_text():
    out = subprocess.run(
        [sys.executable, "-m", "service", "generate", "--prompt-ids", "104,105", "--prompt-ids",
         "1,2,3", "--max-new-tokens", "3", "--context-length", "256", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    outputs = json.loads(out.stdout)["outputs"]
    assert len(outputs) == 2
    for o in outputs:
        assert len(o["output_ids"]) <= 3 and isinstance(o["text"], str)
        (rec,) = o["meta_info"]["prefill_batches"]
        assert rec["graph_hit"] and rec["graph_kind"] == "cpu" and rec["num_requests"] == 2
        assert o["meta_info"]["cuda_graph"] is False


def test_stop_token_ids_and_stop_strings_end_generation():
    from service.config import EngineConfig, GraphConfig
    from service.engine import Engine

    e = Engine(EngineConfig(device="cpu", context_length=64, graph=GraphConfig(backend="eager")))
    prompt = [104, 101, 108, 108, 111]
    (free,) = e.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(free.output_ids) == 8
    stop_id = free.output_ids[2]
    (by_id,) = e.generate(
        [prompt], SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=(stop_id,))
    )
    cut = free.output_ids.index(stop_id) + 1
    assert by_id.output_ids == free.output_ids[:cut]
    assert by_id.meta_info["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_stop_strings_end_generation_and_are_cut_from_text():
    from service.buckets import ResolvedRequestPool, resolve_plan
    from service.commands import ForwardResult
    from service.scheduling.request import FinishReason
    from service.scheduling.scheduler import Scheduler

    plan = resolve_plan(backend="eager", context_length=64, pool=ResolvedRequestPool(2),
                        max_prefill_tokens=64)  # fmt: skip
    detok = "".join  # token i is the i-th letter, below
    sched = Scheduler(plan=plan, context_length=64, max_running_requests=2, num_kv_slots=256,
                      chunked_prefill_size=64, vocab_size=26, eos_token_ids=(),
                      detokenize=lambda ids: detok(chr(97 + t) for t in ids))  # fmt: skip
    req = sched.add([0, 1], SamplingParams(max_new_tokens=10, stop=("cd",)))
    for token in (2, 3, 4):  # "c", then "d" completes the stop string
        batch = sched.schedule()
        sched.process(batch, ForwardResult((token,), None))
        if req.finished:
            break
    assert req.output_ids == [2, 3]
    assert req.finish_reason == FinishReason.stop("cd")
    assert sched.rows.num_free == 2 and sched.slots.num_used == 0  # resources freed


def test_incremental_detokenizing_equals_decoding_the_whole_output():
    """Streaming text decodes a bounded window per token (not the whole output each step), and
    multi-byte characters cut across tokens come out whole."""
    from service.model.builtin import builtin_model_dir
    from service.tokenizer import IncrementalDetokenizer, load_tokenizer

    tok = load_tokenizer(builtin_model_dir())
    text = "héllo wörld — ✓ 日本語 " * 20
    ids = tok.encode(text)
    widths: list[int] = []

    def decode(part: list[int]) -> str:
        widths.append(len(part))
        return tok.decode(part)

    d = IncrementalDetokenizer(decode)
    out = "".join(d.push(ids[: i + 1]) for i in range(len(ids)))
    assert out == text == d.text
    assert max(widths) <= 8  # a window of a few tokens, whatever the output's length


def test_switch_interval_default_override_and_refusal(monkeypatch):
    from service.api.serve import SWITCH_INTERVAL_S, switch_interval_s

    monkeypatch.delenv("CAPTURE_SERVICE_SWITCH_INTERVAL_S", raising=False)
    assert switch_interval_s() == SWITCH_INTERVAL_S == 0.001
    monkeypatch.setenv("CAPTURE_SERVICE_SWITCH_INTERVAL_S", "0.0002")
    assert switch_interval_s() == 0.0002
    for bad in ("fast", "0", "-1", "5"):
        monkeypatch.setenv("CAPTURE_SERVICE_SWITCH_INTERVAL_S", bad)
        with pytest.raises(SystemExit, match=r"give seconds in \(0, 0.1\]"):
            switch_interval_s()


@pytest.mark.parametrize(
    ("dtype", "heads", "dim", "wide"),
    [(torch.bfloat16, 2, 8, True), (torch.float32, 1, 6, True), (torch.float16, 1, 3, False)],
)
def test_kv_store_writes_each_token_to_its_slot_as_a_plain_copy_would(dtype, heads, dim, wide):
    """K and V as adjacent column slices of one qkv tensor (the model's layout) and as separate
    tensors, into a two-part and a one-part cache: every slot equals the token written to it,
    bit for bit, and untouched slots stay zero. Rows of 16 bytes and more move as 8-byte words;
    rows of 6 bytes (fp16, head dim 3) cannot and take the element copy. A word copy that
    misplaced a row, mixed K and V or wrote past a row fails."""
    torch.manual_seed(0)
    t, q_width, width = 5, 3 * heads * dim, heads * dim
    qkv = torch.randn(t, q_width + 2 * width).to(dtype)
    k = qkv[:, q_width : q_width + width].view(t, heads, dim)
    v = qkv[:, q_width + width :].view(t, heads, dim)
    loc = torch.tensor([7, 2, 9, 0, 4])
    for k_in, v_in in [(k, v), (k.clone(), v.clone())]:  # adjacent slices, then apart
        kv = torch.zeros(11, 2, heads, dim, dtype=dtype)
        store_entries(kv, loc, k_in, v_in)
        for i, slot in enumerate(loc.tolist()):
            assert torch.equal(kv[slot, 0], k[i]) and torch.equal(kv[slot, 1], v[i])
        others = [s for s in range(11) if s not in loc.tolist()]
        assert not kv[others].any()
    one = torch.zeros(11, 1, heads, dim, dtype=dtype)  # MLA's one-part layout: K alone
    store_entries(one, loc, k, k)
    assert all(torch.equal(one[s, 0], k[i]) for i, s in enumerate(loc.tolist()))
    assert (_words(kv) is not None) == wide and (_words(k) is not None) == wide
