"""A Hugging Face LlamaForCausalLM with the weights of an ortex model folder (bench/gpu/).

"The same weights" for the GPU benchmark's transformers side: the folder's initializers (model.onnx
with its external data, ts/modelkit/llama.ts names them after Hugging Face's parameters and stores
linear layers as float32 [in, out], i.e. transposed) become a LlamaForCausalLM's state dict, and
the config is read off the folder, not assumed:

- sizes from genai_config.json (hidden size, heads, KV heads, head size, layers, vocabulary,
  context length) and the intermediate size from the MLP's weights;
- the RMSNorm epsilon from the graph (the final norm's Add constant, or a *LayerNormalization
  node's epsilon attribute);
- the rotary base from the folder's own cos/sin tables: theta is solved from one entry, and the
  whole table must equal the default (unscaled) rotary tables for that theta, else the folder is
  refused (a scaled rope would not map 1:1);
- a tied head where the folder has no lm_head.weight (its graph multiplies by the embedding);
  q/k/v biases where the folder has them (qwen2-style imports: o_proj's bias is zero).

Folders whose linear layers are 4-bit blocks (com.microsoft.MatMulNBits) are refused: their
weights are not a plain matrix to copy.

`check(folder)` proves the mapping: it runs the folder's model.onnx on ONNX Runtime (CPU) and the
converted model on the same ids and compares the logits (bench/gpu/check_hf.py; bench/gpu/test-cpu.sh).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MATMUL_NBITS = "MatMulNBits"


class FolderError(ValueError):
    """The folder cannot be mapped 1:1 onto a LlamaForCausalLM."""


def _onnx_model(folder: Path):
    import onnx

    return onnx.load(str(folder / "model.onnx"), load_external_data=False)


def read_initializers(folder: Path) -> dict:
    """Every initializer of the folder's graph as a numpy array (external data read from the folder)."""
    from onnx import numpy_helper

    model = _onnx_model(folder)
    if any(n.op_type == MATMUL_NBITS for n in model.graph.node):
        raise FolderError(f"{folder}: its linear layers are 4-bit blocks (MatMulNBits): import it with --weights fp32")
    return {t.name: numpy_helper.to_array(t, base_dir=str(folder)) for t in model.graph.initializer}, model


def _constant_scalar(model, name: str, initializers: dict) -> float | None:
    if name in initializers and initializers[name].size == 1:
        return float(initializers[name].reshape(()))
    from onnx import numpy_helper

    for node in model.graph.node:
        if node.op_type == "Constant" and name in node.output:
            for attr in node.attribute:
                if attr.name == "value":
                    value = numpy_helper.to_array(attr.t)
                    if value.size == 1:
                        return float(value.reshape(()))
                if attr.name == "value_float":
                    return float(attr.f)
    return None


def rms_norm_eps(model, initializers: dict) -> float:
    """The epsilon of the folder's RMSNorm: an epsilon attribute, or the final norm's Add constant."""
    for node in model.graph.node:
        if node.op_type.endswith("LayerNormalization") or node.op_type == "RMSNormalization":
            for attr in node.attribute:
                if attr.name == "epsilon":
                    return float(attr.f)
    for node in model.graph.node:
        if node.op_type == "Add" and node.name.startswith("/model/norm"):
            for name in node.input:
                value = _constant_scalar(model, name, initializers)
                if value is not None:
                    return value
    raise FolderError("no RMSNorm epsilon found in the graph (neither an epsilon attribute nor /model/norm's Add)")


def rope_theta(cos, sin, head_size: int) -> float:
    """The rotary base whose default tables are the folder's (cos/sin [context, head_size / 2])."""
    import numpy as np

    half = head_size // 2
    if cos.shape[1] != half or sin.shape != cos.shape:
        raise FolderError(f"rotary tables of shape {cos.shape} do not fit head size {head_size}")
    # position 1, frequency 1: angle = theta^(-2/head_size)
    angle = math.atan2(float(sin[1, 1]), float(cos[1, 1]))
    theta = angle ** (-head_size / 2)
    inv_freq = 1.0 / (theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size))
    angles = np.arange(cos.shape[0], dtype=np.float64)[:, None] * inv_freq[None, :]
    worst = max(float(np.abs(np.cos(angles) - cos).max()), float(np.abs(np.sin(angles) - sin).max()))
    if worst > 1e-3:
        raise FolderError(f"the rotary tables are not the default ones for theta {theta:.1f} (max difference {worst:.2e})")
    # theta is solved from a float32 entry: the usual bases are round numbers
    rounded = float(round(theta))
    return rounded if abs(rounded - theta) / theta < 1e-3 else theta


