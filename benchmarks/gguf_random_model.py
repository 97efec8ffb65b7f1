"""Write a random-weight Llama GGUF of a real model's shape, fast: random but valid quantized blocks.

Shapes (``--shape``): ``1b`` is Llama-3.2-1B's (16 layers, hidden 2048, MLP 8192, 32 query and 8 key/value
heads, tied embeddings), ``8b`` Llama-3-8B's (32 layers, hidden 4096, MLP 14336, 32 / 8 heads, a separate
output matrix). The tokenizer is SmolLM2's, copied from the embedded default model, so the vocabulary is 49152
(Llama 3's is 128256: the embedding and output matrices are smaller than the real models').

File types (``--ftype``), with llama.cpp's ``llama-quantize`` choice of type per tensor:

* ``Q4_0``: every 2-D tensor ``Q4_0`` (as ``llama-quantize --pure``; without it the output matrix would be
  ``Q6_K``);
* ``Q4_K_M``: ``Q4_K``, except ``Q6_K`` for the output matrix (the token embedding when tied) and for
  ``attn_v`` and ``ffn_down`` of the layers ``use_more_bits`` picks (the first and last eighth of the layers
  and every third one between: half of them).

No float weights are made or quantized: each block's codes are random bytes and its float16 scales are set so
that the weights come out at a magnitude like a trained model's (standard deviation a few hundredths); norms
are ones. The file is streamed tensor by tensor (the 8b ``Q4_K_M`` file is 4.2 GiB; it is written in about a
minute). ``benchmarks/llamacpp_targets.py`` runs both engines on these files.

    python benchmarks/gguf_random_model.py --shape 1b --ftype Q4_K_M --out /tmp/llama-1b.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"name": "Llama-3.2-1B", "hidden": 2048, "layers": 16, "intermediate": 8192, "heads": 32, "kv_heads": 8,
           "tied": True},
    "8b": {"name": "Llama-3-8B", "hidden": 4096, "layers": 32, "intermediate": 14336, "heads": 32, "kv_heads": 8,
           "tied": False},
}
FTYPES = ("Q4_0", "Q4_K_M")

# Block scales giving weights of standard deviation ~0.02-0.03 with uniformly random codes:
# Q4_0 w = d (q - 8); Q4_K w = d sc q - dmin mn (sc, mn 6-bit); Q6_K w = d sc (q - 32) (sc int8).
_Q4_0_D = 0.005
_Q4_K_D, _Q4_K_DMIN = 1.0e-4, 7.5e-4
_Q6_K_D = 3.0e-5


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose ``attn_v`` / ``ffn_down`` get more bits in ``Q4_K_M``."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: dict[str, Any], ftype: str) -> Iterator[tuple[str, tuple[int, int] | int, str]]:
    """``(name, (rows, cols) or length, GGML type name)`` of every tensor, in file order."""
    h, f, layers = shape["hidden"], shape["intermediate"], shape["layers"]
    kv = shape["kv_heads"] * h // shape["heads"]
    base = "Q4_0" if ftype == "Q4_0" else "Q4_K"
    high = "Q4_0" if ftype == "Q4_0" else "Q6_K"
    vocab = shape["vocab"]
    yield "token_embd.weight", (vocab, h), high if shape["tied"] else base
    for i in range(layers):
        more = use_more_bits(i, layers)
        for part, dims in (("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, h)),
                           ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
            qtype = high if more and part in ("attn_v", "ffn_down") else base
            yield f"blk.{i}.{part}.weight", dims, qtype
        yield f"blk.{i}.attn_norm.weight", h, "F32"
        yield f"blk.{i}.ffn_norm.weight", h, "F32"
    yield "output_norm.weight", h, "F32"
    if not shape["tied"]:
        yield "output.weight", (vocab, h), high


def random_blocks(rng: Any, rows: int, cols: int, qtype_name: str) -> Any:
    """``[rows, bytes per row]`` uint8: random codes, float16 scales around the constants above."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    blocks = np.frombuffer(bytearray(rng.bytes(n * size)), dtype=np.uint8).reshape(n, size)

    def set_half(offset: int, value: float) -> None:
        d = (value * rng.uniform(0.5, 1.5, size=n)).astype(np.float16)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(n, 2)

    if qtype_name == "Q4_0":
        set_half(0, _Q4_0_D)
    elif qtype_name == "Q4_K":
        set_half(0, _Q4_K_D)
        set_half(2, _Q4_K_DMIN)
    elif qtype_name == "Q6_K":
        set_half(size - 2, _Q6_K_D)
    else:
        raise ValueError(f"no random blocks for {qtype_name}")
    return blocks.reshape(rows, cols // block * size)


def open_writer(path: str, shape_name: str, file_type: Any = None) -> tuple[Any, dict[str, Any]]:
    """A ``gguf.GGUFWriter`` for ``path`` with the shape's Llama metadata and SmolLM2's tokenizer, and the shape
    (with its ``vocab``); tensors are added by the caller.

    Raises:
        KeyError: unknown shape.
    """
    import gguf

    from tokenmill.model_loader.default_model import default_model_path

    shape = dict(SHAPES[shape_name])
    source = gguf.GGUFReader(default_model_path())
    shape["vocab"] = len(source.fields["tokenizer.ggml.tokens"].data)
    h = shape["hidden"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"random-{shape['name']}-shape")
    w.add_block_count(shape["layers"])
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_feed_forward_length(shape["intermediate"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_dimension_count(h // shape["heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape["vocab"])
    if file_type is not None:
        w.add_file_type(file_type)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    return w, shape


def write_model(path: str, shape_name: str, ftype: str, seed: int = 0) -> None:
    """The random GGUF (module docstring), one tensor in memory at a time.

    Raises:
        KeyError: unknown shape; ValueError: unknown file type.
    """
    import gguf
    import numpy as np

    if ftype not in FTYPES:
        raise ValueError(f"ftype: expected one of {FTYPES}, got {ftype!r}")
    w, shape = open_writer(path, shape_name, gguf.LlamaFileType.MOSTLY_Q4_0 if ftype == "Q4_0"
                           else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    plan = list(tensor_plan(shape, ftype))
    for name, dims, qtype_name in plan:
        if qtype_name == "F32":
            w.add_tensor_info(name, (dims,), np.dtype(np.float32), dims * 4)
            continue
        rows, cols = dims
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name]]
        w.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size,
                          raw_dtype=gguf.GGMLQuantizationType[qtype_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, dims, qtype_name in plan:
        if qtype_name == "F32":
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            w.write_tensor_data(random_blocks(rng, dims[0], dims[1], qtype_name))
    w.close()


def ensure_model(directory: str, shape_name: str, ftype: str) -> str:
    """The file's path under ``directory``, written first unless it is there."""
    path = os.path.join(directory, f"llama-{shape_name}-shape-random.{ftype}.gguf")
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        start = time.perf_counter()
        write_model(path + ".tmp", shape_name, ftype)
        os.replace(path + ".tmp", path)
        print(f"wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB) in {time.perf_counter() - start:.0f} s",
              flush=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="1b")
    parser.add_argument("--ftype", choices=list(FTYPES), default="Q4_K_M")
    parser.add_argument("--out", help="the file (default: under --dir, named by shape and type)")
    parser.add_argument("--dir", default="/tmp/tokenmill-gguf-bench")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out:
        start = time.perf_counter()
        write_model(args.out, args.shape, args.ftype, args.seed)
        print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**30:.2f} GiB) in {time.perf_counter() - start:.0f} s")
    else:
        ensure_model(args.dir, args.shape, args.ftype)


if __name__ == "__main__":
    main()
