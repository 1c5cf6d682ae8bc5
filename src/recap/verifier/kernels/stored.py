"""The weights a model was de-quantised from, read where the GGUF file stores them.

Why: transformers loads a GGUF by de-quantising every tensor to float (5.6x the bytes for
SmolLM2's Q4_1 file); a decode step that streams those floats streams 5.6x the bytes the
file holds. `StoredWeights` maps the file (``gguf.GGUFReader``: a memory map, nothing copied)
and hands the fast decoder each linear layer's blocks (`quantized`), after checking that they
de-quantise, bit for bit, to the model's own float weights: so a model read as stored gives
the float path's logits exactly, and a file that is not the model's source is refused
rather than trusted.

A GGUF whose float weights would not fit in memory (`model_from_file`): the model is built
without its decoder's block weights (a placeholder of the right shape stands in each: no
bytes) and the kernels read the file alone; the rest (norms, biases, float tensors) is
de-quantised as transformers' loader would. With no float copy there is nothing to compare
the blocks with: `StoredWeights.blocks` then checks shapes and formats and lists the tensor
under ``trusted``.

Names: the file's tensors follow llama.cpp's naming (``gguf.TENSOR_NAMES``); Llama files
store q and k rows permuted for llama.cpp's RoPE layout, which transformers' loader undoes
(`_llama_rows`), so their blocks are copied once in the model's row order (a few hundred KB a
layer); every other tensor stays a view of the file.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from recap.errors import InputError
from recap.verifier.kernels import quantized

ROLES = {
    "q": "ATTN_Q", "k": "ATTN_K", "v": "ATTN_V", "o": "ATTN_OUT",
    "gate": "FFN_GATE", "up": "FFN_UP", "down": "FFN_DOWN",
}
"""The fast decoder's linear layers -> ``gguf.MODEL_TENSOR`` names."""


class WeightsMismatch(InputError):
    """A GGUF tensor does not de-quantise to the model's float weight: not the model's file."""


