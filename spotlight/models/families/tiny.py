"""The embedded tiny family: a pixel-space ``QwenImageTransformer2DModel`` conditioned on
MiniLM-L6 token embeddings (``spotlight/models/dit.py``, ``text_encoder.py``).

No VAE: packed latents are ``patch_size`` × ``patch_size`` pixel patches in [-1, 1], decoded by
unpacking. Classifier-free guidance is true CFG, ``neg + w·(pos − neg)``, with the empty caption
as the negative prompt: the shapes base model is pretrained with caption dropout to the empty
caption (``spotlight/tasks/shapes/pretrain.py``), so ``model.guidance_scale > 1`` is meaningful
for it; a transformer built from config (random weights) has no such training.
"""

from __future__ import annotations

import json
import pathlib

import torch

from spotlight.models import dit
from spotlight.models.families.base import ModelFamily, ModelLoadError
from spotlight.models.text_encoder import TEXT_DIM, TEXT_ENCODERS, encode_prompts, token_counts
from spotlight.rl.sampler import Conditioning, make_sigmas

TEXT_CONDITIONING_FILE = "text_conditioning.json"
"""In a pretrained tiny checkpoint folder: ``{"text_encoder": …}``, the prompt embeddings it was
trained on (``model.text_encoder`` must match; a folder without it was trained on ``minilm``)."""


def read_text_conditioning(folder) -> str:
    """The ``text_encoder`` a tiny checkpoint folder was trained on (``minilm`` without the file).

    Raises:
        ModelLoadError: the file is unreadable or names no known text encoder.
    """
    path = pathlib.Path(folder) / TEXT_CONDITIONING_FILE
    if not path.is_file():
        return "minilm"
    try:
        name = json.loads(path.read_text()).get("text_encoder")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{path}: unreadable ({exc})") from None
    if name not in TEXT_ENCODERS:
        raise ModelLoadError(f"{path}: text_encoder {name!r} is none of {', '.join(TEXT_ENCODERS)}")
    return name


def write_text_conditioning(folder, text_encoder: str) -> None:
    """Record in a checkpoint folder which prompt embeddings it was trained on."""
    (pathlib.Path(folder) / TEXT_CONDITIONING_FILE).write_text(json.dumps({"text_encoder": text_encoder}) + "\n")


