"""The image encoder of a vision-language store: transformers' own vision tower and projector.

A vision-language checkpoint (`nemotron_h_omni`: a RADIO tower, pixel shuffle, an MLP projector in
front of a NemotronH LM) is repacked like any other; the tensors the architecture names as its
encoder (`Architecture.encoder`) go to the store's encoder.safetensors in the checkpoint's own
names and bytes. Here they are loaded into transformers' model class for the whole checkpoint, built
with a one-layer, eight-token stand-in for the language model (the real one runs through the spine),
so transformers' own weight conversions (the checkpoint's `mlp1.*`, `radio_model.*`, fused `qkv`)
apply unchanged; the stand-in is then dropped.

`encode(pixel_values, image_grid_hw)` gives the projected features of each image, in the LM's hidden
size: the rows that replace the prompt's image-token embeddings (`Engine.extend(..., images=)`),
as transformers' `get_image_features` + `masked_scatter` do.

Where the encoder runs (`mode`): "resident" keeps it on the GPU; "stream" keeps the tower's layers in
pinned RAM and copies layer i+1 to the GPU on a side stream while layer i computes (LayerStream: at
most two layers' weights on the GPU; the patch embedding, projector and norms stay resident, being
small); "auto" is resident when the encoder fits in the VRAM left (within --vram-budget) with room to
spare, else stream. On a CPU-only machine it runs on the CPU.

Shapes: pixel_values [P, 3 * patch**2] (all images' patches, concatenated), image_grid_hw [I, 2]
(each image's patch grid), output [sum(h * w / merge**2), D].
"""

from __future__ import annotations

import copy
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sluice.errors import SluiceError

