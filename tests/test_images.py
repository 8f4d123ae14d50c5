"""Images into a vision-language checkpoint (nemotron_h_omni: RADIO tower + projector + NemotronH LM).

The store keeps the encoder's tensors (encoder.safetensors, checkpoint names and bytes); Sluice runs
them through transformers' own modules and puts the projected rows in place of the prompt's image
tokens. Reference: transformers' whole omni model given the same pixel patches."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.errors import SluiceError
from common import DEVICE
from common import MUST_DIFFER, PROMPT, assert_logits_close

pytest.importorskip("transformers.models.nemotron_h_omni", reason="nemotron_h_omni needs transformers 5.23+")


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("omni") / "ckpt", "nemotron_h_omni", seed=13)


def _image(seed: int, grid=(4, 8)):
    """Random pixel patches [h * w, 3 * 16 * 16] of one image and its patch grid [1, 2]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1], 3 * 16 * 16, generator=g), torch.tensor([list(grid)])


def _prompt(image_token: int, n: int) -> list[int]:
    return list(PROMPT[:5]) + [image_token] * n + list(PROMPT[5:])


def test_image_prompt_matches_transformers(omni):
    """With an image in the prompt: logits and greedy tokens equal transformers' omni model's, the encoder
    rows equal its get_image_features, and the store keeps the encoder apart from the LM."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(omni, dtype=torch.float32, experts_implementation="eager").eval()
    pix, grid = _image(1)
    n = int(grid.prod()) // 4
    ids = _prompt(hf.config.image_token_id, n)
    with torch.no_grad():
        feats = torch.cat(hf.get_image_features(pixel_values=pix, image_grid_hw=grid).pooler_output)
        ref = hf(torch.tensor([ids]), pixel_values=pix, image_grid_hw=grid).logits[0]
        out = list(ids)
        for _ in range(10):
            out.append(int(hf(torch.tensor([out]), pixel_values=pix, image_grid_hw=grid).logits[0, -1].argmax()))
    with sluice.load(omni, device=DEVICE, progress=False) as engine:
        rows = engine.encode_images(pix, grid)
        logits = engine.extend(engine.new_sequence(), ids, rows).cpu()
        tokens = engine.generate(ids, 10, images=rows)
        text_only = engine.forward(ids)
        m = engine.store.manifest
        with safe_open(str(engine.store.path / m.encoder), "pt") as f:
            enc = set(f.keys())
    assert enc and all(k.startswith(("vision_model.", "mlp1.")) for k in enc)
    assert rows.shape == (n, hf.config.text_config.hidden_size)
    assert (rows.cpu() - feats).abs().max().item() <= 1e-5
    assert_logits_close("nemotron_h_omni", logits, ref, "image prompt")
    assert tokens == out[len(ids):]
    # the image changes the answer: without its rows the logits part from the reference
    assert (text_only - ref).abs().max().item() > MUST_DIFFER
    # a prompt run in pieces (prefill_chunk): the image rows follow their tokens into each piece
    first = ids.index(hf.config.image_token_id)
    chunk = first + 2  # a piece boundary inside the image's tokens
    assert n > 2 and len(ids) > chunk
    with sluice.load(omni, device=DEVICE, progress=False, prefill_chunk=chunk) as engine:
        chunked = engine.extend(engine.new_sequence(), ids, engine.encode_images(pix, grid)).cpu()
    assert_logits_close("nemotron_h_omni", chunked, ref, "image prompt in chunks")


def test_image_encoder_attention_runs_without_cudnn(omni, monkeypatch):
    """The encoder's attention runs with cuDNN's SDPA off (a plan per new length: every image size)."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or sdpa(*a, **k))
    with sluice.load(omni, device=DEVICE, progress=False) as engine:
        engine.encode_images(*_image(1))
    assert seen and not any(seen)


def test_a_changed_encoder_file_is_caught_at_first_use(omni, tmp_path):
    """The image encoder's file is checked against the checksum repack recorded, at its first use (a flipped byte
    would change image rows without an error); --no-verify skips the check."""
    import shutil

    from sluice.errors import StoreError
    from sluice.storage.home import resolve_store

    store = tmp_path / "store"
    shutil.copytree(resolve_store(omni, progress=False), store)
    encoder = store / "encoder.safetensors"
    data = bytearray(encoder.read_bytes())
    data[-100] ^= 0xFF  # tensor bytes, not the header
    encoder.write_bytes(bytes(data))
    with sluice.load(store, device=DEVICE, progress=False) as engine:
        with pytest.raises(StoreError, match="encoder.safetensors: checksum mismatch"):
            engine.encode_images(*_image(1))
    with sluice.load(store, device=DEVICE, progress=False, verify_checksums=False) as engine:
        engine.encode_images(*_image(1))


def test_image_rows_out_of_order_fail(omni):
    """A check that must fail: the encoder's rows placed in the wrong order (reversed) give other logits."""
    pix, grid = _image(2)
    with sluice.load(omni, device=DEVICE, progress=False) as engine:
        rows = engine.encode_images(pix, grid)
        ids = _prompt(engine.image_encoder.image_token_id, rows.shape[0])
        good = engine.extend(engine.new_sequence(), ids, rows)
        bad = engine.extend(engine.new_sequence(), ids, rows.flip(0))
    assert (good - bad).abs().max().item() > MUST_DIFFER


