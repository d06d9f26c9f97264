"""The configs carry the spec's shapes (spec §1)."""

from __future__ import annotations

import pytest

from reference.config import FLASH, PRO, TINY, DSv4Config, from_hf_config, get_config


def _kind_counts(cfg: DSv4Config) -> tuple[int, int, int]:
    kinds = [cfg.layer_kind(i) for i in range(cfg.n_layers)]
    return kinds.count("swa"), kinds.count("csa"), kinds.count("hca")


def test_layer_kinds_match_the_released_models() -> None:
    assert _kind_counts(FLASH) == (2, 21, 20)
    assert _kind_counts(PRO) == (0, 30, 31)
    assert FLASH.layer_kind(FLASH.n_layers) == "swa" == PRO.layer_kind(PRO.n_layers)  # MTP layer


def test_derived_shapes_of_the_output_projection() -> None:
    assert (FLASH.heads_per_group, FLASH.o_group_dim, FLASH.nope_head_dim) == (8, 4096, 448)
    assert (PRO.o_groups, PRO.o_group_dim) == (16, 4096)


def test_tiny_keeps_every_structural_feature() -> None:
    kinds = {TINY.layer_kind(i) for i in range(TINY.n_layers)}
    assert kinds == {"swa", "csa", "hca"}
    hash_layers = [TINY.is_hash_layer(i) for i in range(TINY.n_layers + 1)]
    assert any(hash_layers) and not all(hash_layers) and not TINY.is_hash_layer(TINY.n_layers)
    assert TINY.o_groups > 1 and TINY.head_dim == 512 and TINY.rope_head_dim == 64
    assert TINY.index_head_dim == 128 and TINY.dim % 128 == 0 and TINY.moe_inter_dim % 128 == 0


def test_from_hf_config_rejects_other_architectures_and_missing_keys() -> None:
    with pytest.raises(ValueError, match="model_type"):
        from_hf_config({"model_type": "deepseek_v41"})
    with pytest.raises(ValueError, match="missing required DSv4 keys"):
        from_hf_config({"model_type": "deepseek_v4", "hidden_size": 4096})
    with pytest.raises(ValueError, match="scoring_func"):
        from_hf_config({"scoring_func": "softmax"})


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="compress_ratios"):
        TINY.replace(compress_ratios=(0, 4))
    with pytest.raises(ValueError, match="layer_id"):
        TINY.layer_kind(99)
    with pytest.raises(ValueError, match="config"):
        get_config("ULTRA")
