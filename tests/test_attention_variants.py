"""DESIGN invariant 8: metadata per (layer id, variant). One layer, two attention paths."""

from __future__ import annotations

import pytest
import torch

from service.model.attention import AttentionKey, AttentionRegistry, AttentionSpec
from service.ranks.attention.torch_slots import TorchSlotAttention
from service.ranks.attention.torch_varlen import TorchVarlenAttention, causal_attend
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.kv_pool import KVLayout, ReqToTokenPool, TokenKVPool

MHA = AttentionKey(0, "mha")
MQA = AttentionKey(0, "mqa")


class TwoPathLayer(torch.nn.Module):
    """Like DeepSeek's layer: a wide MHA prefill path and a narrow MQA path, one layer id."""

    def __init__(self, registry: AttentionRegistry) -> None:
        super().__init__()
        registry.register(MHA, AttentionSpec(8, 2, 16, 16**-0.5, kv_layer=0))
        registry.register(MQA, AttentionSpec(2, 2, 16, 0.5, kv_layer=1))

    def forward(self, q_mha, kv_mha, q_mqa, kv_mqa, attention):
        attention.store(*kv_mha, MHA)
        attention.store(*kv_mqa, MQA)
        return attention(q_mha, *kv_mha, MHA), attention(q_mqa, *kv_mqa, MQA)


@pytest.mark.parametrize("backend_cls", [TorchVarlenAttention, TorchSlotAttention])
def test_each_path_gets_its_own_metadata(backend_cls):
    registry = AttentionRegistry()
    layer = TwoPathLayer(registry)
    kv = TokenKVPool(KVLayout(2, 2, 16, torch.float32), 64, torch.device("cpu"))
    rows = ReqToTokenPool(2, 16, torch.device("cpu"))
    backend = backend_cls(registry, kv, rows)
    layout = BatchLayout(ForwardMode.EXTEND, (0, 1), (0, 0), (5, 3))
    rows.write(0, 0, [1, 2, 3, 4, 5])
    rows.write(1, 0, [6, 7, 8])
    batch = ForwardBatch.build(layout, [0] * 8, list(range(1, 9)), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q_mha = torch.randn(8, 8 * 16, generator=g)
    q_mqa = torch.randn(8, 2 * 16, generator=g)
    kv_mha = (torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g))
    kv_mqa = (torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g))
    out_mha, out_mqa = layer(q_mha, kv_mha, q_mqa, kv_mqa, backend.bind(batch))
    assert out_mha.shape == (8, 128) and out_mqa.shape == (8, 32)
    for q, (k, v), out, heads, scale in (
        (q_mha, kv_mha, out_mha, 8, 16**-0.5),
        (q_mqa, kv_mqa, out_mqa, 2, 0.5),
    ):
        for start, n in ((0, 5), (5, 3)):
            ref = causal_attend(
                q[start : start + n].view(n, heads, 16),
                k[start : start + n].view(n, 2, 16),
                v[start : start + n].view(n, 2, 16),
                0,
                scale,
            ).reshape(n, -1)
            assert torch.allclose(out[start : start + n], ref, atol=1e-5)
    # the two paths wrote their own KV layers
    assert torch.equal(kv.k[0][1:9], kv_mha[0].view(8, 2, 16))
    assert torch.equal(kv.k[1][1:9], kv_mqa[0].view(8, 2, 16))


def test_a_path_with_the_other_paths_shape_is_refused():
    registry = AttentionRegistry()
    TwoPathLayer(registry)
    kv = TokenKVPool(KVLayout(2, 2, 16, torch.float32), 8, torch.device("cpu"))
    backend = TorchVarlenAttention(registry, kv, ReqToTokenPool(1, 8, torch.device("cpu")))
    batch = ForwardBatch.build(
        BatchLayout(ForwardMode.EXTEND, (0,), (0,), (2,)), [0, 0], [1, 2], torch.device("cpu")
    )
    q_mha = torch.zeros(2, 128)
    with pytest.raises(ValueError, match="does not match its path's metadata"):
        backend.forward(q_mha, torch.zeros(2, 32), torch.zeros(2, 32), MQA, batch)
    with pytest.raises(KeyError, match="not registered"):
        registry.spec(AttentionKey(0, "mla"))