def test_image_rows_must_match_image_tokens(omni):
    """As many rows as image tokens, of the LM's width; and a text-only store has no encoder."""
    pix, grid = _image(3)
    with sluice.load(omni, device=DEVICE, progress=False) as engine:
        rows = engine.encode_images(pix, grid)
        ids = _prompt(engine.image_encoder.image_token_id, rows.shape[0] - 1)
        with pytest.raises(SluiceError, match="image tokens"):
            engine.extend(engine.new_sequence(), ids, rows)
        with pytest.raises(SluiceError, match="do not match image_grid_hw"):
            engine.encode_images(pix[:-1], grid)


def test_text_store_has_no_image_encoder(stores):
    with sluice.load(stores["nemotron_h"], device=DEVICE, progress=False) as engine:
        with pytest.raises(SluiceError, match="no image encoder"):
            engine.encode_images(*_image(4))


def _png(seed: int, size=(50, 70), fmt="PNG") -> bytes:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8")).save(buf, format=fmt)
    return buf.getvalue()


def _url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def server(omni, tmp_path_factory):
    from test_api import LiveServer

    images = tmp_path_factory.mktemp("image-dir")  # the one folder file: URLs may name
    srv = LiveServer(omni, image_dirs=(images,))  # prefill in chunks of 8 tokens: image runs are cut across chunks
    srv.image_dir = images
    yield srv
    srv.close()


def _ask(srv, image: bytes, text: str = "What is it?", model: str = "tiny", history=()):
    msgs = list(history) + [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(image)}},
                                                         {"type": "text", "text": text}]}]
    return srv.client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0)


def test_image_request_through_openai_client(server):
    """An image_url part through the official client: the reply equals the engine's own greedy tokens for the
    same prompt; a follow-up reuses the conversation's state; another image of the same size does not."""
    from transformers import AutoTokenizer

    from sluice.models.vision import ImageSettings, ImageTokens, prepare_images

    img = _png(1)
    r = _ask(server, img)
    engine = server.engine
    tok = AutoTokenizer.from_pretrained(engine.store.path)
    parts = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    ids = list(tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    pi = prepare_images([img], ImageSettings.of(engine.store.path))
    ids = ImageTokens.of(tok, engine.image_encoder.image_token_id).expand(ids, pi.counts)
    expect = engine.generate(ids, 6, images=engine.encode_images(pi.pixel_values, pi.image_grid_hw))
    assert r.choices[0].message.content == tok.decode(expect, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and pi.counts[0] > 1
    history = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(img)}},
                                            {"type": "text", "text": "What is it?"}]},
               {"role": "assistant", "content": r.choices[0].message.content}]
    again = _ask(server, img, "And?", history=history)
    assert again.usage.prompt_tokens_details.cached_tokens > len(ids)  # the whole first turn came from the snapshot
    other = _ask(server, _png(2), "And?", history=[{**history[0], "content": [
        {"type": "image_url", "image_url": {"url": _url(_png(2))}}, {"type": "text", "text": "What is it?"}]}, history[1]])
    first_image = ids.index(engine.image_encoder.image_token_id)
    assert other.usage.prompt_tokens_details.cached_tokens <= first_image  # nothing past the text before the image


def test_doc_model_id_reads_images_larger(server):
    """The -doc id uses the processor's maximum resolution: more image tokens for the same image."""
    ids = {m.id for m in server.client.models.list().data}
    assert {"tiny", "tiny-doc"} <= ids
    img = _png(3, size=(120, 120))
    normal, doc = _ask(server, img), _ask(server, img, model="tiny-doc")
    assert doc.usage.prompt_tokens > normal.usage.prompt_tokens


@pytest.mark.parametrize("make, status, words", [
    (lambda: _url(b"hello, not an image"), 400, "not an image"),
    (lambda: _url(_png(4)[:300]), 400, "truncated"),
    (lambda: _url(_png(4, fmt="TIFF")), 400, "TIFF images are not supported"),
    (lambda: "data:image/png;base64,@@@", 400, "malformed"),
    (lambda: "https://example.com/cat.png", 400, "remote image URLs are not fetched"),
    (lambda: "file:///nonexistent/cat.png", 400, "cannot read"),
    (lambda: "ftp://example.com/cat.png", 400, "unsupported image URL scheme"),
])
def test_bad_images_get_4xx_naming_the_problem(server, make, status, words):
    import httpx

    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": make()}}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text


def test_too_large_image_gets_413(server, monkeypatch):
    import httpx

    from sluice.models import vision

    monkeypatch.setattr(vision, "MAX_IMAGE_PIXELS", 100)
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(_png(5))}}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 413 and "megapixels" in r.json()["error"]["message"]