@dataclass
class StoredWeights:
    """A GGUF file's block tensors by name, memory-mapped (`open`)."""

    path: Path
    architecture: str
    tensors: dict[str, tuple[str, np.ndarray]] = field(repr=False)
    """GGUF name (without ``.weight``) -> (GGUF type name, raw rows: uint8 (N, bytes per row))."""
    checked: list[str] = field(default_factory=list)
    """The tensors `blocks` handed out, each checked against the model's float weight."""
    trusted: list[str] = field(default_factory=list)
    """The tensors `blocks` handed out for a model built from this file alone
    (`model_from_file`): it has no float weight to check them against."""
    _checked_against: set[tuple] = field(default_factory=set, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> StoredWeights:
        path = Path(path)
        try:
            architecture, tensors = read_tensor_table(path)
        except (OSError, ValueError, KeyError, struct.error) as error:
            raise InputError(f"{path} is not a readable GGUF file: {error}") from None
        return cls(path, architecture, {name.removesuffix(".weight"): entry for name, entry in tensors.items()})

    def blocks(self, role: str, layer: int | None, weight: torch.Tensor, *, heads: int = 0,
               kv_heads: int = 0) -> np.ndarray | None:
        """The stored blocks of one weight (``role``: a key of `ROLES` with its ``layer``, or
        ``embed`` / ``head``) in the model's row order, or None where the file stores it in a
        format the kernels do not read as stored (e.g. float32). Raises `WeightsMismatch`
        unless they de-quantise to ``weight`` bit for bit. An embedding or head the model grew
        past the file's vocabulary gets the file's rows (fewer than the weight's)."""
        name = self._name(role, layer)
        if name not in self.tensors:
            return None
        kind, raw = self.tensors[name]
        if kind not in quantized.FORMATS:
            return None
        stored = quantized.blocks(raw, kind)
        if role in ("q", "k") and self._permutes():
            stored = np.ascontiguousarray(stored[_llama_rows(len(stored), heads if role == "q" else kv_heads)])
        expected = weight.detach()
        if role in ("embed", "head") and expected.shape[0] > len(stored) and \
                tuple(expected.shape[1:]) == (quantized.weights_per_row(stored),):
            # a vocabulary the model grew past the file's (the demo VLM's image token): the
            # file's rows are checked and returned, the caller keeps the rest as floats
            expected = expected[:len(stored)]
        if expected.dtype != torch.float32 or tuple(expected.shape) != (len(stored),
                                                                         quantized.weights_per_row(stored)):
            raise WeightsMismatch(f"{self.path.name}: {name} ({kind}, {len(stored)} rows) does not match the "
                                  f"model's {tuple(expected.shape)} {expected.dtype} weight")
        checked = (name, expected.data_ptr(), tuple(expected.shape))
        if unmade(expected):
            if name not in self.trusted:
                self.trusted.append(name)
        elif checked not in self._checked_against:  # a tied head is its embedding: compared once
            if not np.array_equal(quantized.dequantize(stored).view(np.uint32), expected.numpy().view(np.uint32)):
                raise WeightsMismatch(f"{self.path.name}: {name} does not de-quantise to the model's weight "
                                      "(not the file this model was loaded from)")
            self._checked_against.add(checked)
            self.checked.append(name)
        return stored

    def _name(self, role: str, layer: int | None) -> str:
        import gguf

        if role == "embed":
            return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD]
        if role == "head":  # a tied head is the embedding
            output = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT]
            return output if output in self.tensors else gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD]
        return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[ROLES[role]]].format(bid=layer)

    def _permutes(self) -> bool:
        """Whether transformers' loader un-permutes this architecture's q and k rows."""
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor

        return TENSOR_PROCESSORS.get(self.architecture) is LlamaTensorProcessor


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value types of fixed size -> bytes (8: string, 9: array)."""


def read_tensor_table(path: str | os.PathLike) -> tuple[str, dict[str, tuple[str, np.ndarray]]]:
    """(``general.architecture``, {tensor name: (GGUF type name, its rows as uint8 (N, bytes
    per row), a view of the memory-mapped file)}) from a GGUF file's header (format: the
    ``gguf`` package's ``GGUFReader``, which `tests/test_quantized.py` holds this to).

    Why not ``GGUFReader``: it builds a Python object for every metadata string first, and a
    262k-token vocabulary (Gemma 3's) took it about 10 s; this steps over the metadata,
    reading only the two keys it needs (a few tenths of a second)."""
    import gguf

    blob = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number")
    version, tensor_count, field_count = struct.unpack_from("<IQQ", blob, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} (2 or later is read)")
    position, wanted = 24, {}

    def string(at: int) -> tuple[bytes, int]:
        (length,) = struct.unpack_from("<Q", blob, at)
        return bytes(blob[at + 8:at + 8 + length]), at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind in _SCALAR_BYTES:
            return at + _SCALAR_BYTES[kind]
        if kind == 8:
            return at + 8 + struct.unpack_from("<Q", blob, at)[0]
        if kind != 9:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = struct.unpack_from("<IQ", blob, at)
        at += 12
        if item in _SCALAR_BYTES:
            return at + count * _SCALAR_BYTES[item]
        for _ in range(count):
            at = skip(item, at)
        return at

    for _ in range(field_count):
        key, position = string(position)
        (kind,) = struct.unpack_from("<I", blob, position)
        position += 4
        if key == b"general.architecture" and kind == 8:
            wanted["architecture"] = string(position)[0].decode()
        elif key == b"general.alignment" and kind == 4:
            wanted["alignment"] = struct.unpack_from("<I", blob, position)[0]
        position = skip(kind, position)
    entries = []
    for _ in range(tensor_count):
        name, position = string(position)
        (dims,) = struct.unpack_from("<I", blob, position)
        shape = struct.unpack_from(f"<{dims}Q", blob, position + 4)
        kind, offset = struct.unpack_from("<IQ", blob, position + 4 + 8 * dims)
        position += 4 + 8 * dims + 12
        entries.append((name.decode(), shape, gguf.GGMLQuantizationType(kind), offset))
    alignment = wanted.get("alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    start = -(-position // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in entries:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        row_bytes = shape[0] // block * size
        rows = math.prod(shape[1:])
        first = start + offset
        tensors[name] = (kind.name, blob[first:first + rows * row_bytes].reshape(rows, row_bytes))
    return wanted["architecture"], tensors


def _llama_rows(rows: int, heads: int) -> np.ndarray:
    """Row ``i`` of the model's q (or k) weight is row ``result[i]`` of the file's: within each
    head the file interleaves the two rotary halves (llama.cpp's layout), transformers' loader
    puts them back one after the other."""
    if not heads or rows % (2 * heads):
        raise WeightsMismatch(f"{rows} q/k rows do not split into {heads} heads of rotary pairs")
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


_UNMADE = torch.tensor(float("nan"))
"""The one element every placeholder (`placeholder`) views: NaN, so a computation that ever
read one would say so."""


def placeholder(shape: tuple[int, ...]) -> torch.nn.Parameter:
    """A float32 parameter of ``shape`` that holds no bytes: where `model_from_file` leaves a
    weight the kernels read from the file's blocks."""
    return torch.nn.Parameter(_UNMADE.expand(shape), requires_grad=False)


def unmade(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a `placeholder` (no float weight behind it)."""
    return tensor.numel() > 1 and tensor.untyped_storage().data_ptr() == _UNMADE.untyped_storage().data_ptr()


def without_float_copy(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built by `model_from_file` (some weight is a `placeholder`)."""
    return any(unmade(parameter) for parameter in model.parameters())


def float_bytes(path: str | os.PathLike) -> int:
    """The bytes a GGUF file's tensors take de-quantised to float32 (what transformers' loader
    makes of them), from its tensor table (`read_tensor_table`: the vocabulary is skipped)."""
    import gguf

    total = 0
    for kind, raw in read_tensor_table(path)[1].values():
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        total += raw.size // size * block
    return 4 * total


def model_from_file(path: str | os.PathLike) -> torch.nn.Module:
    """A causal LM built from a GGUF file without the float copies of its decoder's block
    weights: each is a `placeholder`, and `StoredWeights` hands the fast kernels its blocks.
    Every other tensor (norms, biases, tensors stored as floats) is de-quantised as
    transformers' GGUF loader does it (``gguf.dequantize``, then its tensor processor: the
    same floats), so the model equals the one transformers would build, minus those copies.
    For a file whose float weights would not fit in memory (`recap.models.load`'s
    ``float_copy``); ``tests/test_model_from_file.py`` holds its logits to that model's."""
    import gguf
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, struct.error) as error:
        raise InputError(f"{path} is not a GGUF model transformers can read: {error}") from None
    architecture = str(reader.fields["general.architecture"].contents())
    processor_class = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if processor_class not in (TensorProcessor, LlamaTensorProcessor):
        raise InputError(f"{path.name}: a {architecture} file cannot be built without its float copy "
                         "(transformers' loader reshapes its tensors); load it with float_copy=True")
    processor = processor_class(config=config.to_dict())
    with init_empty_weights(include_buffers=False):  # parameters on the meta device: no bytes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # as transformers' loader does: a tied head is the embedding's parameter
    names = get_gguf_hf_weights_map(model, processor)  # file name -> model name
    read_as_blocks = _block_names(config.num_hidden_layers)
    made: dict[str, torch.Tensor] = {}
    left: set[str] = set()
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        if tensor.name.removesuffix(".weight") in read_as_blocks and tensor.tensor_type.name in quantized.FORMATS:
            left.add(names[tensor.name])
            continue
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters={})
        made[names[result.name]] = torch.from_numpy(np.copy(result.weights))
    replaced: dict[int, torch.nn.Parameter] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in replaced:  # a tied head is its embedding
            continue
        if name in made:
            if tuple(made[name].shape) != tuple(parameter.shape):
                raise WeightsMismatch(f"{path.name}: {name} has shape {tuple(made[name].shape)}, the model "
                                      f"{tuple(parameter.shape)}")
            replaced[id(parameter)] = torch.nn.Parameter(made[name].float(), requires_grad=False)
        elif name in left:
            replaced[id(parameter)] = placeholder(tuple(parameter.shape))
        else:
            raise InputError(f"{path.name} holds no tensor for the model's {name}")
    for module in model.modules():
        for key, parameter in module._parameters.items():
            if parameter is not None:
                module._parameters[key] = replaced[id(parameter)]
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                raise InputError(f"{path.name}: the model's buffer {key} was not built")
    model.config.name_or_path = str(path.parent)
    return model.eval()


def _block_names(layers: int) -> set[str]:
    """The file's names (without ``.weight``) of the tensors the fast kernels read as blocks."""
    import gguf

    names = {gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD], gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT]}
    for role in ROLES.values():
        names.update(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[role]].format(bid=layer) for layer in range(layers))
    return names


