"""Export the two encoders as ONNX graphs for search services.

``OUT/image_encoder.onnx``: ``pixels`` float32 (B, 3, S, S), already preprocessed ->
``embedding`` float32 (B, D), L2-normalised.
``OUT/text_encoder.onnx``: ``tokens`` int64 (B, L) from the model's tokenizer ->
``embedding`` float32 (B, D), L2-normalised.
``OUT/onnx_config.json`` records the shapes, opset, preprocessing and tokenizer.

The batch axis is dynamic.  We use torch's TorchScript-based exporter
(``dynamo=False``): the dynamo exporter needs ``onnxscript``, which is not a
dependency.  Exporting in eval mode makes patch dropout the identity.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mmalign.extras import extra
from mmalign.models.load import Loaded

OPSET = 17  # >= 14 for the attention ops; 17 adds a native LayerNormalization
IMAGE_GRAPH = "image_encoder.onnx"
TEXT_GRAPH = "text_encoder.onnx"
CONFIG = "onnx_config.json"


class _ImageEmbedder(nn.Module):
    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.visual(pixels), dim=-1)  # (B, D)


class _TextEmbedder(nn.Module):
    def __init__(self, text: nn.Module):
        super().__init__()
        self.text = text

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(tokens), dim=-1)  # (B, D)


def _export(module: nn.Module, example: torch.Tensor, path: Path, input_name: str) -> None:
    # nn.MultiheadAttention's inference fast path is a fused op with no ONNX symbolic;
    # switch it off while tracing so the graph is made of plain matmuls and softmax.
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # tracer warnings about python control flow on shapes
            torch.onnx.export(
                module,
                (example,),
                str(path),
                dynamo=False,
                opset_version=OPSET,
                input_names=[input_name],
                output_names=["embedding"],
                dynamic_axes={input_name: {0: "batch"}, "embedding": {0: "batch"}},
                do_constant_folding=True,
            )
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


def export_onnx(source: Loaded, out: Path) -> Path:
    with extra("export", "mmalign export --format onnx"):
        import onnx

    model = source.model.eval()
    out.mkdir(parents=True, exist_ok=True)
    size, towers = model.image_size, model.towers
    # each tower kind gives its example input and its tokenizer entry: a kind without those
    # hooks is refused here, never exported with a default tokenizer
    spm = source.tokenizer_file
    tokenizer_entry = towers.text.onnx_tokenizer(None if spm is None else str(spm))
    # Batch 2 for tracing: a batch of 1 invites the tracer to specialise on it.
    pixels = towers.vision.onnx_input(2)  # (2, 3, H, W)
    tokens = towers.text.onnx_input(2, source.tokenizer)  # (2, L) int64
    _export(_ImageEmbedder(model.visual), pixels, out / IMAGE_GRAPH, "pixels")
    _export(_TextEmbedder(model.text), tokens.long(), out / TEXT_GRAPH, "tokens")
    for graph in (IMAGE_GRAPH, TEXT_GRAPH):
        onnx.checker.check_model(str(out / graph))
    config = {
        "image_encoder": {
            "file": IMAGE_GRAPH,
            "input": "pixels",
            "shape": ["batch", 3, size, size],
            "dtype": "float32",
        },
        "text_encoder": {
            "file": TEXT_GRAPH,
            "input": "tokens",
            "shape": ["batch", model.context_length],
            "dtype": "int64",
        },
        "output": {"name": "embedding", "shape": ["batch", model.embed_dim], "normalised": True},
        "opset": OPSET,
        "logit_scale": float(model.logit_scale.detach().exp().reshape(-1)[0]),
        "preprocess_cfg": dict(source.preprocess_cfg),
        "tokenizer": tokenizer_entry,
    }
    if source.tokenizer_file is not None:
        shutil.copyfile(source.tokenizer_file, out / "tokenizer.model")
    if towers.text.ships_files:  # an HF text tower: its tokenizer files beside the graphs
        towers.text.export_files(out / tokenizer_entry["folder"])
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out