def hf_config(folder: Path, initializers: dict, model):
    """The LlamaConfig of the folder (see the module's docstring for where each field comes from)."""
    from transformers import LlamaConfig

    genai = json.loads((folder / "genai_config.json").read_text())["model"]
    d = genai["decoder"]
    head_size = int(d["head_size"])
    gate = initializers.get("model.layers.0.mlp.gate_proj.weight")
    if gate is None:
        raise FolderError("no model.layers.0.mlp.gate_proj.weight: not an ortex Llama folder")
    tied = "lm_head.weight" not in initializers
    bias = "model.layers.0.self_attn.q_proj.bias" in initializers
    theta = rope_theta(initializers["cos_cache"], initializers["sin_cache"], head_size)
    fields = dict(
        vocab_size=int(genai["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(gate.shape[1]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=int(d["num_attention_heads"]),
        num_key_value_heads=int(d["num_key_value_heads"]),
        head_dim=head_size,
        max_position_embeddings=int(genai["context_length"]),
        rms_norm_eps=rms_norm_eps(model, initializers),
        hidden_act="silu",
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=False,
        bos_token_id=genai.get("bos_token_id"),
        eos_token_id=genai.get("eos_token_id"),
        pad_token_id=genai.get("pad_token_id"),
    )
    config = LlamaConfig(**fields, rope_theta=theta)
    # transformers 5 keeps the base in rope_parameters; 4.x in rope_theta
    if getattr(config, "rope_parameters", None) is not None:
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return config


def state_dict(initializers: dict, config, torch_dtype):
    """The folder's weights under Hugging Face's names and layouts ([out, in] linear weights)."""
    import numpy as np
    import torch

    out = {}
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, value in initializers.items():
        if name in ("cos_cache", "sin_cache") or not (name.startswith("model.") or name.startswith("lm_head.")):
            continue
        array = np.array(value, dtype=np.float32)  # a writable copy
        if name.endswith(".weight") and (name.split(".")[-2] in linear or name == "lm_head.weight"):
            array = array.T  # stored [in, out] for MatMul
        out[name] = torch.from_numpy(np.ascontiguousarray(array)).to(torch_dtype)
    if config.attention_bias:
        for layer in range(config.num_hidden_layers):
            out[f"model.layers.{layer}.self_attn.o_proj.bias"] = torch.zeros(config.hidden_size, dtype=torch_dtype)
    return out


def load_llama(folder: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(LlamaForCausalLM on `device` in `dtype`, its config) with the folder's weights."""
    import torch
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    initializers, model = read_initializers(folder)
    config = hf_config(folder, initializers, model)
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    weights = state_dict(initializers, config, torch_dtype)
    missing, unexpected = llama.load_state_dict(weights, strict=False, assign=True)
    # a tied head is the embedding itself; the rotary buffers are computed, not loaded
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight") and "rotary_emb" not in m]
    if missing or unexpected:
        raise FolderError(f"weights do not map 1:1: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        llama.tie_weights()
    # The rotary frequencies were made on the meta device, and .to(dtype) would round them to the
    # weights' type: made anew on the device they stay float32, as transformers' own loading keeps them.
    rotary = type(llama.model.rotary_emb)
    llama.model.rotary_emb = torch.nn.Identity()
    llama = llama.to(device=device, dtype=torch_dtype)
    llama.model.rotary_emb = rotary(config=config).to(device)
    return llama.eval(), config


def onnx_logits(folder: Path, ids: list[int]):
    """Logits [len(ids), vocab] of the folder's model.onnx on ONNX Runtime's CPU provider, empty past."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    genai = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    n = len(ids)
    feeds = {}
    for i in session.get_inputs():
        element = np.float16 if "float16" in i.type else np.float32
        if i.name == "input_ids":
            feeds[i.name] = np.array([ids], np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, n), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(n, dtype=np.int64)[None, :]
        elif i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, int(genai["num_key_value_heads"]), 0, int(genai["head_size"])), element)
        else:
            raise FolderError(f"input {i.name} of {folder}: the check runs past/present folders only")
    logits = session.run(["logits"], feeds)[0]
    return np.asarray(logits, np.float32).reshape(n, -1)


def check(folder: str | Path, ids: list[int]) -> dict:
    """Compares the converted model's float32 logits with ONNX Runtime's on the folder."""
    import numpy as np
    import torch

    folder = Path(folder)
    llama, config = load_llama(folder, "float32", "cpu")
    with torch.no_grad():
        ours = llama(torch.tensor([ids])).logits[0].float().numpy()
    theirs = onnx_logits(folder, ids)
    scale = float(np.abs(theirs).max())
    diff = float(np.abs(ours - theirs).max())
    return {
        "tokens": len(ids),
        "maxAbsDiff": diff,
        "maxAbsLogit": scale,
        "argmaxSame": int((ours.argmax(-1) == theirs.argmax(-1)).sum()),
        "ropeTheta": float(config.rope_parameters["rope_theta"]) if getattr(config, "rope_parameters", None) else float(config.rope_theta),
        "rmsNormEps": float(config.rms_norm_eps),
        "tied": bool(config.tie_word_embeddings),
    }
