"""The DCP bridge reads and writes large tensors in bounded row ranges (issue 27, item 6).

``nxdtp-merge --to dcp`` cuts every run of a TP piece into chunks of at most ``dcp_export.CHUNK_BYTES``, and
``nxdtp-merge --from-dcp`` reads every tensor over ``dcp_import.BATCH_BYTES`` in row ranges of at most that size and
streams them into the output file, so neither holds a large tensor whole. Here both budgets are lowered to a few
hundred bytes, so a small tied Llama (padded vocabulary, one KV head repeated on both TP ranks, AdamW state) takes
several chunks and several range reads per tensor, and the round trip must still be exact: bitwise the tensors and
optimizer state of a plain merge, and the same logits from the dense HF model.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import WorkerGroup  # noqa: F401  (the worlds fixture lives in conftest)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, LR = 101, 8, 2, 1e-3
BUDGET = 512  # bytes: 4 rows of the hidden size 32 in fp32


def _tied_llama():
    from tests.model_helpers import randomised

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6, attention_dropout=0.0,
        tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    return randomised(transformers.LlamaForCausalLM(config), 1)


def _batch():
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    input_ids[0, 3] = VOCAB - 1  # next to the vocabulary padding
    return dict(input_ids=input_ids, attention_mask=torch.ones(BATCH, SEQ, dtype=torch.long), labels=input_ids)


def _logits(model, tp_vocab=None):
    from nxdtp.models import gather_vocab_logits

    with torch.no_grad():
        logits = model(input_ids=_batch()["input_ids"]).logits
    return (gather_vocab_logits(logits, tp_vocab) if tp_vocab else logits).clone()


def case_train_save(root: str):
    """One AdamW step at tp=2 (vocabulary 101 padded to 104; the one KV head repeated), save; the logits then."""
    from nxdtp import checkpointing
    from nxdtp.models import parallelize_model

    model = parallelize_model(_tied_llama(), make_vocab_size_divisible_by=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model(**_batch()).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    checkpointing.save({"model": model, "optimizer": optimizer, "global_step": 1}, root)
    return _logits(model, VOCAB)


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tied_llama_tp2"))
    return root, worlds(2).run(case_train_save, tensor_model_parallel_size=2, root=root)[0]


def _spy_writes(monkeypatch):
    """Record the bytes of every tensor or part handed to the safetensors writer, per tensor name."""
    from nxdtp.checkpointing.safetensors_stream import StreamingSafetensorsWriter

    sizes = {}
    write_parts = StreamingSafetensorsWriter.write_parts

    def spy(self, name, parts):
        def recorded():
            for part in parts:
                sizes.setdefault(name, []).append(part.numel() * part.element_size())
                yield part

        return write_parts(self, name, recorded())

    monkeypatch.setattr(StreamingSafetensorsWriter, "write_parts", spy)
    return sizes


def test_small_budget_round_trip_is_exact(saved, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from nxdtp.checkpointing import dcp_export, dcp_import, dcp_io
    from nxdtp.checkpointing.merge import merge

    root, tp_logits = saved
    merge(root, str(tmp_path / "merged"), progress=False)
    monkeypatch.setattr(dcp_export, "CHUNK_BYTES", BUDGET)
    monkeypatch.setattr(dcp_io, "COLLECT_BYTES", BUDGET)
    dcp_export.export_dcp(root, str(tmp_path / "dcp"), progress=False)

    # The export: every chunk within the budget; the embedding (4 x 128-byte rows per chunk), its tie and its AdamW
    # moments many chunks each, more than the 2 TP pieces; the repeated KV head written once.
    metadata = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    for key, meta in metadata.items():
        if hasattr(meta, "chunks"):
            itemsize = torch.empty((), dtype=meta.properties.dtype).element_size()
            assert all(max(c.sizes.numel(), 1) * itemsize <= max(BUDGET, _row_bytes(meta)) for c in meta.chunks), key
    for key in ("model.embed_tokens.weight", "lm_head.weight", "optimizer.state.model.embed_tokens.weight.exp_avg",
                "optimizer.state.model.embed_tokens.weight.exp_avg_sq"):
        assert len(metadata[key].chunks) == 13 + 13, key  # 4 rows a chunk: rank 0's 52 rows, rank 1's 49 real ones
    assert tuple(metadata["model.layers.0.self_attn.k_proj.weight"].size) == (8, 32)

    merged = load_file(tmp_path / "merged" / "model.safetensors")
    loaded = {key: torch.zeros_like(value) for key, value in merged.items()}
    loaded["lm_head.weight"] = torch.zeros_like(merged["model.embed_tokens.weight"])
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for key, value in merged.items():
        assert torch.equal(loaded[key], value), key
    assert torch.equal(loaded["lm_head.weight"], merged["model.embed_tokens.weight"])

    # The import: tensors over the budget read in several ranges and written in parts, none over the budget.
    monkeypatch.setattr(dcp_import, "BATCH_BYTES", BUDGET)
    parts = _spy_writes(monkeypatch)
    ranges = {}
    read_boxes = dcp_io.DcpReader.read_boxes

    def counted(self, key, wanted):
        ranges[key] = ranges.get(key, 0) + 1
        return read_boxes(self, key, wanted)

    monkeypatch.setattr(dcp_io.DcpReader, "read_boxes", counted)
    dcp_import.import_dcp(str(tmp_path / "dcp"), str(tmp_path / "imported"), progress=False)
    assert ranges["model.embed_tokens.weight"] >= VOCAB // 4 and ranges["model.layers.0.mlp.down_proj.weight"] > 1
    assert ranges["optimizer.state.model.embed_tokens.weight.exp_avg"] >= VOCAB // 4
    embedding = parts["model.embed_tokens.weight"]
    assert len(embedding) >= VOCAB // 4 and max(embedding) <= BUDGET, embedding
    assert max(max(sizes) for sizes in parts.values()) <= max(BUDGET, 32 * 4)

    imported = load_file(tmp_path / "imported" / "model.safetensors")
    assert sorted(imported) == sorted(merged)
    for key in merged:
        assert torch.equal(imported[key], merged[key]), key
    imported_optimizer = load_file(tmp_path / "imported" / "optimizer.safetensors")
    merged_optimizer = load_file(tmp_path / "merged" / "optimizer.safetensors")
    assert sorted(imported_optimizer) == sorted(merged_optimizer)
    for key in merged_optimizer:
        assert torch.equal(imported_optimizer[key], merged_optimizer[key]), key

    dense = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "imported")
    assert dense.lm_head.weight is dense.model.embed_tokens.weight  # still tied
    logits = _logits(dense)
    assert torch.equal(logits, _logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")))
    torch.testing.assert_close(logits, tp_logits, rtol=1e-5, atol=1e-5)


def _row_bytes(meta) -> int:
    """Bytes of one row (dim 0) of a tensor: the least a chunk cut along dim 0 can hold."""
    itemsize = torch.empty((), dtype=meta.properties.dtype).element_size()
    return max(meta.size[1:].numel(), 1) * itemsize


def test_zero1_export_is_chunked_like_the_parameter(monkeypatch):
    """ZeRO-1 state shaped like its parameter is written one TP piece at a time, cut like the parameter, not
    reassembled whole: the export's ZeRO-1 source (``zero1_source``) streamed into a ``DcpSink`` plans a tensor that
    has its spec and piece reader as chunks of its pieces."""
    from nxdtp.checkpointing import dcp_export
    from nxdtp.checkpointing.dcp_io import DcpSink
    from nxdtp.checkpointing.merge import DenseOptimizerTensor
    from nxdtp.checkpointing.pipeline import stream
    from nxdtp.spec import ParamSpec

    spec = ParamSpec(full_shape=(12, 4), partition_dim=0, num_partitions=2, real_shape=(11, 4))
    dense = torch.arange(44, dtype=torch.float32).reshape(11, 4)
    pieces = [spec.shard(dense, rank) for rank in range(2)]
    reads = []

    def piece(rank):
        reads.append(rank)
        return pieces[rank]

    state = {"state.w.exp_avg": DenseOptimizerTensor(shape=(11, 4), dtype=torch.float32, read=lambda: dense,
                                                     spec=spec, read_piece=piece)}
    monkeypatch.setattr(dcp_export, "CHUNK_BYTES", 2 * 4 * 4)  # two rows
    source, _ = dcp_export.zero1_source(state)
    sink = DcpSink({"state.w.exp_avg": [("w",)]}, {"state.w.exp_avg": spec})
    stream(source, sink, ["state.w.exp_avg"])
    _, _, chunks, read = sink.planned[("w",)]
    assert len(chunks) == 6  # rank 0: rows 0-5 in 3 chunks; rank 1: real rows 6-10 in 3
    rebuilt = torch.zeros_like(dense)
    for offsets, sizes in chunks:
        rebuilt[offsets[0]:offsets[0] + sizes[0]] = read([(offsets, sizes)])[0]
    assert torch.equal(rebuilt, dense) and sorted(set(reads)) == [0, 1]


def test_resharding_import_reads_pieces_in_bounded_slabs_and_equals_nxdtps_own_reshard(saved, tmp_path, monkeypatch):
    """``--from-dcp --reshard 4`` of the export, with the import's budget lowered so every tensor over it is read
    piece by piece in slabs (box reads of the dense tensor: rows of the embedding, columns of the row-parallel
    down_proj): its index and every rank file of model and AdamW state equal bitwise what nxdtp's own reshard of the
    saved tp=2 checkpoint writes, with no part handed to the writer over the budget."""
    from safetensors.torch import load_file

    from nxdtp.checkpointing import dcp_export, dcp_import, dcp_io
    from nxdtp.checkpointing.index import CheckpointIndex, model_file, optim_file
    from nxdtp.checkpointing.merge import reshard
    from nxdtp.converters.dcp import import_dcp_resharded

    root, _ = saved
    expected_tag = reshard(root, str(tmp_path / "resharded"), 4, pad_to_multiple_of=4, progress=False)
    monkeypatch.setattr(dcp_export, "CHUNK_BYTES", BUDGET)
    dcp_export.export_dcp(root, str(tmp_path / "dcp"), progress=False)
    monkeypatch.setattr(dcp_import, "BATCH_BYTES", BUDGET)
    monkeypatch.setattr(dcp_io, "COLLECT_BYTES", BUDGET)
    parts = _spy_writes(monkeypatch)
    boxes = {}
    read_boxes = dcp_io.DcpReader.read_boxes

    def counted(self, key, wanted):
        boxes.setdefault(key, []).extend(wanted)
        return read_boxes(self, key, wanted)

    monkeypatch.setattr(dcp_io.DcpReader, "read_boxes", counted)
    tag = import_dcp_resharded(str(tmp_path / "dcp"), str(tmp_path / "imported"), 4, pad_to_multiple_of=4,
                               progress=False)

    # The embedding (rows) and down_proj (columns: split along dim 1) were read in boxes, never whole.
    embedding, down = boxes["model.embed_tokens.weight"], boxes["model.layers.0.mlp.down_proj.weight"]
    assert len(embedding) >= VOCAB // 4 and all(sizes[0] <= 4 for _, sizes in embedding), embedding
    assert {sizes[1] for _, sizes in down} == {16} and len({offsets[1] for offsets, _ in down}) == 4, down
    assert "optimizer.state.model.embed_tokens.weight.exp_avg" in boxes
    assert max(max(sizes) for sizes in parts.values()) <= BUDGET
    assert len(parts["model.embed_tokens.weight"]) >= 4 * 2  # 104 rows over 4 ranks: 26 rows, 7 slabs each

    mine, theirs = CheckpointIndex.read(tag), CheckpointIndex.read(expected_tag)
    assert {k: e.to_json() for k, e in mine.tensors.items()} == {k: e.to_json() for k, e in theirs.tensors.items()}

    def fields(index):  # the same parameters at the same positions with the same state (in DCP's field order)
        params = index.optimizer["params"]
        return {name: (info["param_index"], sorted(info["tensors"])) for name, info in params.items()}

    assert mine.optimizer["keyed_by"] == theirs.optimizer["keyed_by"] == "name" and fields(mine) == fields(theirs)
    for relative in [model_file(r) for r in range(4)] + [optim_file(r) for r in range(4)]:
        got, want = load_file(f"{tag}/{relative}"), load_file(f"{expected_tag}/{relative}")
        assert sorted(got) == sorted(want), relative
        for key in want:
            assert torch.equal(got[key], want[key]), (relative, key)


def test_merge_streams_large_tensors_in_slabs_of_piece_rows(saved, tmp_path, monkeypatch):
    """With ``pipeline.SLAB_BYTES`` lowered to 512 bytes, the merge writes every tensor over it (the padded, tied
    embedding split along rows, the row-parallel down_proj split along columns, their AdamW moments) in slabs built from
    the rows of the pieces each needs, none over the budget, and the files are bitwise those of a merge that
    reassembles each tensor whole."""
    from safetensors.torch import load_file

    from nxdtp.checkpointing import merge as merge_module
    from nxdtp.checkpointing import pipeline

    root, _ = saved
    merge_module.merge(root, str(tmp_path / "whole"), progress=False)
    monkeypatch.setattr(pipeline, "SLAB_BYTES", BUDGET)
    parts = _spy_writes(monkeypatch)
    merge_module.merge(root, str(tmp_path / "parts"), progress=False)
    for key in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                "state.model.embed_tokens.weight.exp_avg", "state.model.layers.1.mlp.down_proj.weight.exp_avg_sq"):
        assert len(parts[key]) > 4 and max(parts[key]) <= BUDGET, (key, parts[key])
    for name in ("model.safetensors", "optimizer.safetensors"):
        whole, sliced = load_file(tmp_path / "whole" / name), load_file(tmp_path / "parts" / name)
        assert sorted(whole) == sorted(sliced), name
        for key in whole:
            assert torch.equal(whole[key], sliced[key]), (name, key)


class _ChunkCountingReader:
    """A ``DcpReader`` over an in-memory tensor saved as row chunks: each read loads (counts) every saved chunk it
    overlaps, whole, as torch's ``FileSystemReader`` does."""

    def __init__(self, full, chunk_rows, budget):
        from types import SimpleNamespace

        from nxdtp.checkpointing import dcp_io

        self.full, self.budget, self.loads = full, budget, []
        chunks = [SimpleNamespace(offsets=(start,) + (0,) * (full.dim() - 1),
                                  sizes=(min(chunk_rows, full.shape[0] - start),) + tuple(full.shape[1:]))
                  for start in range(0, full.shape[0], chunk_rows)]
        self.saved = {"w": SimpleNamespace(size=full.shape, chunks=chunks,
                                           properties=SimpleNamespace(dtype=full.dtype))}
        self.nbytes = lambda key, sizes=None: dcp_io.DcpReader.nbytes(self, key, sizes)
        self.chunks_over_budget = lambda key: dcp_io.DcpReader.chunks_over_budget(self, key)

    def _load(self, offsets, sizes):
        for chunk in self.saved["w"].chunks:
            if chunk.offsets[0] < offsets[0] + sizes[0] and offsets[0] < chunk.offsets[0] + chunk.sizes[0]:
                self.loads.append(chunk.offsets[0])
        box = self.full
        for dim, (offset, size) in enumerate(zip(offsets, sizes)):
            box = box.narrow(dim, offset, size)
        return box.clone()

    def read_boxes(self, key, boxes):
        return [self._load(*box) for box in boxes]

    def read(self, keys):
        return {key: self._load((0,) * self.full.dim(), tuple(self.full.shape)) for key in keys}


