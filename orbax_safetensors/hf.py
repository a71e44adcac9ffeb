"""Hugging Face and PyTorch checkpoints, in one namespace: ``osf.hf``.

Loading a ``save_pretrained`` directory into a JAX model and exporting one back, through a
key mapping: the :class:`KeyMapping` of :class:`Rule` s and value transforms, or a ready-made
preset. Every name here is also at the package's top level (``osf.KeyMapping``); this
namespace gathers them, as ``optax.schedules`` does schedules.

Presets are named (``preset_mapping("qwen3-moe")``, the keys of :data:`PRESETS`) or called
from their family group: ``presets.generic`` (NNX ports that keep Hugging Face's names),
``presets.tunix`` (Tunix's models) and ``presets.maxtext`` (MaxText's train states), each
preset a function with its own documented keyword arguments:

Example::

    import orbax_safetensors as osf

    mapping = osf.hf.presets.maxtext.llama3("/models/Llama-3.1-8B")
    # the same: osf.hf.preset_mapping("maxtext-llama3", hf_config="/models/Llama-3.1-8B")
    osf.hf.export_pytorch("/ckpt/1000/items", "/tmp/hf", mapping)
    state = osf.hf.load_pytorch(None, "/tmp/hf", mapping)
"""

from __future__ import annotations

from orbax_safetensors._src.integrations import presets
from orbax_safetensors._src.integrations.export import export_pytorch
from orbax_safetensors._src.integrations.hf_import import import_pytorch
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport, Rule
from orbax_safetensors._src.integrations.load import abstract_pytorch, load_pytorch
from orbax_safetensors._src.integrations.presets import PRESETS, preset_mapping
from orbax_safetensors._src.integrations.transforms import (
    Chain,
    Offset,
    Reshape,
    RopeInterleave,
    Scale,
    SplitHeads,
    Transform,
    Transpose,
    VocabRows,
)

__all__ = [
    "PRESETS",
    "Chain",
    "KeyMapping",
    "MappingReport",
    "Offset",
    "Reshape",
    "RopeInterleave",
    "Rule",
    "Scale",
    "SplitHeads",
    "Transform",
    "Transpose",
    "VocabRows",
    "abstract_pytorch",
    "export_pytorch",
    "import_pytorch",
    "load_pytorch",
    "preset_mapping",
    "presets",
]
