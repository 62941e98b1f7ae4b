"""Output geometry shared by the image and video transforms and by the limits' estimates."""
from __future__ import annotations

from .params import _Pixels


def target_size(width: int, height: int, params: _Pixels) -> tuple[int, int]:
    """(width, height) after the resize: shorter side = ``params.size`` (aspect kept), then
    scaled up if needed so that the crop fits. Never below 1 px."""
    scale = 1.0
    if params.size is not None:
        scale = params.size / min(width, height)
    w = max(1, round(width * scale))
    h = max(1, round(height * scale))
    if params.crop is not None:
        ch, cw = params.crop
        if h < ch or w < cw:
            up = max(ch / height, cw / width)
            w = max(cw, round(width * up))
            h = max(ch, round(height * up))
    return w, h
