"""Model folders with a doctored checkpoint, for the loader's errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def copy_with(folder: Path, dest: Path, tensors: dict[str, torch.Tensor | None]) -> Path:
    """A copy of ``folder`` whose checkpoint has ``tensors`` replaced (None: dropped)."""
    from safetensors.torch import load_file, save_file

    for path in folder.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, dest / path.name)
    (source,) = folder.glob("*.safetensors")
    state = load_file(source)
    for name, tensor in tensors.items():
        if tensor is None:
            state.pop(name)
        else:
            state[name] = tensor
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    return dest
