"""Bad input: one line on stderr, exit status 2, no traceback."""

import pytest
from PIL import Image

from recap.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err


def _assert_one_line_error(code, err, fragment):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and fragment in lines[0]


def test_missing_image(capsys):
    code, err = _run(capsys, "generate", "--model", "tiny-qwen2.5-vl", "--prompt", "hi", "--image", "/no/such.png")
    _assert_one_line_error(code, err, "image not found")


def test_unreadable_image(capsys, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not a png")
    code, err = _run(capsys, "generate", "--model", "tiny-qwen2.5-vl", "--prompt", "hi", "--image", str(bad))
    _assert_one_line_error(code, err, "cannot read image")


def test_image_for_text_only_model(capsys, tmp_path):
    path = tmp_path / "ok.png"
    Image.new("RGB", (20, 20), "red").save(path)
    code, err = _run(capsys, "generate", "--model", "tiny-llama", "--prompt", "hi", "--image", str(path))
    _assert_one_line_error(code, err, "text-only")


def test_unknown_model_name(capsys):
    code, err = _run(capsys, "generate", "--model", "gpt-17", "--prompt", "hi")
    _assert_one_line_error(code, err, "unknown model")


def test_unsupported_architecture(capsys, tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32, vocab_size=100).save_pretrained(tmp_path)
    code, err = _run(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    _assert_one_line_error(code, err, "unsupported architecture")


def test_folder_that_is_not_a_model(capsys, tmp_path):
    code, err = _run(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    _assert_one_line_error(code, err, "not a loadable")


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(capsys, prompt):
    code, err = _run(capsys, "generate", "--model", "tiny-llama", "--prompt", prompt)
    _assert_one_line_error(code, err, "prompt is empty")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_new_tokens_below_one(capsys, value):
    code, err = _run(capsys, "generate", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", value)
    _assert_one_line_error(code, err, "at least 1")


def test_prompt_longer_than_context(capsys):
    code, err = _run(capsys, "generate", "--model", "tiny-llama", "--prompt", "word " * 5000)
    _assert_one_line_error(code, err, "tokens long")


def test_usage_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny-llama"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--prompt" in err


def test_unknown_dtype_via_api():
    import recap

    with pytest.raises(recap.InputError, match="unknown dtype"):
        recap.load("tiny-llama", dtype="int3")


def test_empty_prompt_via_api(tiny_llama):
    import recap

    with pytest.raises(recap.InputError):
        tiny_llama.prepare([])
    with pytest.raises(recap.InputError, match="at least 1"):
        recap.decode(tiny_llama, recap.make_proposer("ar"), tiny_llama.prepare("hi"), max_new_tokens=0)


def test_sliding_window_models_refuse_runs_beyond_the_window(tiny_llama):
    """A window the config does not mark per layer (Mistral's ``sliding_window``): the tree
    mask cannot apply it, so runs are exact only while the sequence fits in it. (Gemma 3
    marks its sliding layers, and both lanes apply each one's window: tests/test_gemma3.py.)"""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    import recap

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=tiny_llama.vocab_size, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           sliding_window=64, max_position_embeddings=512)
    target = recap.load((MistralForCausalLM(config).eval(), tiny_llama.tokenizer))
    assert target.sliding_window == 64 and target.layer_window is None
    inputs = target.prepare("Hello")
    assert recap.decode(target, recap.make_proposer("ar"), inputs, max_new_tokens=8).tokens
    with pytest.raises(recap.InputError, match="sliding attention window"):
        recap.decode(target, recap.make_proposer("ar"), inputs, max_new_tokens=200)
