"""State layers (Mamba2, Mamba-1, gated DeltaNet) of hybrid models: portable ops, their custom-op hooks, the mixer layer and the
per-step state metadata (see ``docs/architecture.md``, "The hybrid cache")."""

from tokenmill.layers.mamba.abstract import MambaBase, allocate_state_caches, state_bytes_per_slot
from tokenmill.layers.mamba.gated_delta_net import GatedDeltaNet
from tokenmill.layers.mamba.mamba_mixer2 import MambaMixer2
from tokenmill.layers.mamba.state_metadata import StateMetadata
from tokenmill.layers.mamba.mamba_mixer import MambaMixer
from tokenmill.layers.mamba.state_ops import CausalConv1d, GatedDeltaRule, MambaSSD, RMSNormGated, SelectiveScan

__all__ = [
    "CausalConv1d",
    "GatedDeltaNet",
    "GatedDeltaRule",
    "MambaBase",
    "MambaMixer",
    "MambaMixer2",
    "MambaSSD",
    "RMSNormGated",
    "SelectiveScan",
    "StateMetadata",
    "allocate_state_caches",
    "state_bytes_per_slot",
]
