"""DeepSeek V4 model configuration: the released Flash and Pro shapes and a TINY one for CPUs.

Spec §1. Field names follow the official inference `ModelArgs`; `from_hf_config` reads the
Hugging Face `config.json` key names.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, Literal

LayerKind = Literal["swa", "csa", "hca"]


@dataclass(frozen=True)
class DSv4Config:
    """Shapes and hyper-parameters of one DSv4 model (spec §1).

    `compress_ratios` has `n_layers + 1` entries; the last one is the MTP layer.
    Ratio 0 = sliding-window only (SWA), 4 = compressed sparse attention (CSA, with the lightning
    indexer), 128 = heavily compressed attention (HCA, every compressed entry, no indexer).
    """

    name: str
    dim: int
    n_layers: int
    vocab_size: int
    n_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    route_scale: float
    n_hash_layers: int
    head_dim: int = 512
    rope_head_dim: int = 64
    n_shared_experts: int = 1
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    norm_eps: float = 1e-6
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    def __post_init__(self) -> None:
        if len(self.compress_ratios) != self.n_layers + 1:
            raise ValueError(
                f"compress_ratios: expected n_layers + 1 = {self.n_layers + 1} entries (the last is the "
                f"MTP layer), got {len(self.compress_ratios)}"
            )
        bad = sorted({r for r in self.compress_ratios if r not in (0, 4, 128)})
        if bad:
            raise ValueError(f"compress_ratios: every entry must be 0, 4 or 128, got {bad}")
        if self.n_heads % self.o_groups:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of o_groups ({self.o_groups})")
        if self.head_dim <= self.rope_head_dim:
            raise ValueError(f"head_dim ({self.head_dim}) must exceed rope_head_dim ({self.rope_head_dim})")
        if self.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts: the official code asserts 1, got {self.n_shared_experts}")

    @property
    def nope_head_dim(self) -> int:
        """Head dims without RoPE (448 for every released model)."""
        return self.head_dim - self.rope_head_dim

    @property
    def heads_per_group(self) -> int:
        """Query heads whose outputs one `wo_a` group consumes (8 for Flash and Pro)."""
        return self.n_heads // self.o_groups

    @property
    def o_group_dim(self) -> int:
        """Input width of one `wo_a` group: heads_per_group x head_dim (4096 for Flash and Pro)."""
        return self.heads_per_group * self.head_dim

    def compress_ratio(self, layer_id: int) -> int:
        """Compression ratio of layer `layer_id` (`n_layers` is the MTP layer)."""
        if not 0 <= layer_id <= self.n_layers:
            raise ValueError(f"layer_id: expected 0..{self.n_layers} (n_layers is the MTP layer), got {layer_id}")
        return self.compress_ratios[layer_id]

    def layer_kind(self, layer_id: int) -> LayerKind:
        """`"swa"`, `"csa"` or `"hca"` for layer `layer_id` (spec §3.1)."""
        return {0: "swa", 4: "csa", 128: "hca"}[self.compress_ratio(layer_id)]  # type: ignore[return-value]

    def is_hash_layer(self, layer_id: int) -> bool:
        """Hash layers route by token id (spec §5.1); the MTP layer never does."""
        return layer_id < self.n_hash_layers and layer_id != self.n_layers

    def replace(self, **changes: Any) -> DSv4Config:
        """A copy with some fields changed (e.g. fewer layers for a test)."""
        return replace(self, **changes)


FLASH = DSv4Config(
    name="FLASH",
    dim=4096,
    n_layers=43,
    vocab_size=129280,
    n_heads=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    window_size=128,
    compress_ratios=(0, 0, *((4, 128) * 20), 4, 0),
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=256,
    n_activated_experts=6,
    moe_inter_dim=2048,
    route_scale=1.5,
    n_hash_layers=3,
)

PRO = DSv4Config(
    name="PRO",
    dim=7168,
    n_layers=61,
    vocab_size=129280,
    n_heads=128,
    q_lora_rank=1536,
    o_groups=16,
    o_lora_rank=1024,
    window_size=128,
    compress_ratios=(128, 128, *((4, 128) * 29), 4, 0),
    index_n_heads=64,
    index_head_dim=128,
    index_topk=1024,
    n_routed_experts=384,
    n_activated_experts=6,
    moe_inter_dim=3072,
    route_scale=2.5,
    n_hash_layers=3,
)

# Every structural feature of the real models (all three layer kinds, hash and non-hash MoE layers,
# the sink, several wo_a groups, 512-d heads with 64 RoPE dims, 128-d indexer heads, 128-wide FP8
# blocks) at sizes a CPU runs in milliseconds. Layers: 0 SWA, 1 CSA, 2 HCA (hash MoE), 3 CSA (biased
# top-k MoE), 4 MTP (SWA).
TINY = DSv4Config(
    name="TINY",
    dim=256,
    n_layers=4,
    vocab_size=512,
    n_heads=8,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=256,
    window_size=128,
    compress_ratios=(0, 4, 128, 4, 0),
    index_n_heads=4,
    index_head_dim=128,
    index_topk=8,
    n_routed_experts=16,
    n_activated_experts=6,
    moe_inter_dim=256,
    route_scale=1.5,
    n_hash_layers=3,
)

CONFIGS: dict[str, DSv4Config] = {c.name: c for c in (TINY, FLASH, PRO)}


def get_config(name: str) -> DSv4Config:
    """`FLASH`, `PRO` or `TINY` by name (case-insensitive)."""
    try:
        return CONFIGS[name.upper()]
    except KeyError:
        raise ValueError(f"config: expected one of {sorted(CONFIGS)}, got {name!r}") from None


# HF key -> ModelArgs field. Nested rope_scaling keys are handled separately.
_HF_KEYS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "vocab_size": "vocab_size",
    "num_attention_heads": "n_heads",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "compress_ratios": "compress_ratios",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "routed_scaling_factor": "route_scale",
    "num_hash_layers": "n_hash_layers",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "n_shared_experts": "n_shared_experts",
    "swiglu_limit": "swiglu_limit",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "rms_norm_eps": "norm_eps",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
}


def from_hf_config(hf: dict[str, Any], name: str | None = None) -> DSv4Config:
    """Build a `DSv4Config` from a Hugging Face `config.json` dict of DeepSeek-V4-Flash or -Pro.

    Raises `ValueError` naming the key when a required key is missing, when the model is not DSv4
    (e.g. `deepseek_v41`, a different architecture), or when a value contradicts the spec
    (sqrtsoftplus scoring, noaux_tc top-k, one shared KV head, no group-limited routing).
    """
    if not isinstance(hf, dict):
        raise TypeError(f"hf: expected the dict of a config.json, got {type(hf).__name__}")
    model_type = hf.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ValueError(f"hf['model_type']: expected 'deepseek_v4', got {model_type!r} (V4.1 is a different model)")
    checks = {
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "num_key_value_heads": 1,
        "norm_topk_prob": True,
    }
    for key, want in checks.items():
        if key in hf and hf[key] != want:
            raise ValueError(f"hf[{key!r}]: expected {want!r} for DSv4, got {hf[key]!r}")
    for key in ("n_group", "topk_group"):
        if hf.get(key) not in (None, 1):
            raise ValueError(f"hf[{key!r}]: DSv4 has no group-limited routing, got {hf[key]!r}")
    kwargs: dict[str, Any] = {}
    for hf_key, field_name in _HF_KEYS.items():
        if hf_key in hf:
            value = hf[hf_key]
            kwargs[field_name] = tuple(value) if field_name == "compress_ratios" else value
    rope_scaling = hf.get("rope_scaling") or {}
    if rope_scaling:
        if rope_scaling.get("type", rope_scaling.get("rope_type", "yarn")) != "yarn":
            raise ValueError(f"hf['rope_scaling']: expected YaRN, got {rope_scaling!r}")
        for hf_key, field_name in (("factor", "rope_factor"), ("original_max_position_embeddings", "original_seq_len"),
                                   ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
            if hf_key in rope_scaling:
                kwargs[field_name] = rope_scaling[hf_key]
    missing = sorted(
        hf_key for hf_key, field_name in _HF_KEYS.items()
        if field_name not in kwargs and field_name in _required_fields()
    )
    if missing:
        raise ValueError(f"hf: missing required DSv4 keys {missing}")
    if name is None:
        name = {4096: "FLASH", 7168: "PRO"}.get(int(kwargs["dim"]), "HF")
    return DSv4Config(name=name, **kwargs)


def _required_fields() -> set[str]:
    return {f.name for f in fields(DSv4Config) if f.default is MISSING} - {"name"}
