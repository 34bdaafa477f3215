"""Random initial values that do not depend on how a parameter is sharded.

Every rank of a trial builds only the part of the model it holds (``workers.rank.build``), so the
values of a parameter's element must be a function of the parameter, the element and the seed,
never of which rank generates it or how much of the tensor it holds. A 2-D parameter is cut
into fixed ``TILE x TILE`` tiles; each tile draws from its own generator, seeded by
(seed, parameter name, tile row, tile column); a rank draws only the tiles its slice touches,
and keeps the part of each it holds. So a tensor-parallel shard equals the same slice of an
unsharded build (bit for bit on one kind of device: CUDA and CPU generators differ), and a
rank's transient memory is one tile.

What each parameter gets is Hugging Face's Llama initialisation (``PreTrainedModel._init_weights``):
linear and embedding weights ``N(0, initializer_range)``, norm weights 1; and PEFT's LoRA
initialisation (Hu et al. 2021, sec. 4.1; PEFT's ``reset_lora_parameters``): ``A`` uniform in
``+-1/sqrt(fan_in)`` (Kaiming-uniform with ``a = sqrt(5)``), ``B`` zero, so an adapted model
starts equal to its base.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

#: rows and columns of one tile (fixed: changing it changes every initial value)
TILE = 1024


@dataclass(frozen=True)
class Init:
    """How a parameter is drawn: ``normal`` (std), ``uniform`` (+-bound), ``ones`` or ``zeros``."""

    kind: str
    scale: float = 0.0


def init_for(name: str, full_shape: tuple[int, ...], std: float) -> Init:
    """The initialisation of the parameter called ``name`` (its Hugging Face / PEFT name)."""
    if ".lora_A." in name or name.endswith("lora_A"):
        return Init("uniform", full_shape[-1] ** -0.5)
    if ".lora_B." in name or name.endswith("lora_B"):
        return Init("zeros")
    if len(full_shape) == 1:
        return Init("ones" if "norm" in name else "zeros")
    return Init("normal", std)


def tile_seed(seed: int, name: str, row: int, col: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{row}:{col}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def initial_values(
    name: str,
    full_shape: tuple[int, ...],
    init: Init,
    seed: int,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The initial values of ``rows`` x ``cols`` (half-open ranges; default: all) of the
    parameter ``name`` of shape ``full_shape``: the same whichever part is asked for."""
    device = torch.device(device)
    if len(full_shape) == 3 and rows is None and cols is None:
        # an MoE layer's experts as one tensor (transformers' fused experts: E x out x in): each expert's
        # matrix drawn as a 2-D parameter of its own name, so it does not depend on how experts are split
        return torch.stack([initial_values(f"{name}[{e}]", full_shape[1:], init, seed, None, None, device, dtype)
                            for e in range(full_shape[0])])
    if len(full_shape) == 1:
        full_shape = (full_shape[0], 1)
        one_d = True
    else:
        one_d = False
    if len(full_shape) != 2:
        raise ValueError(f"{name}: only 1-D, 2-D and whole 3-D (experts) parameters are initialised here, "
                         f"not {full_shape}")
    r0, r1 = rows if rows is not None else (0, full_shape[0])
    c0, c1 = cols if cols is not None else (0, full_shape[1])
    if not (0 <= r0 <= r1 <= full_shape[0] and 0 <= c0 <= c1 <= full_shape[1]):
        raise ValueError(f"{name}: rows {r0}:{r1} x cols {c0}:{c1} outside {full_shape}")
    out = torch.empty(r1 - r0, c1 - c0, device=device, dtype=dtype)
    if init.kind in ("ones", "zeros"):
        out.fill_(1.0 if init.kind == "ones" else 0.0)
    elif r1 > r0 and c1 > c0:
        generator = torch.Generator(device=device)
        for tr in range(r0 // TILE, -(-r1 // TILE)):
            tile_r0, tile_r1 = tr * TILE, min((tr + 1) * TILE, full_shape[0])
            for tc in range(c0 // TILE, -(-c1 // TILE)):
                tile_c0, tile_c1 = tc * TILE, min((tc + 1) * TILE, full_shape[1])
                generator.manual_seed(tile_seed(seed, name, tr, tc))
                shape = (tile_r1 - tile_r0, tile_c1 - tile_c0)
                if init.kind == "normal":
                    tile = torch.randn(shape, generator=generator, device=device) * init.scale
                elif init.kind == "uniform":
                    tile = (torch.rand(shape, generator=generator, device=device) * 2 - 1) * init.scale
                else:
                    raise ValueError(f"{name}: unknown initialisation {init.kind!r}")
                a0, a1 = max(r0, tile_r0), min(r1, tile_r1)
                b0, b1 = max(c0, tile_c0), min(c1, tile_c1)
                out[a0 - r0 : a1 - r0, b0 - c0 : b1 - c0] = tile[a0 - tile_r0 : a1 - tile_r0,
                                                                 b0 - tile_c0 : b1 - tile_c0]
    return out.view(-1) if one_d else out