class FloatCopies:
    """The model's float tensors that the fast kernels read as GGUF blocks instead: dropped
    once the kernels are built (so a process decoding SmolLM2 holds about the file's bytes
    of weights, not 5.6x them) and rebuilt from the blocks, exactly (`Linear` and the load
    check made sure they de-quantise to those very floats), before anything else runs the
    model: a forward pre-hook rebuilds them on the first call that needs them (transformers'
    own forward, ``model.generate``). The hooks sit on the modules that own a dropped weight,
    so a forward that stops before them (an image prompt's embedding, taken at the language
    model's input) rebuilds nothing."""

    def __init__(self, model: torch.nn.Module, pairs: list[tuple[torch.nn.Parameter, np.ndarray]]):
        self.model = model
        self.pairs = pairs
        """(parameter, its blocks in the model's row order) for every float copy."""
        self.shapes = [tuple(parameter.shape) for parameter, _ in pairs]
        self.dropped = any(unmade(parameter) for parameter, _ in pairs)
        """Whether the floats are gone (from the start for a model built from the file alone)."""
        owned = {id(parameter) for parameter, _ in pairs}
        self._hooks = [module.register_forward_pre_hook(lambda module, args: self.restore())
                       for module in model.modules()
                       if any(id(parameter) in owned for parameter in module.parameters(recurse=False))]

    def drop(self) -> None:
        """Free the float tensors (each parameter keeps its place, with no elements). The
        model's other tensors are copied out of the file transformers mapped them from (a
        few norms: kilobytes), so that mapping, whose pages the load check read, goes too."""
        if self.dropped:
            return
        for parameter, _ in self.pairs:
            parameter.data = torch.empty((0,) * parameter.dim(), dtype=parameter.dtype)
        for module in self.model.modules():
            for parameter in module.parameters(recurse=False):
                if parameter.numel():
                    parameter.data = parameter.data.clone()
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.numel():
                    setattr(module, name, buffer.clone())
        self.dropped = True

    def restore(self) -> None:
        """The float tensors back, de-quantised from the blocks (a no-op when they are here)."""
        if not self.dropped:
            return
        for (parameter, blocks), shape in zip(self.pairs, self.shapes, strict=True):
            if parameter.numel() == 0 or unmade(parameter):  # a tied parameter comes back once
                parameter.data = torch.from_numpy(quantized.dequantize(blocks)).reshape(shape)
        self.dropped = False
