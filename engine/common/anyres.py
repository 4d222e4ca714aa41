"""LLaVA-NeXT's "anyres" layout of an image, as transformers' processor and model compute it, shared
by the front (how many tokens an image takes) and the model (how its tiles' features are packed):
the image is resized into the best of the checkpoint's grid resolutions and cut into square tiles
of the ViT's size, plus the whole image once (the base); the tiles' patch features, laid out as
one grid, lose the rows (or columns) that were padding, and each row ends in a newline token."""
from __future__ import annotations


def best_resolution(height: int, width: int, pinpoints: list[list[int]]) -> tuple[int, int]:
    """The (height, width) among `pinpoints` that keeps most of the image at the least waste."""
    best, most, least_waste = (0, 0), 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - effective
        if effective > most or (effective == most and waste < least_waste):
            best, most, least_waste = (h, w), effective, waste
    return best


def tile_grid(height: int, width: int, pinpoints: list[list[int]], tile: int) -> tuple[int, int]:
    """Tiles down and across for an image of height x width."""
    h, w = best_resolution(height, width, pinpoints)
    return h // tile, w // tile


def unpadded(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """Of a rows x cols feature grid over an image of height x width padded to its aspect: the
    padding cut from each end, and along which axis (0: rows, 1: columns)."""
    if width / height > cols / rows:
        return (rows - int(round(height * (cols / width), 7))) // 2, 0
    return (cols - int(round(width * (rows / height), 7))) // 2, 1


def num_tokens(height: int, width: int, pinpoints: list[list[int]], tile: int, side: int) -> int:
    """The tokens an image of height x width takes: the base's side^2 patches, and the tiles' grid
    unpadded, each of its rows and a newline."""
    grid_h, grid_w = tile_grid(height, width, pinpoints, tile)
    rows, cols = grid_h * side, grid_w * side
    cut, axis = unpadded(height, width, rows, cols)
    if axis == 0:
        rows -= 2 * cut
    else:
        cols -= 2 * cut
    return side * side + rows * (cols + 1)
