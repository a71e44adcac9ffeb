"""Object-store keys built from names a checkpoint holds stay under the prefix the user named
(issue 46, class 1; the local rules: ``tests/hostile/test_escapes.py``). On ``s3://`` and
``gs://`` there are no symbolic links: the names are checked as names, before any request for
a key they lead to. An absolute name matters most there: ``epath`` joins ``gs://b/hf`` and
``/x`` into the local path ``/x``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from etils import epath
from safetensors.numpy import save as save_pt

import orbax_safetensors as osf

MAPPING = osf.KeyMapping([osf.Rule("{k:.*}", "{k}")])


def test_an_index_naming_keys_outside_the_prefix_is_refused(store: Any, tmp_path: Any) -> None:
    _, bucket = store
    prefix = epath.Path(bucket) / "hf"
    embed, proj = np.ones((2, 2), np.float32), np.zeros((2,), np.float32)
    (prefix / "a.safetensors").write_bytes(save_pt({"embed": embed}, {"format": "pt"}))
    (prefix / "b.safetensors").write_bytes(save_pt({"proj": proj}, {"format": "pt"}))
    (epath.Path(bucket) / "outside.safetensors").write_bytes(save_pt({"embed": 7 * embed}))
    index = {"weight_map": {"embed": "a.safetensors", "proj": "b.safetensors"}}
    (prefix / "model.safetensors.index.json").write_text(json.dumps(index))
    assert osf.load_pytorch(None, str(prefix), MAPPING)["embed"].shape == (2, 2)
    local = tmp_path / "local.safetensors"  # (a local file that would read fine)
    local.write_bytes(save_pt({"embed": 7 * embed}))
    for name in (str(local), "../outside.safetensors", f"{bucket}/outside.safetensors"):
        index["weight_map"]["embed"] = name
        (prefix / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(osf.UnsafePathError, match="leads outside"):
            osf.load_pytorch(None, str(prefix), MAPPING)
