"""Batch invariance of the attention kernels and the linear layers, without a
model: one query's output has the same bits alone, among other decodes of
other lengths, as the last row of a prefill chunk, and inside a full prefill;
a linear layer's row has the same bits whatever the row count."""

from __future__ import annotations

import pytest
import torch

from engine.layers.packed_linear import ROW_TILE, PackedWeights
from kernels import get_attention_backend

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention shape


def _caches(num_blocks: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _run(backend, q_rows: list[torch.Tensor], seq_lens: list[int], tables: list[list[int]], kc, vc, width: int):
    """Attention for sequences given by their query rows, lengths and block ids."""
    qsl = [0]
    for q in q_rows:
        qsl.append(qsl[-1] + q.shape[0])
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return backend.paged_attention(torch.cat(q_rows), kc, vc, torch.tensor(qsl, dtype=torch.int32),
                                   torch.tensor(seq_lens, dtype=torch.int32), table, HEAD_DIM ** -0.5)


@pytest.mark.parametrize("name, dtype, long_len", [("cpu", torch.bfloat16, 700), ("cpu", torch.float32, 700),
                                                   ("torch", torch.bfloat16, 700),
                                                   ("triton", torch.float32, 300)])
def test_a_query_has_the_same_output_in_every_kind_of_batch(name, dtype, long_len):
    if name == "triton":
        pytest.importorskip("triton")
    backend = get_attention_backend(name, "cpu", batch_invariant=True)
    kc, vc = _caches(120, dtype)
    g = torch.Generator().manual_seed(1)
    target_len = 100
    target_blocks = list(range(1, 8))  # 7 blocks hold 100 tokens
    queries = torch.randn(target_len, HEADS, HEAD_DIM, generator=g).to(dtype)
    other_blocks = list(range(8, 8 + (long_len + BLOCK - 1) // BLOCK))
    other_q = torch.randn(1, HEADS, HEAD_DIM, generator=g).to(dtype)
    width = 128  # 2048 tokens of block table: the Triton path would split the keys of a small decode batch
    last = queries[-1:]

    alone = _run(backend, [last], [target_len], [target_blocks], kc, vc, width)[0]
    among_decodes = _run(backend, [other_q, last, other_q], [long_len, target_len, 37],
                         [other_blocks, target_blocks, [9, 10, 11]], kc, vc, width)[1]
    chunk_tail = _run(backend, [queries[-30:], other_q], [target_len, long_len],
                      [target_blocks, other_blocks], kc, vc, width)[29]
    full_prefill = _run(backend, [queries, other_q], [target_len, long_len],
                        [target_blocks, other_blocks], kc, vc, width)[target_len - 1]
    for label, got in [("among decodes", among_decodes), ("last row of a chunk", chunk_tail),
                       ("row of a full prefill", full_prefill)]:
        assert torch.equal(got, alone), f"{label}: max diff {(got.float() - alone.float()).abs().max()}"


@pytest.mark.parametrize("name", ["cpu", "torch"])
def test_each_row_of_a_long_prefill_equals_its_own_decode(name):
    """A 700-token prefill (on the PyTorch path in query tiles whose contexts
    stop at each tile's last position, and past 512 keys in tiles of
    probabilities @ values): every row still has the bits of the same query
    attended as a decode over exactly its own context."""
    backend = get_attention_backend(name, "cpu", batch_invariant=True)
    kc, vc = _caches(60, torch.bfloat16, seed=2)
    g = torch.Generator().manual_seed(2)
    n = 700
    blocks = list(range(2, 2 + (n + BLOCK - 1) // BLOCK))
    queries = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    width = len(blocks) + 4
    prefill = _run(backend, [queries], [n], [blocks], kc, vc, width)
    for pos in (0, 5, 127, 128, 300, 511, 512, 600, 699):
        decode = _run(backend, [queries[pos:pos + 1]], [pos + 1], [blocks[:pos // BLOCK + 1]], kc, vc, width)[0]
        assert torch.equal(prefill[pos], decode), pos


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49152, 576)])
def test_linear_rows_do_not_depend_on_the_row_count(dtype, shape):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    x = torch.randn(3 * ROW_TILE + 5, shape[1], generator=g).to(dtype)
    residual = torch.randn(x.shape[0], shape[0], generator=g).to(dtype)
    packed = PackedWeights()
    packed.batch_invariant = True
    for res in (None, residual):
        alone = torch.cat([packed.linear("w", x[i:i + 1], weight, None, None if res is None else res[i:i + 1])
                           for i in (0, 7, ROW_TILE + 3, x.shape[0] - 1)])
        for rows in (8, ROW_TILE + 4, x.shape[0]):
            got = packed.linear("w", x[:rows], weight, None, None if res is None else res[:rows])
            expect = [i for i in (0, 7, ROW_TILE + 3, x.shape[0] - 1) if i < rows]
            assert torch.equal(got[expect], alone[:len(expect)]), (rows, res is None)


def _triton_batch_invariant():
    """kernels.triton_batch_invariant, or a skip when Triton's interpreter is not active here."""
    pytest.importorskip("triton")
    from kernels.triton_jit import interpreter_active

    if not torch.cuda.is_available() and not interpreter_active():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 (tests/conftest.py sets it first)")
    from kernels import triton_batch_invariant

    return triton_batch_invariant


# float32 runs exact products (ieee); float16 is what the interpreter can run
# of the half-precision path (its bfloat16 tl.dot is not supported).
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_triton_linear_matches_float64_and_rows_do_not_depend_on_the_row_count(dtype, tol):
    bi = _triton_batch_invariant()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    n, k = 200, 150  # neither a multiple of the 64-wide tiles
    weight = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    x = torch.randn(130, k, generator=g).to(dtype).to(device)
    residual = torch.randn(130, n, generator=g).to(dtype).to(device)
    full = bi.linear(x, weight, bias, residual)
    ref = residual.double() + x.double() @ weight.double().T + bias.double()
    assert ((full.double() - ref).norm() / ref.norm()).item() < tol
    rows = [0, 5, 63, 64, 129]
    alone = torch.cat([bi.linear(x[i:i + 1], weight, bias, residual[i:i + 1]) for i in rows])
    assert torch.equal(full[rows], alone)
    for m in (7, 65):
        part = bi.linear(x[:m], weight, None, None)
        assert torch.equal(part[[0, m - 1]], torch.cat([bi.linear(x[i:i + 1], weight) for i in (0, m - 1)]))
    with pytest.raises(ValueError, match="contiguous"):
        bi.linear(x.T.contiguous().T, weight)
    with pytest.raises(ValueError, match="does not match"):
        bi.linear(x, weight[:, :100])


def test_interpreted_triton_dot_sums_each_row_in_k_order_at_any_tile_position():
    """Interpreted, ``tl.dot`` ran on numpy's BLAS, whose AVX2 SGEMM kernel rounds rows 6-11 of every 12
    differently from rows 0-5: a row alone (tile row 0) and in a batch differed in the last bit on AVX2 hosts
    only. The interpreter's dot (tests/conftest.py) sums over K in order: a float32 linear is exactly the
    K-ordered sum of rounded products, whichever tile row holds the row."""
    bi = _triton_batch_invariant()
    if torch.cuda.is_available():
        pytest.skip("pins the interpreter's dot")
    g = torch.Generator().manual_seed(5)
    n, k = 70, 150
    weight = torch.randn(n, k, generator=g)
    x = torch.randn(bi.BLOCK_M, k, generator=g)
    expect = torch.zeros(bi.BLOCK_M, n)
    for i in range(k):
        expect = expect + x[:, i:i + 1] * weight[:, i][None, :]
    assert torch.equal(bi.linear(x, weight), expect)
    row = x[3:4]
    for pos in range(bi.BLOCK_M):
        batch = torch.zeros_like(x)
        batch[pos] = row
        assert torch.equal(bi.linear(batch, weight)[pos], expect[3]), pos


def test_triton_rms_norm_matches_the_model_norm_row_by_row():
    from engine.models.llama import RMSNorm

    bi = _triton_batch_invariant()
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(70, 576, generator=g) * 3
    got = bi.rms_norm(x, norm.weight.detach(), norm.eps)
    torch.testing.assert_close(got, norm(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[[0, 69]], torch.cat([bi.rms_norm(x[i:i + 1], norm.weight.detach(), norm.eps)
                                                for i in (0, 69)]))
