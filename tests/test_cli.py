"""The CLI's happy paths on the tiny models."""

import json

from PIL import Image

from recap.cli import main
from recap.demo import DEMO_SCENES


def test_generate_json_reports_tokens_and_timings(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Say something.", "--method", "pld",
                 "--max-new-tokens", "12", "--json", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["tokens"]) == 12 and result["method"] == "pld" and result["threads"] == 1
    assert result["iterations"] >= 1 and result["tau"] >= 1.0
    assert set(result["timings"]) == {"prefill_s", "propose_s", "verify_s", "observe_s", "total_s"}


def test_generate_with_image_prints_text(capsys, tmp_path):
    path = tmp_path / "scene.png"
    Image.new("RGB", (50, 70), "blue").save(path)
    assert main(["generate", "--model", "tiny-llava-next", "--prompt", "What is this?", "--image", str(path),
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()


def test_check_prints_the_final_tally(capsys):
    assert main(["check", "--model", "tiny-qwen2.5-vl", "--method", "decoy", "--prompts", "4",
                 "--max-new-tokens", "16", "--vary"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "4 passed, 0 failed"


def test_check_in_bfloat16_on_stock_kernels_reports_agreement(capsys):
    assert main(["check", "--model", "tiny-llama", "--method", "decoy", "--prompts", "3", "--max-new-tokens", "12",
                 "--dtype", "bfloat16", "--kernels", "stock"]) == 0
    out = capsys.readouterr().out
    assert "agreement rate" in out and "of tokens" in out


def test_check_in_bfloat16_on_fast_kernels_is_exact(capsys, monkeypatch):
    """The fast kernels are batch-invariant in any weight dtype, so a bfloat16 check there is
    an exactness check: a reference one token off (negative control) fails it."""
    assert main(["check", "--model", "tiny-llama", "--method", "decoy", "--prompts", "3", "--max-new-tokens", "12",
                 "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "agreement rate" not in out and out.strip().splitlines()[-1] == "3 passed, 0 failed"
    import recap.check

    real = recap.check.reference_generate

    def one_off(target, inputs, max_new_tokens, eos_token_ids=None):
        tokens = real(target, inputs, max_new_tokens, eos_token_ids)
        return tokens[:-1] + [tokens[-1] + 1]

    monkeypatch.setattr(recap.check, "reference_generate", one_off)
    assert main(["check", "--model", "tiny-llama", "--method", "decoy", "--prompts", "1", "--max-new-tokens", "8",
                 "--dtype", "bfloat16"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_overhead_json_has_the_per_iteration_total(capsys):
    assert main(["overhead", "--method", "recap", "--requests", "1", "--max-new-tokens", "24", "--vocab", "4096",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["total_ms_median"] > 0 and result["method"] == "recap"
    # Cost-aware RECAP splits propose into candidates and the size choice (recap-paper: search, suffix).
    assert {"propose", "packing", "observe", "candidates", "choice", "refresh", "automaton"} <= set(result["stages"])


def test_demo_runs_and_checks_identity(capsys):
    assert main(["demo", "--model", "tiny-llama", "--max-new-tokens", "6", "--methods", "pld,recap"]) == 0
    out = capsys.readouterr().out
    assert "outputs identical to AR: yes" in out and "recap" in out


def test_demo_refuses_unknown_methods(capsys):
    assert main(["demo", "--model", "tiny-llama", "--methods", "ar"]) == 2


def test_check_with_recap_and_an_ablation(capsys):
    assert main(["check", "--model", "tiny-llava-next", "--method", "recap", "--ablation", "gate", "--prompts", "4",
                 "--max-new-tokens", "16", "--vary"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "4 passed, 0 failed"


def test_demo_on_a_vision_language_model_saves_its_scenes(capsys, tmp_path):
    assert main(["demo", "--model", "tiny-llava-next", "--max-new-tokens", "6", "--methods", "recap",
                 "--out", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == len(DEMO_SCENES)
    out = capsys.readouterr().out
    assert "truth:" in out and "outputs identical to AR: yes" in out and pngs[0] in out


def test_demo_memory_column_starts_recap_from_a_saved_memory(capsys, tmp_path):
    path = tmp_path / "memory.safetensors"
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Earlier request.", "--method", "recap",
                 "--memory", str(path), "--max-new-tokens", "8"]) == 0
    capsys.readouterr()
    assert main(["demo", "--model", "tiny-llama", "--max-new-tokens", "6", "--methods", "recap",
                 "--memory", str(path)]) == 0
    out = capsys.readouterr().out
    assert "recap+memory" in out and "outputs identical to AR: yes" in out
    path.write_bytes(b"not a memory")
    assert main(["demo", "--model", "tiny-llama", "--methods", "recap", "--memory", str(path)]) == 2
    assert "memory" in capsys.readouterr().err


def test_check_with_a_temperature_runs_the_distribution_test(capsys):
    assert main(["check", "--model", "tiny-llama", "--method", "recap", "--prompts", "1", "--temperature", "1.0",
                 "--top-k", "4", "--samples", "300"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "1 passed, 0 failed" and "alpha 0.001" in out[-2]


def test_generate_with_a_seed_gives_the_same_text_with_every_method(capsys):
    texts = []
    for method in ("ar", "recap", "pld"):
        assert main(["generate", "--model", "tiny-llama", "--prompt", "Once upon a time", "--method", method,
                     "--max-new-tokens", "10", "--temperature", "0.9", "--top-k", "20", "--seed", "5", "--json"]) == 0
        texts.append(json.loads(capsys.readouterr().out)["tokens"])
    assert texts[0] == texts[1] == texts[2]
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--temperature", "1", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