@pytest.mark.parametrize("partition_dim", [None, 0, 1])
def test_a_tensor_saved_in_chunks_over_the_budget_loads_each_chunk_once(partition_dim):
    """Chunks over the read budget are loaded whole by any read: the rows read for one slab are kept and reused by
    the next, so slabs along dim 0 (the dense import, a piece split along dim 0) load each chunk once, and pieces
    split along another dim, which each need every row, read the tensor whole once."""
    from nxdtp.checkpointing import dcp_io, pipeline, slabs
    from nxdtp.spec import ParamSpec

    full = torch.randn(9, 4)
    reader = _ChunkCountingReader(full, chunk_rows=3, budget=2 * 4 * 4)  # two rows: under each chunk
    spec = None if partition_dim is None else ParamSpec(full_shape=(9, 4), partition_dim=partition_dim,
                                                       num_partitions=partition_dim + 1)
    source = dcp_io.DcpSource(reader, {"w": ("w", spec)})

    def read(boxes):
        return source.read_boxes("w", boxes)

    if partition_dim != 1:
        got = torch.cat(list(pipeline.dense_slabs(read, (9, 4), 2)))
        torch.testing.assert_close(got, full, rtol=0, atol=0)
    else:
        for rank in range(2):
            piece = torch.cat(list(slabs.piece_parts(spec, rank, read, 2, torch.float32)))
            torch.testing.assert_close(piece, full.chunk(2, dim=1)[rank], rtol=0, atol=0)
    assert sorted(reader.loads) == [0, 3, 6], reader.loads


