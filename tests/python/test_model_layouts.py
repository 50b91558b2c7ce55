"""docs/models.md's table of layer rules, row by row: a shard started with
the row's --layer-regex and --first-layer-prefix, serving a model with that
family's tensor names, groups them as the family's stages need (everything
the embedding uses in the first layer, one layer per block, the rest in
`final`)."""

import pathlib
import re

import pytest
import torch

import layercast
import layercast.torch
from shards import ShardSet

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"
DEFAULT_REGEX, DEFAULT_PREFIX = r"^model\.layers\.(\d+)\.", "model.embed_tokens."

# Per row (its first column): the first layer's tensors, one block's tensor
# names (with {i}), and the rest.
FAMILIES = {
    "Llama, Mistral, Mixtral, Qwen2, Gemma, Phi-3": (
        ["model.embed_tokens.weight"],
        ["model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.input_layernorm.weight"],
        ["model.norm.weight", "lm_head.weight"]),
    "GPT-2": (
        ["transformer.wte.weight", "transformer.wpe.weight"],
        ["transformer.h.{i}.ln_1.weight", "transformer.h.{i}.attn.c_attn.weight"],
        ["transformer.ln_f.weight"]),
    "Falcon, BLOOM": (
        ["transformer.word_embeddings.weight", "transformer.word_embeddings_layernorm.weight",
         "transformer.word_embeddings_layernorm.bias"],
        ["transformer.h.{i}.input_layernorm.weight",
         "transformer.h.{i}.self_attention.query_key_value.weight"],
        ["transformer.ln_f.weight", "lm_head.weight"]),
    "GPT-NeoX, Pythia": (
        ["gpt_neox.embed_in.weight"],
        ["gpt_neox.layers.{i}.attention.query_key_value.weight",
         "gpt_neox.layers.{i}.input_layernorm.weight"],
        ["gpt_neox.final_layer_norm.weight", "embed_out.weight"]),
    "GPT-J": (
        ["transformer.wte.weight"],
        ["transformer.h.{i}.attn.q_proj.weight", "transformer.h.{i}.ln_1.weight"],
        ["transformer.ln_f.weight", "lm_head.weight"]),
    "T5 (encoder, then decoder)": (
        ["shared.weight"],
        ["encoder.block.{i}.layer.0.SelfAttention.q.weight",
         "encoder.block.{i}.layer.0.layer_norm.weight"],
        ["encoder.final_layer_norm.weight", "decoder.block.0.layer.0.SelfAttention.q.weight",
         "decoder.final_layer_norm.weight", "lm_head.weight"]),
    "a model of your own (`nn.ModuleList` named `blocks`)": (
        ["embed.weight"],
        ["blocks.{i}.attn.weight", "blocks.{i}.norm.weight"],
        ["norm.weight", "head.weight"]),
}


def rows():
    """(family, --layer-regex, --first-layer-prefix) of each table row: the
    first code span of each cell, or the shard's default."""
    found = []
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("family", "---"):
            continue
        regex, prefix = (re.search(r"`([^`]*)`", cell) for cell in cells[2:])
        found.append((cells[0], regex.group(1) if regex else DEFAULT_REGEX,
                       prefix.group(1) if prefix else DEFAULT_PREFIX))
    return found


def test_every_row_has_a_model_here():
    assert [family for family, _, _ in rows()] == list(FAMILIES)


@pytest.mark.parametrize("family, regex, prefix", rows(), ids=[r[0].split(" ")[0] for r in rows()])
def test_the_rows_layout_puts_each_tensor_where_its_stage_runs(tmp_path, family, regex, prefix):
    first, block, rest = FAMILIES[family]
    blocks = [[name.format(i=i) for name in block] for i in range(2)]
    names = first + blocks[0] + blocks[1] + rest
    (tmp_path / "model").mkdir()
    layercast.torch.save_safetensors(tmp_path / "model" / "model.safetensors",
                                     {name: torch.ones(2) for name in names})
    (tmp_path / "shards").mkdir()
    with ShardSet(tmp_path / "shards", 1, ["--model", str(tmp_path / "model"), "--layer-regex",
                                           regex, "--first-layer-prefix", prefix]) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            layers = [(layer["name"], sorted(t["name"] for t in layer["tensors"]))
                      for layer in shard_set.manifest["layers"]]
    assert [tensors for _, tensors in layers] == [sorted(first), sorted(blocks[0]),
                                                 sorted(blocks[1]), sorted(rest)], layers
    assert layers[0][0] == prefix.rstrip(".") and layers[-1][0] == "final"
