"""M-RoPE (Qwen2.5-VL, Qwen3-VL): each token has three positions, time, height and width, and each
turns its own share of the rotary frequencies (mrope_section: contiguous sections, or Qwen3-VL's
interleaved in turn). A text token's three are equal, so its RoPE is plain RoPE at that position;
an image's tokens count their grid cell from where the image starts, and the text after the
image goes on from there plus the image's larger side, not its token count. So a request's
positions after its first image differ from its token indices by a fixed `delta` (negative), the
same for every token it generates: the runner keeps the prompt's positions and the delta per
request (computed on the host from the images' grids, as transformers' get_rope_index computes
them: Qwen3-VL's gives images the same positions), and the KV cache stays indexed by token."""
from __future__ import annotations

import numpy as np
import torch

from baton.engine.common.core_messages import ImageInput


def prompt_positions(images: list[ImageInput], prompt_len: int, merge: int) -> tuple[np.ndarray, int]:
    """[3, prompt_len] positions of a prompt with `images` (their shapes [grid_t, grid_h, grid_w,
    row]), and the delta of every later token's positions from its index."""
    out = np.empty((3, prompt_len), np.int64)
    at = pos = 0  # the next token, and its position
    for image in sorted(images, key=lambda i: i.offset):
        out[:, at:image.offset] = np.arange(pos, pos + image.offset - at)
        pos += image.offset - at
        t, h, w = image.shape[0], image.shape[1] // merge, image.shape[2] // merge
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        out[:, image.offset:image.offset + image.length] = grid + pos
        pos += max(h, w)
        at = image.offset + image.length
    out[:, at:] = np.arange(pos, pos + prompt_len - at)
    return out, int(out.max(initial=-1)) + 1 - prompt_len


def rows(prompt: np.ndarray, delta: int, start: int, end: int) -> np.ndarray:
    """[3, end - start] positions of a request's tokens [start, end)."""
    cut = min(end, prompt.shape[1])
    later = np.arange(max(start, cut), end) + delta
    return np.concatenate((prompt[:, start:cut], np.broadcast_to(later, (3, later.size))), axis=1)


def streams(section: list[int], interleaved: bool = False) -> list[int]:
    """Which position stream (0 time, 1 height, 2 width) each rotary half-dim turns with:
    contiguous sections (Qwen2.5-VL); or interleaved (Qwen3-VL), half-dim j on stream j % 3 while
    that stream's section lasts (j < 3 x its size), on time otherwise."""
    if not interleaved:
        return [i % 3 for i, n in enumerate(section) for _ in range(n)]
    return [j % 3 if j % 3 and j < 3 * section[j % 3] else 0 for j in range(sum(section))]


def lookup(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, section: list[int],
           interleaved: bool = False):
    """([T, 1, D] cos, sin) for positions [3, T] from one position's tables ([max_len, D], the
    half-dims twice): each half-dim's from the stream `streams` says."""
    stream = torch.tensor(streams(section, interleaved) * 2, device=positions.device)
    pick = stream.view(1, 1, -1).expand(1, positions.shape[1], -1)
    return tuple(table[positions].gather(0, pick)[0].unsqueeze(1) for table in (cos, sin))