def test_local_file_image_url(server):
    img = server.image_dir / "cat.png"
    img.write_bytes(_png(6))
    r = server.client.chat.completions.create(model="tiny", max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": img.as_uri()}}, {"type": "text", "text": "Hi"}]}])
    assert r.usage.prompt_tokens > 10


def _transformers_image_functions():
    """transformers' NemotronH omni patch-grid rule and patch cutting, from its source (the module itself
    imports only with torchvision, which Sluice does not need)."""
    import math
    from pathlib import Path

    import transformers.models.nemotron_h_omni as pkg

    src = (Path(pkg.__file__).parent / "image_processing_nemotron_h_omni.py").read_text()
    ns = {"math": math, "torch": torch}
    exec(src[src.index("def get_patch_grid_size"): src.index("@auto_docstring\nclass")], ns)
    return ns["get_patch_grid_size"], ns["convert_image_to_patches"]


def test_preprocessing_follows_transformers():
    """The patch grid of images of many sizes and budgets, and the patch layout, equal transformers' code."""
    import random

    from PIL import Image

    from sluice.models.vision import ImageSettings, patch_grid, preprocess

    grid_ref, patches_ref = _transformers_image_functions()
    rng = random.Random(0)
    compared = 0
    for _ in range(3000):
        args = (rng.randint(1, 4000), rng.randint(1, 4000), 16, 2, rng.choice([4, 256, 1024]), rng.choice([64, 3328, 13312]))
        try:
            ref = grid_ref(*args)
        except ZeroDivisionError:  # transformers' rule fails on slivers (a side of zero patches); ours keeps one
            continue
        if min(ref) > 0:
            assert patch_grid(*args) == ref, args
            compared += 1
    assert compared > 2500
    settings = ImageSettings(min_patches=4, max_patches=64)
    img = Image.fromarray(torch.randint(0, 256, (64, 96, 3), dtype=torch.uint8).numpy())  # already a patch multiple: no resize
    pix, grid = preprocess([img], settings, doc=True)
    x = torch.from_numpy(__import__("numpy").asarray(img)).permute(2, 0, 1).float() / 255
    x = (x - torch.tensor(settings.mean).view(3, 1, 1)) / torch.tensor(settings.std).view(3, 1, 1)
    assert grid.tolist() == [[4, 6]]
    assert torch.equal(pix, patches_ref(x[None], 16)[0])


@pytest.mark.skipif(DEVICE != "cuda", reason="streaming the encoder's layers needs a CUDA device")
def test_streamed_encoder_equals_resident(omni):
    """The tower's layers streamed from pinned RAM (layer i+1 copied under layer i) give the resident
    encoder's features exactly."""
    from sluice.models.vision import ImageEncoder
    from sluice.storage.store import ExpertStore
    from sluice.storage.home import resolve_store

    store = ExpertStore.open(resolve_store(omni, progress=False))
    pix, grid = _image(7)
    dev = torch.device("cuda")
    resident = ImageEncoder(store.path, store.manifest.encoder, dev, torch.float32, "resident")
    streamed = ImageEncoder(store.path, store.manifest.encoder, dev, torch.float32, "stream")
    assert streamed.mode == "stream" and resident.mode == "resident"
    a = resident.encode(pix, grid)
    for _ in range(2):  # twice: the hooks leave every layer as they found it
        assert torch.equal(streamed.encode(pix, grid), a)
    assert all(p.device.type == "cpu" for layer in streamed.stream.layers for p in layer.parameters())


@pytest.mark.skipif(not __import__("shutil").which("chromium"), reason="Debian's chromium is not installed (.ci/run installs it)")
def test_chat_page_sends_an_image_in_headless_chromium(server, tmp_path):
    """The chat page offers image attachments for a vision-language model and sends them as image_url parts:
    the user's bubble shows the image, and the server received it (its image counters move)."""
    import subprocess
    from urllib.parse import quote

    import httpx

    assert httpx.get(server.url + "/health").json()["images"] is True
    before = server.metric("sluice_images_total")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=20000"]
    url = server.url + "/?image=" + quote(_url(_png(8, size=(40, 40))), safe="") + "&q=" + quote("What is it?") + "&max_tokens=4"
    dom = subprocess.run(["chromium", *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert 'class="msg user"><img class="thumb" src="data:image/png;base64,' in dom and "What is it?</div>" in dom
    assert server.metric("sluice_images_total") == before + 1 and server.metric("sluice_image_tokens_total") > 0


def test_snapshot_keys_tell_back_to_back_images_apart():
    """Without start / end tokens two images sit back to back; the second image still has numbers of its own,
    so prompts that differ only in it never share a snapshot key."""
    from sluice.models.vision import ImageTokens, PromptImages

    marks = ImageTokens(image=7)
    def images(*digests):
        return PromptImages(torch.empty(0), torch.empty(0), (2, 3), digests)
    ids = marks.expand([1, 7, 7, 2], (2, 3))
    assert ids == [1, 7, 7, 7, 7, 7, 2]
    a, b = marks.key(ids, images("aa", "bb")), marks.key(ids, images("aa", "cc"))
    assert a[:3] == b[:3] and a[3:6] != b[3:6] and a[6] == b[6] == 2
    assert len(set(a[1:6])) == 5 and all(x < 0 for x in a[1:6])
