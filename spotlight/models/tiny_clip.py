"""A tiny random-weight CLIP checkpoint, built offline, for tests of CLIP/PickScore scorers.

:func:`make_random_clip` writes a directory that ``transformers.CLIPModel.from_pretrained``
and ``transformers.CLIPProcessor.from_pretrained`` load with ``local_files_only=True``:

* ``config.json`` + ``model.safetensors``: a 2-layer CLIP (text and vision hidden size 32,
  image 32×32 in 8×8 patches, projection 16, 77 text positions), weights from
  ``torch.manual_seed(seed)``, so the same seed gives the same weights;
* the offline CLIP byte-level BPE tokenizer of :func:`spotlight.models.offline_tokenizers.build_clip_tokenizer`
  (``tokenizer.json``, ``tokenizer_config.json``);
* the image processor config (``processor_config.json`` in transformers 5,
  ``preprocessor_config.json`` in 4.x): a CLIP image processor (resize shortest edge 32,
  centre crop 32×32, the OpenAI CLIP mean/std).

Scores from this model are meaningless; it exists so that the scoring code path (processor,
tokenizer, projections, ``logit_scale``) runs for real on a CPU in well under a second.
"""

from __future__ import annotations

import pathlib

TEXT_MAX_POSITIONS = 77
"""Text context length (PickScore and OpenAI CLIP truncate prompts to 77 tokens)."""
IMAGE_SIZE = 32


def make_random_clip(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write a tiny random-weight CLIP model + tokenizer + image processor into ``path``.

    Args:
        path: output directory (created if missing; existing files of the same names are
            overwritten).
        seed: ``torch.manual_seed`` for the weight initialisation.

    Returns:
        ``path`` as a :class:`pathlib.Path`; load it with ``CLIPModel.from_pretrained(path)``
        and ``CLIPProcessor.from_pretrained(path)`` (offline).
    """
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    from spotlight.models.offline_tokenizers import CLIP_BOS, CLIP_EOS, build_clip_tokenizer

    try:  # transformers 5: the PIL backend (CLIPImageProcessor itself wants torchvision)
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # transformers 4.x
        from transformers import CLIPImageProcessor as ImageProcessor

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_clip_tokenizer()
    vocab = tokenizer.get_vocab()
    image_processor = ImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_resize=True,
        do_center_crop=True,
        do_normalize=True,
    )
    bos, eos = vocab[CLIP_BOS], vocab[CLIP_EOS]
    text_config = dict(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=TEXT_MAX_POSITIONS,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        projection_dim=16,
    )
    vision_config = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=8,
        num_channels=3,
        projection_dim=16,
    )
    config = CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=16)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = CLIPModel(config).float().eval()
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(out)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return out