class TinyFamily(ModelFamily):
    name = "tiny"
    transformer_class = "QwenImageTransformer2DModel"
    pipeline_class = "QwenImagePipeline"
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    default_guidance_scale = 1.0
    default_negative_prompt = ""
    """The empty caption: what caption dropout trained the base model's unconditional branch on."""
    activation_checkpointing = False  # a few MB of activations: recomputing them only costs time

    def __init__(self, cfg, text_dim: int = TEXT_DIM):
        super().__init__(cfg)
        self.text_dim = text_dim
        """Width D of the text embeddings (``joint_attention_dim``); MiniLM's 384 by default."""

    def components(self) -> tuple[str, ...]:
        return ("transformer",)

    def component_dir(self, name: str):
        # a tiny "pretrained" checkpoint is a bare transformer folder (config.json + weights)
        if not (self.path / "config.json").is_file():
            from spotlight.models.families.base import ModelLoadError

            raise ModelLoadError(
                f"{self.path}: no config.json; model.source = 'pretrained' expects a QwenImageTransformer2DModel "
                "folder (save_pretrained)"
            )
        return self.path

    def check(self) -> None:
        if self.cfg.source != "pretrained":
            return
        from spotlight.models.families.base import ModelLoadError, read_json

        config = read_json(self.component_dir("transformer") / "config.json")
        if config.get("_class_name") != self.transformer_class:
            raise ModelLoadError(
                f"{self.path}: holds a {config.get('_class_name')}, "
                f"not a {self.transformer_class} folder (model.source = 'pretrained' of the tiny family)"
            )
        if not any(f.suffix in (".safetensors", ".bin") for f in self.path.iterdir()):
            raise ModelLoadError(f"{self.path}: no weight files (*.safetensors)")
        trained_on = read_text_conditioning(self.path)
        if trained_on != self.cfg.text_encoder:
            source = (
                TEXT_CONDITIONING_FILE
                if (self.path / TEXT_CONDITIONING_FILE).is_file()
                else "no " + TEXT_CONDITIONING_FILE
            )
            raise ModelLoadError(
                f"{self.path}: the checkpoint was trained on {trained_on!r} prompt embeddings ({source}) "
                f"but model.text_encoder = {self.cfg.text_encoder!r}; "
                f"set model.text_encoder = {trained_on!r}"
            )
        # the latent layout and the architecture come from the model section; they must be the checkpoint's
        want = dit.transformer_kwargs(self.cfg, self.text_dim)
        fields = {
            "patch_size": "model.patch_size",
            "in_channels": "model.patch_size",
            "out_channels": "(pixel channels)",
            "joint_attention_dim": "(text encoder width)",
            "num_layers": "model.num_layers",
            "num_attention_heads": "model.num_attention_heads",
            "attention_head_dim": "model.attention_head_dim",
            "axes_dims_rope": "model.axes_dims_rope",
        }
        for key, setting in fields.items():
            got = config.get(key)
            if got is not None and (tuple(got) if isinstance(got, list) else got) != (
                tuple(want[key]) if isinstance(want[key], (list, tuple)) else want[key]
            ):
                raise ModelLoadError(
                    f"{self.path}: the checkpoint has {key} = {got} but the config implies {want[key]} ({setting}); "
                    f"set the model section to the checkpoint's architecture (its config.json)"
                )

    def identity(self) -> str:
        neg = f"|neg={self.negative_prompt!r}" if self.guidance_scale > 1 else ""
        return f"{self.cfg.text_encoder}|{self.cfg.max_text_tokens}{neg}"

    def build_transformer(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        model = dit.build_transformer(self.cfg, self.text_dim)
        return model if dtype == torch.float32 else model.to(dtype)

    def transformer_config(self) -> dict:
        """The checkpoint's ``config.json`` (``model.source = "pretrained"``), else the constructor
        arguments from the model section."""
        if self.cfg.source == "pretrained":
            return super().transformer_config()
        return dit.transformer_kwargs(self.cfg, self.text_dim)

    def transformer_weight_files(self):
        """The pretrained folder's safetensors; none for a model built from config (seeded init)."""
        return super().transformer_weight_files() if self.cfg.source == "pretrained" else []

    @property
    def latent_shape(self) -> tuple[int, int]:
        return dit.token_shape(self.cfg)

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        return make_sigmas(num_steps, shift)

    def prompt_token_counts(self, prompts: list[str]) -> list[int]:
        """MiniLM tokens of each prompt, [CLS] and [SEP] included."""
        return token_counts(prompts)

    def encode_prompts(self, prompts: list[str], device="cpu", progress=None) -> Conditioning:
        """MiniLM sentence-transformer token embeddings (bidirectional: per ``max_text_tokens``;
        ``model.text_encoder``), on the CPU."""
        embeds, mask = encode_prompts(prompts, self.cfg.max_text_tokens, text_encoder=self.cfg.text_encoder)
        cond = Conditioning(embeds, mask)
        if self.guidance_scale > 1:  # the negative prompt (default: the empty caption), one shared row
            ne, nm = encode_prompts(
                [self.negative_prompt], self.cfg.max_text_tokens, text_encoder=self.cfg.text_encoder
            )
            cond.extra["neg.embeds"], cond.extra["neg.mask"] = ne, nm
        if progress is not None:
            progress(len(prompts))
        return cond

    def velocity(self, transformer, latents, sigma, cond: Conditioning) -> torch.Tensor:
        """Velocity of the packed pixel latents; with ``guidance_scale = w > 1`` and the negative
        prompt's ``neg.*`` tensors, true CFG ``neg + w·(pos − neg)`` from one ``[2B]`` forward
        (float32 combination)."""
        dtype = next(transformer.parameters()).dtype
        side = self.cfg.image_size // self.cfg.patch_size
        batch = latents.shape[0]
        scale = self.guidance_scale
        use_cfg = scale > 1 and "neg.embeds" in cond.extra
        x, t, embeds, mask = latents.to(dtype), sigma.to(dtype), cond.embeds, cond.mask
        if use_cfg:
            x, t = torch.cat([x, x]), torch.cat([t, t])
            embeds = torch.cat([embeds, cond.rows("neg.embeds", batch).to(embeds.device)])
            mask = torch.cat([mask, cond.rows("neg.mask", batch).to(mask.device)])
        out = transformer(
            hidden_states=x,
            encoder_hidden_states=embeds.to(dtype),
            encoder_hidden_states_mask=mask,
            timestep=t,
            img_shapes=[(1, side, side)] * x.shape[0],
            return_dict=False,
        )[0].float()
        if not use_cfg:
            return out
        pos, neg = out[:batch], out[batch:]
        return neg + scale * (pos - neg)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return dit.decode_images(latents.float().cpu(), self.cfg)


FAMILY = TinyFamily
