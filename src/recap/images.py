"""Images in: reading user files with clear errors, and seeded synthetic images for checks."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image, ImageDraw, UnidentifiedImageError

from recap.errors import InputError


def load_image(path: str | os.PathLike) -> Image.Image:
    """An RGB image from ``path``; a missing or unreadable file is an `InputError`."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise InputError(f"image not found: {path}") from None
    except IsADirectoryError:
        raise InputError(f"image path is a folder, not a file: {path}") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise InputError(f"cannot read image {path}: {error}") from None


def synthetic_image(seed: int, width: int, height: int) -> Image.Image:
    """A seeded scene of coloured rectangles and ellipses on a coloured background."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(1, 6))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        shape([x0, y0, x1 + 1, y1 + 1], fill=colour)
    return image