MAX_IMAGE_BYTES = 32 << 20  # an encoded image larger than this is refused
MAX_IMAGE_PIXELS = 64 << 20  # so is one that decodes to more pixels (a decompression bomb)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(SluiceError):
    """An input image that cannot be used: not an image, truncated, too large, or an unsupported format.
    `status`: the HTTP status the server answers with (400, or 413 for too large)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def load_image(data: bytes, where: str = "image"):
    """Encoded bytes -> an RGB PIL image, fully decoded (so truncation shows here, not later)."""
    try:
        from PIL import Image
    except ImportError:
        raise SluiceError("images need Pillow: pip install pillow (or the 'images' extra)") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{where}: {len(data)} bytes; images up to {MAX_IMAGE_BYTES >> 20} MiB are accepted", 413)
    try:
        img = Image.open(io.BytesIO(data))
    except Exception:
        raise ImageError(f"{where}: not an image (or a format Pillow cannot read)") from None
    if img.format not in FORMATS:
        raise ImageError(f"{where}: {img.format} images are not supported (use {', '.join(FORMATS)})")
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"{where}: {w}x{h} pixels; images up to {MAX_IMAGE_PIXELS >> 20} megapixels are accepted", 413)
    try:
        img.load()
    except Exception as e:
        raise ImageError(f"{where}: the {img.format} data is truncated or corrupt ({e})") from None
    return img.convert("RGB")


@dataclass(frozen=True)
class ImageSettings:
    """The image processor's settings (the store's preprocessor_config.json; transformers' NemotronH omni
    image processor's defaults where a key is absent)."""

    patch: int = 16
    merge: int = 2
    min_patches: int = 1024
    max_patches: int = 13312
    max_model_len: int = 16384
    mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    @classmethod
    def of(cls, path: str | Path) -> "ImageSettings":
        f = Path(path) / "preprocessor_config.json"
        d = json.loads(f.read_text()) if f.is_file() else {}
        d = d.get("image_processor", d)
        base = cls()
        return cls(d.get("patch_size", base.patch), round(1 / d.get("downsample_ratio", 1 / base.merge)),
                   d.get("min_num_patches", base.min_patches), d.get("max_num_patches", base.max_patches),
                   d.get("max_model_len", base.max_model_len), tuple(d.get("image_mean", d.get("norm_mean", base.mean))),
                   tuple(d.get("image_std", d.get("norm_std", base.std))))

    def budget(self, n_images: int, doc: bool) -> int:
        """Patches an image may take. doc: the processor's own budget (its maximum resolution, for reading
        documents); otherwise a quarter of it, at least min_patches (the normal resolution)."""
        full = max((self.max_model_len - 4) * self.merge**2, self.min_patches * n_images)
        if self.max_patches:
            full = min(full, self.max_patches)
        full = max(full, self.min_patches)
        return full if doc else max(self.min_patches, full // 4)


def patch_grid(height: int, width: int, patch: int, merge: int, min_patches: int, max_patches: int) -> tuple[int, int]:
    """The patch grid an image is resized to: near its own, scaled into [min_patches, max_patches], both
    sides multiples of merge (the rule of transformers' NemotronH omni image processor, its rounding
    included: Python's round(x + 0.5) takes an odd whole x up by one; sides of at least one patch where
    that rule would reach zero)."""
    gh, gw = round(height / patch + 0.5), round(width / patch + 0.5)
    factor = min(math.sqrt(max_patches / (gh * gw)), 1.0)
    gh, gw = max(1, math.floor(factor * gh)), max(1, math.floor(factor * gw))
    if max_patches > min_patches and gh * gw < min_patches:
        factor = math.sqrt(min_patches / (gh * gw))
        gh, gw = math.ceil(factor * gh), math.ceil(factor * gw)
    if r := gh % merge:
        gh = gh + merge - r if (gh + merge - r) * gw <= max_patches else max(merge, gh - r)
    if r := gw % merge:
        gw = gw + merge - r if gh * (gw + merge - r) <= max_patches else max(merge, gw - r)
    return gh, gw


def preprocess(images: list, settings: ImageSettings, doc: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RGB PIL images -> (pixel_values [P, 3 * patch**2] fp32, image_grid_hw [I, 2]): each image resized
    (bicubic, antialiased, in fp32) to its patch grid, scaled to [0, 1], normalised, cut into patches
    in row-major order, each patch channel-major."""
    budget = settings.budget(len(images), doc)
    p = settings.patch
    mean = torch.tensor(settings.mean).view(3, 1, 1)
    std = torch.tensor(settings.std).view(3, 1, 1)
    pixels, grids = [], []
    for img in images:
        x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3).permute(2, 0, 1).float()
        gh, gw = patch_grid(img.height, img.width, p, settings.merge, settings.min_patches, budget)
        if (img.height, img.width) != (gh * p, gw * p):
            x = F.interpolate(x[None], size=(gh * p, gw * p), mode="bicubic", align_corners=False, antialias=True)[0]
        x = (x / 255.0 - mean) / std
        pixels.append(x.view(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p))
        grids.append([gh, gw])
    return torch.cat(pixels), torch.tensor(grids)


class LayerStream:
    """A stack of layers run on a CUDA device with their weights in pinned host RAM: before layer i runs,
    the compute stream waits for its copy and the copy of layer i+1 starts on a side stream; after it
    runs, its parameters point back at the host copies (the device copies are freed once the compute
    stream is done with them). `start()` before each pass."""

    def __init__(self, layers, device: torch.device):
        self.layers, self.device = list(layers), device
        self.host = [[(t, t.data.pin_memory()) for t in [*layer.parameters(), *layer.buffers()]] for layer in self.layers]
        for tensors in self.host:
            for t, h in tensors:
                t.data = h
        self.copy = torch.cuda.Stream(device)
        self.ready: list = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: self._before(i))
            layer.register_forward_hook(lambda m, a, o, i=i: self._after(i))
        self.nbytes = sum(h.numel() * h.element_size() for tensors in self.host for _, h in tensors)

    def _fetch(self, i: int) -> None:
        with torch.cuda.stream(self.copy):
            for t, h in self.host[i]:
                t.data = h.to(self.device, non_blocking=True)
            self.ready[i] = torch.cuda.Event()
            self.ready[i].record(self.copy)

    def start(self) -> None:
        if self.layers:
            self._fetch(0)

    def _before(self, i: int) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.ready[i])
        for t, _ in self.host[i]:
            t.data.record_stream(compute)  # allocated on the copy stream, used here
        if i + 1 < len(self.layers):
            self._fetch(i + 1)

    def _after(self, i: int) -> None:
        for t, h in self.host[i]:
            t.data = h


MODES = ("auto", "resident", "stream")
ENCODER_MARGIN = 1 << 30  # VRAM kept free beside a resident encoder, for its activations and the LM's


def stays_resident(nbytes: int, vram_left: int | None) -> bool:
    """The "auto" rule: the encoder stays on the GPU when it fits twice over in the VRAM left (within the
    budget) beyond a margin; else it streams. `sluice plan` applies the same rule."""
    return vram_left is None or 2 * nbytes <= vram_left - ENCODER_MARGIN


class ImageEncoder:
    """The vision tower + projector of the store at `path`, on `device` in `dtype` (see the module doc)."""

    def __init__(self, path: str | Path, encoder_file: str | None, device: torch.device, dtype: torch.dtype,
                 mode: str = "auto", vram_free: int | None = None):
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForImageTextToText
        from transformers.utils import logging as hf_logging

        path = Path(path)
        if encoder_file is None:
            raise SluiceError(f"{path}: this store has no image encoder (a text model, or a store repacked before "
                              "Sluice kept encoders: repack the checkpoint with --force)")
        config = AutoConfig.from_pretrained(path)
        if not hasattr(config, "vision_config"):
            raise SluiceError(f"{path}: config.json describes no vision tower ({config.model_type})")
        stand_in = copy.deepcopy(config)
        text = stand_in.get_text_config()
        text.num_hidden_layers, text.vocab_size = 1, 8
        if hasattr(text, "layers_block_type"):
            text.layers_block_type = ["linear_attention"]
        tensors = load_file(path / encoder_file)
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the stand-in LM's weights are missing by design
        hf_logging.disable_progress_bar()
        try:
            cls = AutoModelForImageTextToText._model_mapping[type(config)]
            # transformers' own layers: Hub kernels would swap them (and none can be fetched)
            model = cls.from_pretrained(None, config=stand_in, state_dict=tensors, dtype=dtype, use_kernels=False)
        finally:
            hf_logging.set_verbosity(level)
            hf_logging.enable_progress_bar()
        model.language_model = None
        if mode not in MODES:
            raise SluiceError(f"image encoder mode {mode!r}: expected one of {', '.join(MODES)}")
        self.nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if device.type == "cuda" and mode == "auto":
            mode = "resident" if stays_resident(self.nbytes, vram_free) else "stream"
        self.mode = mode if device.type == "cuda" else "cpu"
        self.stream = None
        if self.mode == "stream":
            self.stream = LayerStream(model.vision_model.encoder.layer, device)
            streamed = {id(t) for tensors in self.stream.host for t, _ in tensors}
            for t in [*model.parameters(), *model.buffers()]:  # the rest is small: resident
                if id(t) not in streamed:
                    t.data = t.data.to(device)
            self.model = model.eval()
        else:
            self.model = model.to(device).eval()
        self.config = config
        self.device, self.dtype = device, dtype
        self.image_token_id: int = config.image_token_id
        self.merge = round(1 / config.downsample_ratio)

    def tokens_per_image(self, image_grid_hw: torch.Tensor) -> list[int]:
        """Image tokens each image takes in the prompt: its patches / merge**2."""
        return (image_grid_hw.prod(-1) // self.merge**2).tolist()

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> torch.Tensor:
        """Projected features [sum of tokens_per_image, D] for the images' patches, in the model's dtype."""
        patches = int(image_grid_hw.prod(-1).sum())
        if pixel_values.dim() != 2 or pixel_values.shape[0] != patches:
            raise SluiceError(f"pixel_values {tuple(pixel_values.shape)} do not match image_grid_hw {image_grid_hw.tolist()} "
                              f"({patches} patches)")
        if self.stream is not None:
            self.stream.start()
        out = self.model.get_image_features(pixel_values=pixel_values.to(self.device, self.dtype),
                                            image_grid_hw=image_grid_hw.to(self.device))
        return torch.cat(out.pooler_output)


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images, preprocessed: what the encoder takes and how many prompt tokens each needs."""

    pixel_values: torch.Tensor  # [P, 3 * patch**2]
    image_grid_hw: torch.Tensor  # [I, 2]
    counts: tuple[int, ...]  # image tokens per image
    digests: tuple[str, ...]  # content hash per image (conversation snapshots tell images apart by it)


def prepare_images(data: list[bytes], settings: ImageSettings, doc: bool = False, where: str = "image") -> PromptImages:
    """Encoded images -> PromptImages (ImageError for a bad one, naming it: `where`[i])."""
    import hashlib

    images = [load_image(d, f"{where}[{i}]" if len(data) > 1 else where) for i, d in enumerate(data)]
    pixel_values, grid = preprocess(images, settings, doc)
    counts = tuple(int(n) for n in (grid.prod(-1) // settings.merge**2).tolist())
    return PromptImages(pixel_values, grid, counts, tuple(hashlib.sha256(d).hexdigest()[:16] for d in data))


@dataclass(frozen=True)
class ImageTokens:
    """The tokenizer's image placeholders: one `image` token per image in a rendered prompt becomes
    start + image * n + end (start / end where the vocabulary has them), as transformers' processor does."""

    image: int
    start: int | None = None
    end: int | None = None

    @classmethod
    def of(cls, tokenizer, image_token_id: int) -> "ImageTokens":
        vocab = tokenizer.get_vocab()
        return cls(image_token_id, vocab.get(getattr(tokenizer, "image_start_token", "<img>")),
                   vocab.get(getattr(tokenizer, "image_end_token", "</img>")))

    def text(self, tokenizer) -> str:
        """The placeholder's text (what a prompt or chat template writes for one image)."""
        return tokenizer.convert_ids_to_tokens(self.image)

    def expand(self, ids: list[int], counts: tuple[int, ...]) -> list[int]:
        out, k = [], 0
        for i in ids:
            if i != self.image:
                out.append(i)
                continue
            if k == len(counts):
                raise SluiceError(f"the prompt has more image placeholders than the {len(counts)} image(s) given")
            out += ([self.start] if self.start is not None else []) + [self.image] * counts[k] + ([self.end] if self.end is not None else [])
            k += 1
        if k != len(counts):
            raise SluiceError(f"{len(counts)} image(s) given but the prompt has {k} image placeholder(s)")
        return out

    def key(self, ids: list[int], images: PromptImages) -> list[int]:
        """ids (expanded) with each image token replaced by a number of its own (negative, from its image's
        digest and its place in that image), so equal token lists with different images never look alike.
        Images are told apart by their token counts, not by what surrounds them: two images back to back
        (a vocabulary without start / end tokens) keep their own numbers."""
        out, k, j = [], 0, 0
        for i in ids:
            if i != self.image:
                out.append(i)
                continue
            out.append(-1 - (int(images.digests[k], 16) * 1_000_003 + j) % (1 << 62))
            j += 1
            if j == images.counts[k]:
                k, j = k + 1, 0
        return out