def test_the_export_writes_an_empty_tensor_split_over_ranks(tmp_path):
    """No TP piece of a (0, 4) tensor holds a row, so it has no chunk of its own: it is written as one empty chunk, not
    left to DCP's default plan (which cannot copy its placeholder), and reads back with its shape."""
    from types import SimpleNamespace

    from nxdtp.checkpointing import dcp_io
    from nxdtp.spec import ParamSpec

    sink = dcp_io.DcpSink({"w": [("w",)], "v": [("v",)]},
                          {"w": ParamSpec(full_shape=(0, 4), partition_dim=0, num_partitions=2),
                           "v": ParamSpec(full_shape=(4, 2), partition_dim=0, num_partitions=2)})
    v = torch.randn(4, 2)
    sink.write("w", (0, 4), torch.float32, lambda boxes: [torch.empty(sizes) for _, sizes in boxes], 64)
    sink.write("v", (4, 2), torch.float32, lambda boxes: [v[o[0]:o[0] + s[0]] for o, s in boxes], 64)
    sink.save(str(tmp_path / "dcp"), {}, SimpleNamespace(update=lambda n: None))
    saved = dcp_io.read_metadata(str(tmp_path / "dcp")).state_dict_metadata
    assert tuple(saved["w"].size) == (0, 4) and tuple(saved["v"].size) == (4, 2)
    reader = dcp_io.DcpReader(str(tmp_path / "dcp"), dcp_io.read_metadata(str(tmp_path / "dcp")), 1 << 20)
    got = reader.read(["w", "v"])
    assert got["w"].shape == (0, 4) and torch.equal(got["v"], v)
